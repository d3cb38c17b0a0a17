"""Start-up pieces of every rank of the main job (:func:`gyre.runtime.pretrain.pretrain`): its
process group and device, the run's TCPStore, and the SGLang server a cell launches.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from gyre.runtime.job_checks import check_gpu_runtime, gpus_per_node


def init_distributed(args: argparse.Namespace, timeout) -> torch.device:
    """This rank's process group; returns its device.  ``--backend cpu``: gloo.  ``--backend gpu``:
    the GPU ``LOCAL_RANK`` (modulo the GPUs present, so that ``--distributed-backend gloo`` ranks can
    share one), NCCL for CUDA tensors and gloo for CPU tensors and objects (one group serving both)."""
    import torch.distributed as dist

    if args.backend == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    check_gpu_runtime(args)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    backend = "cuda:nccl,cpu:gloo" if args.distributed_backend == "nccl" else "gloo"
    dist.init_process_group(backend, timeout=timeout)
    return device


def sglang_cell_engine(args, cell_group, device, host: str, model_dir: str, version: int):
    """The SGLang process this rank launches for its cell, not started (``None`` if it launches none):
    the server spans the cell's GPUs (:mod:`gyre.runtime.gpu_cells`); over several nodes, the first
    rank of each of the cell's nodes launches one process and the leader's answers HTTP.  Collective:
    every rank calls it (the leaders share the address of SGLang's multi-node rendezvous)."""
    import torch.distributed as dist

    from gyre.rollout.ports import free_port
    from gyre.rollout.sglang_driver.engine import SGLangCellEngine
    from gyre.runtime.gpu_cells import GpuCellLayout, sglang_cell_argv

    lay = cell_group.layout
    world = dist.get_world_size()
    gpus = GpuCellLayout(args.num_cells, lay.ranks_per_cell, gpus_per_node(world))
    boxes: list[Any] = [None] * world
    dist.all_gather_object(boxes, (host, free_port(host)) if lay.shard == 0 else None)
    leader_host, dist_port = boxes[lay.leaders()[lay.cell]]
    if not gpus.launches_server(lay.shard):
        return None
    argv = sglang_cell_argv(gpus, lay.shard, device.index or 0, leader_host=leader_host, dist_port=dist_port)
    if getattr(args, "sglang_weight_version", None) is None:
        argv += ["--weight-version", str(version)]
    node = lay.shard // gpus.gpus_per_node
    return SGLangCellEngine.from_args(args, host=host, extra_argv=argv, model_path=model_dir, device=str(device),
                                      tp_size=lay.ranks_per_cell, nnodes=gpus.nodes_per_cell,
                                      log_path=Path(args.run_dir) / f"sglang_cell{lay.cell}_node{node}.log")


def sglang_cpu_cell_engine(args, cell: int, host: str, model_dir: str, version: int):
    """The SGLang server of a cell of one rank on the CPU, not started: the SGLang environment's
    launcher (``--device cpu --dtype float32``), its scheduler sleeping when idle (it polls
    otherwise, a core's worth of CPU per server)."""
    from gyre.rollout.sglang_driver.engine import SGLangCellEngine
    from gyre.rollout.sglang_driver.launch import cpu_server_launcher

    argv = ["--sleep-on-idle", "--random-seed", str(args.seed + 1000 * cell)]
    if getattr(args, "sglang_weight_version", None) is None:
        argv += ["--weight-version", str(version)]
    return SGLangCellEngine.from_args(args, host=host, extra_argv=argv, model_path=model_dir, device="cpu",
                                      tp_size=1, launcher=[str(cpu_server_launcher())],
                                      log_path=Path(args.run_dir) / f"sglang_cell{cell}.log")


def open_store(rank: int, world: int, host: str):
    """The run's TCPStore: rank 0 hosts it, reached at ``host`` (its :func:`gyre.network.node_address`).
    Returns ``(store, connect)``; ``connect()`` opens another client -- one per thread that blocks
    in ``wait`` (a client serialises its calls)."""
    import torch.distributed as dist

    box: list[Any] = [None]
    store = None
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
        box = [(host, store.port)]
    dist.broadcast_object_list(box, src=0)

    def connect():
        return dist.TCPStore(box[0][0], box[0][1], world, is_master=False)

    return (store if rank == 0 else connect()), connect
