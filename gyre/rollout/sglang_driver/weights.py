"""Weight transfer to an SGLang cell's server, in the call order SGLang needs.

:func:`serialize_named_tensors_for_sglang` makes SGLang's own ``serialized_named_tensors`` (CUDA IPC
handles, or shared-memory files for host tensors); :class:`SGLangTensorClient` sends a cell's
weights that way to a server on its own node, :class:`SGLangGroupClient` broadcasts them over a
weight-update group to a server spanning nodes.  Both order a bucketed push the same way
(``_SGLangPushOrder``): pause, flush until idle, load inside a weight-update session where the
server has them (:mod:`gyre.rollout.client.sglang_protocol`), continue; a push that fails leaves the
server paused (:class:`WeightPushFailed`).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterable, Mapping

from gyre.rollout.ports import free_port


def serialize_named_tensors_for_sglang(named: Mapping[str, Any] | Iterable[tuple[str, Any]], tp_size: int = 1
                                       ) -> list[str]:
    """SGLang's ``serialized_named_tensors`` (``MultiprocessingSerializer``, one per TP rank).

    GPU tensors travel as CUDA IPC handles: SGLang's patch of torch's tensor reductions is applied
    first (as SGLang's own senders do), so each handle names its GPU by UUID and the server's ranks
    find it whatever their ``CUDA_VISIBLE_DEVICES``.  Host tensors (an SGLang server on the CPU)
    travel as shared-memory files: torch's ``file_system`` sharing strategy is set first, since a
    file descriptor passed the default way cannot be opened by the server's scheduler process, and
    SGLang's patch is not applied (it rewrites every tensor's reduction as a CUDA one and fails on a
    host tensor).  The sender must keep the tensors alive until the server has answered.

    Raises:
        ImportError: SGLang is not installed.
    """
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        from sglang.srt.utils.common import MultiprocessingSerializer  # newer layout
    pairs = list(named.items()) if isinstance(named, Mapping) else list(named)
    on_host = [getattr(t, "device", None) is not None and t.device.type == "cpu" for _, t in pairs]
    if any(on_host):
        if not all(on_host):
            raise ValueError("a weight bucket for SGLang mixes host and GPU tensors")
        import torch.multiprocessing

        torch.multiprocessing.set_sharing_strategy("file_system")
    else:
        try:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError:  # an SGLang without the patch: device indices as torch writes them
            pass
        else:
            monkey_patch_torch_reductions()
    return [MultiprocessingSerializer.serialize(pairs, output_str=True) for _ in range(tp_size)]


class WeightPushFailed(RuntimeError):
    """A live weight push to an SGLang server failed part-way; the server stays paused."""


class _SGLangPushOrder:
    """Bucketed weight loads in the order an SGLang server needs (the cell clients below)."""

    client: Any
    #: The server's hierarchical cache writes to a shared store (``--rollout-shared-kv-store``):
    #: its keys are token hashes with no weight version, so every load empties it.
    clear_shared_store: bool = False
    #: How long a live push waits for the aborted requests to leave the engine.
    idle_timeout_s: float = 30.0
    #: Whether the server loads weights only inside a weight-update session
    #: (:func:`gyre.rollout.client.sglang_protocol.probe_weight_update_sessions`, asked at the first load).
    sessions: bool | None = None
    #: Why the last live push failed (the engine is paused since), ``None`` after one that succeeded.
    failed: str | None = None
    _session_open: bool = False

    @contextlib.contextmanager
    def weight_update_session(self):
        """Around weight loads: ``/begin_weight_update`` ... ``/end_weight_update`` where the server
        has sessions (SGLang 0.5.23 and newer), nothing otherwise; a session already open by this
        client is reused (a push's buckets share one).  The first call asks the server whether it
        has sessions, which also closes one an earlier client left open; a begin refused because a
        session is open all the same ends that session and begins again."""
        if self.sessions is None:
            from gyre.rollout.client.sglang_protocol import probe_weight_update_sessions

            self.sessions = probe_weight_update_sessions(self.client)
        if self._session_open or not self.sessions:
            yield
            return
        self._begin()
        self._session_open = True
        try:
            yield
        finally:
            self._session_open = False
            self.client.end_weight_update()

    def _begin(self) -> None:
        from gyre.rollout.client.messages import EngineError

        try:
            self.client.begin_weight_update()
        except EngineError as exc:
            if exc.status_code != 400 or "already open" not in str(exc.message):
                raise
            self.client.end_weight_update()  # left open by a load that never ended it
            self.client.begin_weight_update()

    def update_weights_from_tensor(self, named_tensors=None, *, weight_version: str, **kw) -> dict:
        raise NotImplementedError

    def _after_load(self) -> None:
        if self.clear_shared_store:
            self.client.clear_hicache_storage()

    def push_weight_buckets(self, buckets, weight_version: str, *, live: bool = True) -> int:
        """Load ``buckets`` as :func:`gyre.rollout.weights.push_weight_buckets` asks.

        Live (the engine serves rollouts): pause in ``abort`` mode (every running request ends
        with an abort and its partial output, which the proxy retries; new requests wait), flush
        the prefix cache until it succeeds (:func:`~gyre.rollout.client.engine_client.flush_when_idle`:
        SGLang flushes only when idle), load every bucket, the last one flushing again, and
        continue.  So no prefix computed under the old weights survives the push, and each of a
        request's attempts ran on one version.  A live push that fails does not continue: the
        engine stays paused (requests sent to it wait, none is served on the half-loaded weights
        SGLang already labels with the new version), :attr:`failed` says why, and the error is
        :class:`WeightPushFailed`; the next push that succeeds clears :attr:`failed` and
        continues.  Not live (a role switch: generation paused, nothing running): the buckets in
        order, the last flushing.  ``buckets`` is consumed to its end even when a call fails.  With
        :attr:`clear_shared_store` the shared KV store is emptied after the load (KV written by a
        cell not yet updated may still reach it, until that cell's own load empties it again).
        Returns the tensors loaded.

        Raises:
            ValueError: there was no bucket (nothing paused).
            WeightPushFailed: a call of a live push failed.
        """
        from gyre.rollout.client.engine_client import flush_when_idle
        from gyre.rollout.weights import load_buckets_in_order

        if not live:
            with self.weight_update_session():
                loaded = load_buckets_in_order(self.update_weights_from_tensor, buckets, weight_version)
            self._after_load()
            return loaded
        it = iter(buckets)
        first = next(it, None)
        if first is None:
            raise ValueError("no weights to push")
        buckets = itertools.chain([first], it)
        try:
            self.client.pause_generation("abort")
            flush_when_idle(self.client, self.idle_timeout_s)
            with self.weight_update_session():
                loaded = load_buckets_in_order(self.update_weights_from_tensor, buckets, weight_version)
            self._after_load()
        except Exception as exc:
            for _ in buckets:  # keep the other ranks' collectives matched after an early failure
                pass
            # SGLang sets the version label at each bucket it loads: the engine may now hold part
            # of the new weights under the new label, so it stays paused (serves nothing).
            self.failed = f"{type(exc).__name__}: {exc}"
            raise WeightPushFailed(f"a live push of weight version {weight_version} failed; the engine "
                                   f"stays paused until a push succeeds: {self.failed}") from exc
        self.failed = None
        self.client.continue_generation()
        return loaded

    def __getattr__(self, name: str):
        return getattr(self.client, name)


class SGLangTensorClient(_SGLangPushOrder):
    """An engine client whose tensor weight updates are made for an engine on this node's GPUs.

    ``update_weights_from_tensor(named_tensors, ...)`` moves the tensors to ``device`` (the cell's
    GPU, which the colocated SGLang server can open by CUDA IPC), serializes them once per engine
    TP rank with ``serialize(pairs, tp_size)`` (default: SGLang's own serializer,
    :func:`serialize_named_tensors_for_sglang`) and sends them with ``load_format``; the tensors stay
    referenced until the engine has answered.  Every other call goes to ``client`` unchanged.
    """

    def __init__(self, client, device: str, tp_size: int, *, serialize=None, load_format: str | None = None):
        self.client, self.device, self.tp_size = client, device, tp_size
        self.serialize = serialize if serialize is not None else serialize_named_tensors_for_sglang
        self.load_format = load_format

    def update_weights_from_tensor(self, named_tensors=None, *, weight_version: str, **kw) -> dict:
        if named_tensors is None:
            return self.client.update_weights_from_tensor(weight_version=weight_version, **kw)
        import torch

        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        pairs = [(name, t.detach().to(self.device, non_blocking=True)) for name, t in items]
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies exist before another process opens them
        payloads = self.serialize(pairs, self.tp_size)
        with self.weight_update_session():
            answer = self.client.update_weights_from_tensor(serialized_named_tensors=payloads,
                                                            load_format=self.load_format,
                                                            weight_version=weight_version, **kw)
        del pairs  # only now may the engine's handles go stale
        if torch.device(self.device).type == "cuda":
            torch.cuda.ipc_collect()  # free what the engine has let go of
        return answer


class SGLangGroupClient(_SGLangPushOrder):
    """An engine client whose tensor weight updates are broadcast to every TP rank of the engine
    over a weight-update group (SGLang's ``/init_weights_update_group`` +
    ``/update_weights_from_distributed``, :class:`gyre.rollout.weight_group.WeightBroadcaster`):
    for a server spanning several nodes, whose ranks cannot open a CUDA IPC handle made on
    another node.  The group is opened at the first update, on gloo (host tensors sent, each
    rank receiving into its GPU; no NCCL rank shares a GPU with an engine rank), with this
    process as rank 0 at ``master_address``.  Every other call goes to ``client`` unchanged.
    """

    def __init__(self, client, tp_size: int, master_address: str, *, group_name: str = "gyre_cell_weights",
                 timeout_s: float = 600.0):
        self.client, self.tp_size, self.master_address = client, tp_size, master_address
        self.group_name, self.timeout_s = group_name, timeout_s
        self.broadcaster = None

    def update_weights_from_tensor(self, named_tensors=None, *, weight_version: str, flush_cache: bool = True,
                                   **kw) -> dict:
        if named_tensors is None:
            return self.client.update_weights_from_tensor(weight_version=weight_version, flush_cache=flush_cache, **kw)
        if kw:
            raise TypeError(f"a broadcast weight update takes no {sorted(kw)}")
        from gyre.rollout.weight_group import WeightBroadcaster

        if self.broadcaster is None:
            self.broadcaster = WeightBroadcaster([self.client], self.master_address, free_port(self.master_address),
                                                 backend="gloo", group_name=self.group_name, device="cpu",
                                                 timeout_s=self.timeout_s, tp_sizes=[self.tp_size])
        named = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        with self.weight_update_session():
            self.broadcaster.push_bucket(named, weight_version, flush_cache=flush_cache)
        return {"success": True}

    def close(self) -> None:
        """Leave the weight-update group (the engine is told to leave too)."""
        if self.broadcaster is not None:
            self.broadcaster.close()
            self.broadcaster = None
