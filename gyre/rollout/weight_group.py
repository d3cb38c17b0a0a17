"""Weights broadcast from a trainer to engines over a process group of their own: SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed``.

For engines that do not share the trainer's GPUs (a standalone pool, a remote SGLang server), the
trainer opens a small process group with every engine -- rank 0 the trainer, then each engine's
TP ranks -- next to, not inside, the job's default group (:func:`open_weight_group`, built as
SGLang builds its side: a ``tcp://`` rendezvous hosted by rank 0, a store prefixed with the group
name, torch's process-group constructor).  Each update then names
the tensors of a bucket over HTTP (names, dtypes, shapes) while the trainer broadcasts them in
that order; each engine receives and loads them and answers when done
(:class:`WeightBroadcaster`).  One broadcast reaches every engine at once.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Mapping, Sequence

import torch

DEFAULT_GROUP = "weight_update_group"


@dataclass
class WeightGroup:
    """One rank's membership of a weight-update group (keep ``store`` referenced while it is used)."""

    rank: int
    world_size: int
    backend: str
    process_group: object
    store: object

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` from rank ``src`` (in place on the others); blocks until done."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.process_group.broadcast([tensor], opts).wait()


def open_weight_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                      group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                      timeout_s: float = 300.0) -> WeightGroup:
    """Join the weight-update group ``group_name`` as ``rank`` (rank 0 hosts its TCPStore at
    ``master_address:master_port``).  Blocks until every rank has joined (or ``timeout_s``).

    Built the way an SGLang server builds its side of ``/init_weights_update_group``: the TCPStore
    of a ``tcp://`` rendezvous, the store prefixed with ``group_name``, and torch's own
    process-group constructor with that group name (which prefixes the store keys again, by group
    and device), so a trainer and SGLang's ranks meet at the same keys.  The group is not the
    default one and needs none; one process can be in a given group once.

    Raises:
        ValueError: an unknown backend or a rank outside ``[0, world_size)``.
        RuntimeError / DistStoreError: the others did not join in time.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, not {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a group of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    # the store a tcp:// rendezvous makes, built here: torch's rendezvous hosts no store under
    # torchrun (TORCHELASTIC_USE_AGENT_STORE), and rank 0 of this group must host it
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False, multi_tenant=True)
    prefixed = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), prefixed,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == rank, as new_group records
    return WeightGroup(rank, world_size, backend, pg, store)


def close_weight_group(group: WeightGroup) -> None:
    """Leave ``group`` (destroys its process group; the store goes with the last reference)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group.process_group)
    except (ValueError, RuntimeError):  # already destroyed
        pass


def engine_rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """``(rank_offset of each engine, world size)`` of a weight-update group with the trainer as
    rank 0: an engine of TP size ``t`` holds ``t`` consecutive ranks (its TP rank ``r`` joins as
    ``rank_offset + r``, as SGLang does)."""
    offsets, nxt = [], 1
    for t in tp_sizes:
        if int(t) < 1:
            raise ValueError(f"an engine's TP size must be >= 1, not {t}")
        offsets.append(nxt)
        nxt += int(t)
    return offsets, nxt


class WeightBroadcaster:
    """The trainer's side: rank 0 of a weight-update group with ``clients``' engines (an engine
    of TP size ``t`` holds ``t`` ranks, :func:`engine_rank_offsets`).

    Args:
        clients: engine clients (:class:`gyre.rollout.client.engine_client.EngineClient`).
        master_address, master_port: where this process hosts the group's store (reachable by the engines).
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        device: where the broadcast tensors are put before sending (``cpu`` for gloo).
        tp_sizes: each engine's TP size (default 1 each).
    """

    def __init__(self, clients: Sequence, master_address: str, master_port: int, *, backend: str = "gloo",
                 group_name: str = DEFAULT_GROUP, device: str = "cpu", timeout_s: float = 300.0,
                 tp_sizes: Sequence[int] | None = None):
        self.clients = list(clients)
        self.group_name, self.device = group_name, device
        tp_sizes = [1] * len(self.clients) if tp_sizes is None else list(tp_sizes)
        if len(tp_sizes) != len(self.clients):
            raise ValueError(f"{len(tp_sizes)} TP sizes for {len(self.clients)} engines")
        offsets, world = engine_rank_offsets(tp_sizes)
        pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))
        try:  # the engines join while this process hosts the store and joins as rank 0
            joins = [pool.submit(c.init_weights_update_group, master_address=master_address, master_port=master_port,
                                 rank_offset=off, world_size=world, group_name=group_name, backend=backend)
                     for c, off in zip(self.clients, offsets)]
            self.group = open_weight_group(master_address, master_port, 0, world, group_name=group_name,
                                           backend=backend, timeout_s=timeout_s)
            for j in joins:
                j.result()
        finally:
            pool.shutdown(wait=False)
        self._lock = threading.Lock()

    def push(self, buckets: Iterable[Mapping[str, torch.Tensor]], weight_version: str) -> int:
        """Broadcast ``buckets`` (HF-named tensors) to every engine as ``weight_version``: per
        bucket one ``/update_weights_from_distributed`` call per engine, all answered before the
        next bucket; only the last bucket flushes the cache (engines admit nothing in between).
        Returns the tensors sent.

        Raises:
            ValueError: there was no bucket.
            the first engine error (after the bucket's broadcast completed).
        """
        from gyre.rollout.weights import load_buckets_in_order

        return load_buckets_in_order(self.push_bucket, buckets, weight_version)

    def push_bucket(self, bucket: Mapping[str, torch.Tensor], weight_version: str, *, flush_cache: bool) -> int:
        """Broadcast one bucket: each engine is told the names, dtypes and shapes
        (``/update_weights_from_distributed``) while the tensors go out in that order; returns
        once every engine has answered.  Returns the tensors sent.

        Raises:
            the first engine error (after the broadcast completed).
        """
        pairs = list(bucket.items())
        names = [n for n, _ in pairs]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in pairs]
        shapes = [list(t.shape) for _, t in pairs]
        with self._lock, ThreadPoolExecutor(max_workers=max(1, len(self.clients))) as pool:
            calls = [pool.submit(c.update_weights_from_distributed, names=names, dtypes=dtypes, shapes=shapes,
                                 group_name=self.group_name, weight_version=weight_version, flush_cache=flush_cache)
                     for c in self.clients]
            for _, t in pairs:
                self.group.broadcast(t.detach().to(self.device).contiguous())
            for c in calls:
                c.result()
        return len(pairs)

    def close(self) -> None:
        """Tell the engines to leave the group (best effort), then leave it."""
        for c in self.clients:
            try:
                c.destroy_weights_update_group(group_name=self.group_name)
            except Exception:  # an engine already gone has nothing to leave
                pass
        close_weight_group(self.group)
