"""The main job behind ``pretrain_gyre.py`` (DESIGN.md §2): cells, controller, shutdown, resume.

Every rank is one cell (the CPU default: ``--tensor/pipeline-model-parallel-size 1``, gloo); its
training replica is megatron-core (``--training-backend megatron``) or ``transformers`` (``hf``).
Start-up, in order: the torch.distributed group and a TCPStore (control plane and micro-step
streams) -> the prefix groups -> each cell's training replica and engine -> the core's weight
snapshot (Mooncake over TCP) -> on rank 0 the proxy (routes ``engine-{c}`` to every cell's
engine), the harness and the tasks, the core's cell loop in a thread and the controller
(:class:`gyre.runtime.controller.Controller`) in the main thread.  Other ranks run their cell loop.

Resume (``--load DIR``): the newest ``DIR/checkpoints/iter_N`` (``latest_checkpointed_iteration.txt``,
Megatron's name) gives the policy (``hf/``, every cell starts from it), the core's optimizer state,
the controller's state (executions already trained, RNG, reward history) and ``N`` steps done.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gyre.arguments import ArgumentError

logger = logging.getLogger(__name__)


def check_main_job_args(args: argparse.Namespace) -> None:
    """Checks of the main job beyond :func:`gyre.arguments.validate_args` (before anything starts).

    Raises:
        ArgumentError: one line naming the flag.
    """
    if args.backend != "cpu":
        raise ArgumentError("argument --backend: the GPU main job needs the SGLang cell adapter (issue #8); "
                            "this build runs --backend cpu")
    if args.tasks is None:
        raise ArgumentError("argument --tasks: the main job needs a task file or directory")
    if args.tensor_model_parallel_size * args.pipeline_model_parallel_size != 1 or \
            getattr(args, "ranks_per_cell", 1) != 1:
        raise ArgumentError(f"argument --num-cells: the CPU main job runs one rank per cell; "
                            f"WORLD_SIZE={getattr(args, 'world_size', '?')} with --num-cells {args.num_cells} "
                            f"and TP*PP={args.tensor_model_parallel_size * args.pipeline_model_parallel_size}")
    if args.standalone_engines:
        raise ArgumentError("argument --standalone-engines: the main job serves rollouts from cells only")
    if args.rollout_engine != "embedded" and args.backend == "cpu":
        raise ArgumentError("argument --rollout-engine: --backend cpu serves from the embedded engine")
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ArgumentError("argument --wandb-project: the wandb package is not installed "
                                "(bash tools/setup.sh installs it)") from None
    if args.load is not None:
        ckpt = find_checkpoint(args.load)
        if ckpt is None:
            raise ArgumentError(f"argument --load: no checkpoint under {args.load}")
        saved = json.loads((ckpt / "controller.json").read_text()).get("training_backend", "hf")
        if saved != args.training_backend:
            raise ArgumentError(f"argument --load: {ckpt} holds a --training-backend {saved} optimizer state; "
                                f"this run asks for {args.training_backend}")
    from gyre.tasks import load_tasks

    try:
        res = load_tasks(args.tasks.split(","))
    except Exception as exc:
        raise ArgumentError(f"argument --tasks: {exc}") from None
    if not res.tasks:
        raise ArgumentError(f"argument --tasks: no valid task in {args.tasks}"
                            + (f" ({res.problems[0]})" if res.problems else ""))


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``path`` (a run dir, its ``checkpoints/`` or an
    ``iter_N`` dir), or ``None``."""
    p = Path(path)
    if (p / "controller.json").exists():
        return p
    for root in (p / "checkpoints", p):
        tracker = root / "latest_checkpointed_iteration.txt"
        if tracker.exists():
            d = root / f"iter_{int(tracker.read_text().strip()):07d}"
            if (d / "controller.json").exists():
                return d
    return None


def _store(rank: int, world: int):
    """The run's TCPStore: rank 0 hosts it.  Returns ``(store, connect)``; ``connect()`` opens
    another client -- one per thread that blocks in ``wait`` (a client serialises its calls)."""
    import torch.distributed as dist

    box: list[Any] = [None]
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        box = [store.port]
    dist.broadcast_object_list(box, src=0)

    def connect():
        return dist.TCPStore("127.0.0.1", box[0], world, is_master=False)

    return (store if rank == 0 else connect()), connect


def pretrain(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the main job on this rank; rank 0 returns the summary, others ``None``."""
    from datetime import timedelta

    import torch.distributed as dist

    from gyre.embedded_model import ensure_tiny_model
    from gyre.runtime.cell_worker import CellWorker, Snapshot
    from gyre.training.prefix_groups import PrefixGroups
    from gyre.training.weight_snapshot import MooncakeSnapshotClient, MooncakeSnapshotServer, flat_numel

    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(args.run_dir)
    ckpt = find_checkpoint(args.load) if args.load else None
    ctrl_state: dict[str, Any] = json.loads((ckpt / "controller.json").read_text()) if ckpt else {}
    start_step = int(ctrl_state.get("iteration", 0))
    args.start_version = start_step
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps({k: v for k, v in vars(args).items()
                                                       if isinstance(v, (str, int, float, bool, list, type(None)))},
                                                      indent=1))
    if ckpt is not None:
        model_dir = str(ckpt / "hf")
    elif args.model_dir:
        model_dir = args.model_dir
    else:
        if rank == 0:
            ensure_tiny_model(args.tokenizer_kind, args.model_cache_dir)
        dist.barrier()
        model_dir = str(ensure_tiny_model(args.tokenizer_kind, args.model_cache_dir))
    store, connect = _store(rank, world)
    if args.training_backend == "megatron":
        # Megatron's parallel state over every rank (TP = PP = 1: each rank its own model-parallel
        # group); its data-parallel group is never used -- cells sum gradients over prefix groups
        from gyre.training.megatron_model import initialize_megatron_cpu

        initialize_megatron_cpu(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, seed=args.seed)
    groups = PrefixGroups.build(args.num_cells, 1)
    initial = "training" if args.placement == "async" and rank < args.train_cells else "rollout"
    worker = CellWorker(args, rank, connect() if rank == 0 else store, groups, model_dir, None, initial_role=initial,
                        optimizer_state=str(ckpt / "optimizer.pt") if (ckpt and rank == 0) else None)
    server = None
    box: list[Any] = [None]
    if rank == 0:
        server = MooncakeSnapshotServer(flat_numel(worker.params) if worker.training.resident
                                        else sum(s.numel() for s in worker.training._saved))
        tensors = worker.params if worker.training.resident else worker.training._saved
        server.publish(tensors, version=start_step)
        worker.snapshot = Snapshot(server=server)
        box = [server.handle]
    dist.broadcast_object_list(box, src=0)
    if rank != 0:
        worker.snapshot = Snapshot(client=MooncakeSnapshotClient(box[0]))
    urls: list[Any] = [None] * world
    dist.all_gather_object(urls, worker.engine.url)
    if rank != 0:
        worker.run()
        dist.barrier()
        return None
    try:
        summary = _run_rank0(args, store, worker, server, urls, model_dir, ckpt, ctrl_state, start_step)
    finally:
        dist.barrier()
    return summary


def _run_rank0(args, store, worker, server, urls, model_dir, ckpt, ctrl_state, start_step) -> dict[str, Any]:
    from gyre.embedded_model import load_tokenizer
    from gyre.harness import harness_from_args
    from gyre.metrics import MetricsSink
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.engine_client import AsyncEngineClient
    from gyre.runtime.controller import Controller
    from gyre.runtime.plot import plot_run
    from gyre.tasks import load_tasks
    from gyre.training import control as ctl
    from gyre.training.streaming import MicroStepStream
    from gyre.trajectory.store import TrajectoryStore

    run_dir = Path(args.run_dir)
    tasks = load_tasks(args.tasks.split(",")).tasks
    harness = harness_from_args(args)
    harness.ensure_installed()
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    proxy = ProxyServer(ChatRenderer(load_tokenizer(model_dir)),
                        store=TrajectoryStore(run_dir / "records", fsync_every=0, max_open=1024),
                        config=ProxyConfig(model_name="gyre-policy", default_max_tokens=args.rollout_max_new_tokens,
                                           max_context_tokens=min(int(cfg.get("max_position_embeddings", args.seq_length)),
                                                                  args.seq_length),
                                           default_sampling={"temperature": args.rollout_temperature,
                                                             "top_p": args.rollout_top_p}))
    for c, url in enumerate(urls):
        proxy.add_engine(ClientEngine(AsyncEngineClient(url), f"engine-{c}"))
    proxy.start(args.proxy_host, args.proxy_port)
    wandb = None
    if args.wandb_project:
        wandb = {"project": args.wandb_project, "name": args.wandb_exp_name, "dir": args.wandb_save_dir or str(run_dir),
                 "mode": args.wandb_mode, "config": json.loads((run_dir / "args.json").read_text())}
    sink = MetricsSink(run_dir, tensorboard_dir=args.tensorboard_dir, wandb=wandb)
    sink.event("run_start", start_step=start_step, placement=args.placement, proxy=proxy.url,
               resumed_from=str(ckpt) if ckpt else None)
    cell0 = threading.Thread(target=worker.run, name="gyre-cell0", daemon=True)
    cell0.start()
    controller = Controller(args, proxy, ctl.ControlChannel(store, "rank0"), MicroStepStream(store, args.num_cells),
                            harness, tasks, server, sink, start_step=start_step,
                            attempt=int(ctrl_state.get("attempt", -1)) + 1 if ctrl_state else 0,
                            trained_before=ctrl_state.get("trained", ()), rng_state=ctrl_state.get("rng_state"),
                            history=ctrl_state.get("history"))
    progress = _progress(args, start_step)
    try:
        summary = controller.run(progress=progress.update if progress else None)
    finally:
        if progress:
            progress.close()
        cell0.join(timeout=120)
        proxy.stop()
        sink.close()
    try:
        plot_run(run_dir)
    except Exception as exc:  # a plot must not fail a finished run
        logger.warning("timeline plot failed: %s", exc)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """A few human-readable lines of ``summary.json`` for the console."""
    rewards = ", ".join(f"{float(v):.3f}" if v is not None else "-"
                        for _, v in sorted(s["reward_mean_by_step"].items(), key=lambda kv: int(kv[0])))
    sw = s["switch_latency_s"]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    ph = s["time_per_phase_s"]
    return "\n".join([
        f"gyre: {s['steps']} steps ({s['placement']}) in {s['wall_s']:.1f} s; executions {s['executions']} "
        f"(closed {s['executions_closed']}), trained {s['executions_trained']}",
        f"gyre: reward by step [{rewards}]",
        f"gyre: trajectories admitted {s['trajectories_admitted']}, tokens trained {int(s['tokens_trained'])}, "
        f"mean staleness {s['staleness_mean']:.2f}",
        f"gyre: role changes {s['role_changes']}, switch median R->T {med(sw['rollout_to_training']):.3f} s, "
        f"T->R {med(sw['training_to_rollout']):.3f} s",
        f"gyre: time per phase: rollout {ph['rollout']:.1f} s, training {ph['training']:.1f} s, overlap "
        f"{ph['overlap']:.1f} s, micro-steps {ph['micro_steps']:.1f} s, updates {ph['update']:.1f} s, "
        f"switching {ph['switching']:.1f} s"])


class _Progress:
    """A tqdm bar over optimizer steps with executions running and the waterlevel."""

    def __init__(self, total: int, initial: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc="gyre", unit="step", dynamic_ncols=True)
        self.last = 0.0

    def update(self, c) -> None:
        now = time.monotonic()
        if now - self.last < 0.5:
            return
        self.last = now
        s = c.sched
        self.bar.n = s.steps_done
        self.bar.set_postfix(running=s.counters.running, waterlevel=s.counters.waterlevel,
                             training=s.cells_in([type(s.cell_states[0]).TRAINING]), refresh=True)

    def close(self) -> None:
        self.bar.close()


def _progress(args, start_step: int) -> _Progress | None:
    if getattr(args, "no_progress", False):
        return None
    return _Progress(args.train_steps, start_step)
