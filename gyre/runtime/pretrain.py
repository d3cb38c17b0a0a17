"""The main job behind ``pretrain_gyre.py``: start-up of the cells and of rank 0's controller.

``WORLD_SIZE = num_cells x TP x PP`` (gloo): a cell is ``TP x PP`` contiguous ranks
(:mod:`gyre.runtime.cell_group`; the CPU default is one rank per cell), whose training replica is
megatron-core (``--training-backend megatron``, sharded over the cell's ranks) or
``transformers`` (``hf``, one rank per cell).  Start-up, in order: the torch.distributed group and
a TCPStore (control plane and micro-step streams) -> Megatron's parallel state, the prefix groups
and the cell groups -> each rank's training shard, each leader's engine -> one weight snapshot per
core shard (Mooncake over TCP) -> on rank 0 the proxy (routes ``engine-{c}`` to every cell's
engine), the standalone pool's engines (``--standalone-engines``, :mod:`gyre.runtime.standalone`,
routed as ``standalone-{i}``), the harness and the tasks, the core's cell loop in a thread and
the controller (:class:`gyre.runtime.controller.Controller`) in the main thread.  Other ranks run their cell loop.
Resume (``--load DIR``, :mod:`gyre.runtime.checkpointing`): the newest checkpoint gives the policy
(every cell starts from it), the core's optimizer state, the controller's state and the steps done.

The checks before start-up are :mod:`gyre.runtime.job_checks`; a rank's process group, the TCPStore
and the SGLang cell servers :mod:`gyre.runtime.rank_setup`; rank 0's proxy, standalone pool and
controller :mod:`gyre.runtime.rank0`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from gyre.arguments import ArgumentError
from gyre.process_guard import RunDirectoryLock, RunDirectoryLockedError
from gyre.runtime.checkpointing import ControllerState, find_checkpoint
from gyre.runtime.rank_setup import init_distributed, open_store, sglang_cell_engine, sglang_cpu_cell_engine


def pretrain(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the main job on this rank; rank 0 returns the summary, others ``None``."""
    from datetime import timedelta

    import torch.distributed as dist

    from gyre.network import node_address
    from gyre.runtime.rank0 import run_rank0
    from gyre.training.weight_snapshot import CoreSnapshotStamps, MooncakeSnapshotClient
    from gyre.transfer_engine import set_transport

    set_transport(args.weight_transport.removeprefix("mooncake-"), args.weight_transport_device)
    device = init_distributed(args, timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = find_checkpoint(args.load) if args.load else None
    resume = ControllerState.load(ckpt) if ckpt else None
    start_step = resume.iteration if resume else 0
    lock = _claim_run_dir(args) if rank == 0 else None  # held while pretrain runs
    model_dir = _model_dir(args, ckpt, rank)
    host = node_address()  # where other ranks reach this rank's servers (loopback on one machine)
    store, connect = open_store(rank, world, host)
    worker, layout, sglang = _start_cell(args, rank, device, host, store, connect, model_dir, ckpt, start_step)
    server, handles, urls = _share_snapshot_and_engines(worker, layout, host, world, start_step)
    if rank != 0:
        worker.run()
        if sglang is not None and layout.shard != 0:
            sglang.stop()
        dist.barrier()
        return None
    per_cell = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    stamps = CoreSnapshotStamps(server, [MooncakeSnapshotClient(h, host=host, header_only=True)
                                         for h in handles[1:per_cell]])
    summary = run_rank0(args, store, connect, worker, stamps, urls, model_dir, ckpt, resume)
    dist.barrier()  # only on success: the other ranks reach it after Shutdown (a failure ends the job instead)
    lock.release()
    return summary


def _claim_run_dir(args: argparse.Namespace) -> RunDirectoryLock:
    """Rank 0: take the run directory's lock, say where it is, write ``args.json`` (the flags, but
    ``--admin-token``: a secret stays out of the run directory and of W&B's copy)."""
    run_dir = Path(args.run_dir)
    try:
        lock = RunDirectoryLock(run_dir).acquire()
    except RunDirectoryLockedError as exc:
        raise ArgumentError(f"argument --run-dir: {exc}") from None
    print(f"gyre: run directory {run_dir.resolve()}", file=sys.stderr, flush=True)
    (run_dir / "args.json").write_text(json.dumps({k: v for k, v in vars(args).items()
                                                   if isinstance(v, (str, int, float, bool, list, type(None)))
                                                   and k != "admin_token"},
                                                  indent=1))
    return lock


def _model_dir(args: argparse.Namespace, ckpt: Path | None, rank: int) -> str:
    """The policy every cell starts from: the checkpoint's ``hf/``, ``--model-dir``, else the
    embedded tiny model (built by rank 0 while the others wait)."""
    import torch.distributed as dist

    from gyre.embedded_model import ensure_tiny_model

    if ckpt is not None:
        return str(ckpt / "hf")
    if args.model_dir:
        return args.model_dir
    if rank == 0:
        ensure_tiny_model(args.tokenizer_kind, args.model_cache_dir)
    dist.barrier()
    return str(ensure_tiny_model(args.tokenizer_kind, args.model_cache_dir))


def _start_cell(args, rank: int, device, host: str, store, connect, model_dir: str, ckpt: Path | None,
                start_step: int):
    """This rank's part of its cell: Megatron's parallel state, the prefix and cell groups, the
    training shard (with the checkpoint's optimizer state on the core), the cell's SGLang server
    if any, and the :class:`~gyre.runtime.cell_worker.CellWorker`.  Returns ``(worker, layout, sglang)``
    (``layout``: this rank's place in the cells, a :class:`~gyre.runtime.cell_group.CellLayout`)."""
    from gyre.embedded_model import load_hf_model
    from gyre.runtime.cell_group import CellGroup
    from gyre.runtime.cell_worker import CellWorker
    from gyre.runtime.checkpointing import optimizer_file
    from gyre.runtime.config import CellConfig
    from gyre.training.prefix_groups import PrefixGroups
    from gyre.training.backends import build_train_step

    per_cell = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.training_backend == "megatron":
        # Megatron's parallel state over every rank: its model-parallel groups (TP x PP) are the cells,
        # contiguous ranks; its data-parallel group is never used -- cells sum gradients over prefix groups
        from gyre.training.megatron_model import initialize_megatron_cpu

        initialize_megatron_cpu(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, seed=args.seed,
                                order="tp-cp-ep-pp-dp", cpu=device.type == "cpu")
    groups = PrefixGroups.build(args.num_cells, per_cell)  # shard s of cells 0..k
    cell_group = CellGroup.build(rank, args.num_cells, per_cell, connect() if rank == 0 else store)
    cell, shard = cell_group.layout.cell, cell_group.layout.shard
    initial = "training" if args.placement == "async" and cell < args.train_cells else "rollout"
    torch.manual_seed(args.seed)
    model = load_hf_model(model_dir).to(device)
    model.train()
    train_step = build_train_step(args, model)
    del model  # the Megatron replica holds converted copies; the HF replica keeps its own reference
    if ckpt is not None and cell == 0:
        train_step.optimizer.load_state_dict(torch.load(optimizer_file(ckpt, shard), weights_only=True))
    if args.rollout_engine != "sglang":
        sglang = None
    elif device.type == "cpu":
        sglang = sglang_cpu_cell_engine(args, cell, host, model_dir, start_step)
    else:
        sglang = sglang_cell_engine(args, cell_group, device, host, model_dir, start_step)
    worker = CellWorker(CellConfig.from_args(args), cell, connect() if rank == 0 else store, groups, model_dir,
                        train_step, start_version=start_step, initial_role=initial, host=host, cell_group=cell_group,
                        device=str(device), engine=sglang if shard == 0 else None)
    if sglang is not None and shard != 0:  # another node of a multi-node cell: its part of the server
        sglang.start(wait_healthy=False)
    return worker, cell_group.layout, sglang


def _share_snapshot_and_engines(worker, layout, host: str, world: int, version: int):
    """Collective: the core's ranks publish one weight snapshot per shard (shard s of a satellite
    reads shard s of the core), of ``version``; every rank learns the snapshot handles and the cells' engine URLs.
    Returns ``(server, handles, urls)``: the core's snapshot server on its ranks (else ``None``),
    the handle of every rank, and the engine URL of every cell's leader."""
    import torch.distributed as dist

    from gyre.runtime.cell_worker import Snapshot
    from gyre.training.weight_snapshot import MooncakeSnapshotClient, MooncakeSnapshotServer, flat_numel

    server, handle = None, None
    if layout.cell == 0:
        tensors = worker.training.host_tensors()
        server = MooncakeSnapshotServer(flat_numel(tensors), host=host)
        server.publish(tensors, version=version)
        worker.snapshot = Snapshot(server=server)
        handle = server.handle
    handles: list[Any] = [None] * world
    dist.all_gather_object(handles, handle)
    if layout.cell != 0:
        worker.snapshot = Snapshot(client=MooncakeSnapshotClient(handles[layout.shard], host=host))
    urls: list[Any] = [None] * world
    dist.all_gather_object(urls, worker.engine.url if worker.engine is not None else None)
    return server, handles, [urls[r] for r in layout.leaders()]
