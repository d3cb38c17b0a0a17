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
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gyre.arguments import ArgumentError
from gyre.process_guard import RunDirectoryLock, RunDirectoryLockedError
from gyre.runtime.checkpointing import ControllerState, find_checkpoint

logger = logging.getLogger(__name__)


def check_main_job_args(args: argparse.Namespace) -> None:
    """Checks of the main job beyond :func:`gyre.arguments.validate_args` (before anything starts).

    The model directories the run loads (``--model-dir``; the ``hf/`` of the checkpoint ``--load``
    resumes from) must hold a causal-LM config, an offline tokenizer and readable weights
    (:func:`gyre.embedded_model.model_dir_problem`).  Every task file is loaded: with
    ``--strict-tasks`` any problem is an error; otherwise, on rank 0 (``RANK`` unset or 0), each
    problem is one ``warning: file:line: ...`` line on stderr, then one line with the counts.

    Raises:
        ArgumentError: one line naming the flag.
    """
    if args.tasks is None:
        raise ArgumentError("argument --tasks: the main job needs a task file or directory")
    world = args.world_size  # WORLD_SIZE (default: the config's own), checked by validate_args
    per_cell = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.backend == "gpu":
        from gyre.runtime.gpu_cells import check_gpu_layout

        problems = check_gpu_layout(args, world, gpus_per_node(world))
        if problems:
            raise ArgumentError(problems[0])
    if per_cell > 1 and args.training_backend != "megatron":
        flag = "tensor" if args.tensor_model_parallel_size > 1 else "pipeline"
        raise ArgumentError(f"argument --{flag}-model-parallel-size: cells of several ranks train with "
                            f"--training-backend megatron")
    if per_cell > 1 and args.standalone_engines:
        raise ArgumentError("argument --standalone-engines: the standalone pool serves cells of one rank "
                            "(TP = PP = 1)")
    if args.standalone_engines and not args.standalone_concurrency:
        raise ArgumentError(f"argument --standalone-concurrency: --standalone-engines {args.standalone_engines} "
                            f"needs --standalone-concurrency > 0 (the executions the pool serves at once)")
    if args.attention_kernel == "fused" and args.backend == "cpu":
        raise ArgumentError("argument --attention-kernel: fused attention trains on GPU only (FlexAttention has no "
                            "CPU backward); --backend cpu uses dense")
    if args.rollout_engine == "sglang" and args.backend == "cpu":
        from gyre.rollout.sglang_driver.launch import cpu_server_launcher

        if cpu_server_launcher() is None:
            raise ArgumentError("argument --rollout-engine: SGLang cells on the CPU run from the SGLang environment "
                                "(bash tools/setup_sglang.sh; then its bin/python or bin/torchrun)")
        if per_cell > 1:
            raise ArgumentError("argument --tensor-model-parallel-size: SGLang cells on the CPU are cells of one rank")
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
        state = ControllerState.load(ckpt)
        if state.training_backend != args.training_backend:
            raise ArgumentError(f"argument --load: {ckpt} holds a --training-backend {state.training_backend} "
                                f"optimizer state; this run asks for {args.training_backend}")
        from gyre.runtime.checkpointing import optimizer_file

        shards = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        missing = [optimizer_file(ckpt, s).name for s in range(shards) if not optimizer_file(ckpt, s).exists()]
        if missing or optimizer_file(ckpt, shards).exists():
            raise ArgumentError(f"argument --load: {ckpt} holds the optimizer state of cells of another size than "
                                f"TP x PP = {shards} (missing {missing})" if missing else
                                f"argument --load: {ckpt} holds the optimizer state of cells of more than "
                                f"TP x PP = {shards} ranks")
        if state.iteration >= args.train_steps:
            raise ArgumentError(f"argument --train-steps: {ckpt} already holds {state.iteration} steps; pass "
                                f"--train-steps greater than {state.iteration} to train further")
    from gyre.embedded_model import model_dir_problem

    elsewhere = (args.backend == "gpu" and getattr(args, "check_config", False) and args.model_dir is not None
                 and not Path(args.model_dir).exists())
    if elsewhere and os.environ.get("RANK", "0") == "0":  # a cluster config checked on a laptop
        print(f"note: argument --model-dir: {args.model_dir} is not on this machine; the model and its split into "
              f"TP x PP are checked when the job starts", file=sys.stderr)
    for flag, model_dir in (("--model-dir", None if elsewhere else args.model_dir),
                            ("--load", ckpt / "hf" if args.load else None)):
        problem = model_dir_problem(model_dir) if model_dir is not None else None
        if problem:
            raise ArgumentError(f"argument {flag}: {model_dir}: {problem}")
    if per_cell > 1 and not elsewhere:
        _check_layout(args, ckpt if args.load else None)
    if args.backend == "gpu" and args.rollout_engine == "sglang" and not elsewhere:
        from transformers import AutoConfig

        from gyre.embedded_model import ensure_tiny_model
        from gyre.runtime.gpu_cells import check_model_for_sglang

        model_dir = ckpt / "hf" if args.load else args.model_dir or ensure_tiny_model(args.tokenizer_kind,
                                                                                      args.model_cache_dir)
        problems = check_model_for_sglang(args, AutoConfig.from_pretrained(str(model_dir), local_files_only=True))
        if problems:
            raise ArgumentError(problems[0])
    if args.rollout_shared_kv_store and args.rollout_engine != "sglang":
        raise ArgumentError("argument --rollout-shared-kv-store: only SGLang cells use the shared KV store "
                            "(--rollout-engine sglang)")
    if not RunDirectoryLock(args.run_dir).is_free():
        raise ArgumentError(f"argument --run-dir: {args.run_dir} is in use by another job")
    from gyre.tasks import load_tasks

    try:
        res = load_tasks(args.tasks.split(","))
    except Exception as exc:
        raise ArgumentError(f"argument --tasks: {exc}") from None
    if not res.tasks:
        raise ArgumentError(f"argument --tasks: no valid task in {args.tasks}"
                            + (f" ({res.problems[0]})" if res.problems else ""))
    if res.problems and args.strict_tasks:
        raise ArgumentError(f"argument --strict-tasks: {len(res.problems)} problem(s) in the task files "
                            f"({res.skipped} task(s) would be skipped), the first: {res.problems[0]}")
    if args.execution_fleet:
        _check_fleet(args, res.tasks)
    else:
        _check_execution_backend(args, res.tasks)
    if res.problems and os.environ.get("RANK", "0") == "0":
        for p in res.problems:
            print(f"warning: {p}", file=sys.stderr)
        print(f"warning: argument --tasks: {len(res.tasks)} tasks loaded, {res.skipped} skipped, "
              f"{len(res.problems)} problem(s) (--strict-tasks refuses such a run)", file=sys.stderr)


def _check_fleet(args: argparse.Namespace, tasks) -> None:
    """``--execution-fleet``: Ray imports, and every task can be sent to a node (its hidden paths lie
    in its directory); the nodes check their own backend."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ArgumentError("argument --execution-fleet: ray is not installed "
                            "(pip install -c constraints.txt -r requirements-fleet.txt)")
    from gyre.fleet.shipping import outside_task_dir

    for task in tasks:
        if outside := outside_task_dir(task):
            raise ArgumentError(f"argument --execution-fleet: task {task.id} has hidden paths outside its directory "
                                f"({outside[0]}); a fleet node receives only the task's directory")


def _check_execution_backend(args: argparse.Namespace, tasks) -> None:
    """The execution backend runs here and runs every task's environment (one line otherwise)."""
    from gyre.sandbox import BACKENDS, Environment, resolve_backend_name

    default = Environment.parse(args.task_environment)
    environments = {t.environment or default for t in tasks}
    name = args.execution_backend
    if name == "auto":
        if all(e.is_host for e in environments):
            return
        name = resolve_backend_name("auto")
    options = {"host": args.docker_host} if name == "docker" and args.docker_host else {}
    backend = BACKENDS[name](**options)
    reason = backend.unavailable_reason()
    if reason:
        raise ArgumentError(f"argument --execution-backend: {name} cannot run here: {reason}")
    for env in sorted(environments, key=Environment.describe):
        reason = backend.unavailable_reason(env)
        if reason:
            raise ArgumentError(f"argument --execution-backend: {name} cannot run the environment {env.describe()} "
                                f"of the tasks: {reason}")


def gpus_per_node(world: int) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE``, else (a check outside torchrun) ``GPUS_PER_NODE``,
    else every rank on one node.

    Raises:
        ArgumentError: the variable is not a positive integer.
    """
    for name in ("LOCAL_WORLD_SIZE", "GPUS_PER_NODE"):
        text = os.environ.get(name)
        if text:
            if not text.isdigit() or int(text) < 1:
                raise ArgumentError(f"argument --num-cells: {name}={text!r} is not a positive number of GPUs per node")
            return int(text)
    return world


def check_gpu_runtime(args: argparse.Namespace) -> None:
    """What a ``--backend gpu`` rank needs on the machine it runs on (after ``--check-config``):
    CUDA, a GPU for each local rank (unless ``--distributed-backend gloo``) and, for SGLang cells,
    SGLang itself.

    Raises:
        ArgumentError: one line naming the flag.
    """
    if not torch.cuda.is_available():
        raise ArgumentError("argument --backend: gpu needs CUDA, and torch.cuda.is_available() is False here "
                            "(--check-config checks a GPU config without one)")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.device_count() < local and args.distributed_backend == "nccl":
        raise ArgumentError(f"argument --distributed-backend: {local} ranks on this node but "
                            f"{torch.cuda.device_count()} GPU(s); NCCL needs a GPU per rank "
                            "(gloo lets ranks share one)")
    if args.rollout_engine == "sglang":
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise ArgumentError("argument --rollout-engine: sglang is not installed in this environment "
                                "(requirements-gpu.txt)")


def _check_layout(args: argparse.Namespace, ckpt: Path | None) -> None:
    """A cell of several ranks: the model must split into TP x PP shards, and a checkpoint resumed
    from must hold optimizer state of the same layout.

    Raises:
        ArgumentError: one line naming the flag.
    """
    from transformers import AutoConfig

    from gyre.embedded_model import ensure_tiny_model
    from gyre.training.checkpoint_conversion import check_parallel_sizes

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    model_dir = ckpt / "hf" if ckpt is not None else args.model_dir or ensure_tiny_model(args.tokenizer_kind,
                                                                                         args.model_cache_dir)
    try:
        check_parallel_sizes(AutoConfig.from_pretrained(str(model_dir), local_files_only=True), tp, pp)
    except ValueError as exc:
        flag = "pipeline" if "num_hidden_layers" in str(exc) else "tensor"
        raise ArgumentError(f"argument --{flag}-model-parallel-size: the model in {model_dir} does not split into "
                            f"TP {tp} x PP {pp}: {exc}") from None
    layout = ckpt / "parallel_layout.json" if ckpt is not None else None
    if layout is not None and layout.exists():
        saved = json.loads(layout.read_text())
        if (saved["tensor_model_parallel_size"], saved["pipeline_model_parallel_size"]) != (tp, pp):
            raise ArgumentError(f"argument --load: {ckpt} holds the optimizer state of cells of TP "
                                f"{saved['tensor_model_parallel_size']} x PP {saved['pipeline_model_parallel_size']}; "
                                f"this run asks for TP {tp} x PP {pp}")


def _init_distributed(args: argparse.Namespace, timeout) -> torch.device:
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


def _sglang_cell_engine(args, cell_group, device, host: str, model_dir: str, version: int):
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


def _sglang_cpu_cell_engine(args, cell: int, host: str, model_dir: str, version: int):
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


def _store(rank: int, world: int, host: str):
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


def pretrain(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the main job on this rank; rank 0 returns the summary, others ``None``."""
    from datetime import timedelta

    import torch.distributed as dist

    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.network import node_address
    from gyre.runtime.cell_group import CellGroup
    from gyre.runtime.cell_worker import CellWorker, Snapshot
    from gyre.runtime.checkpointing import optimizer_file
    from gyre.runtime.config import CellConfig
    from gyre.training.prefix_groups import PrefixGroups
    from gyre.training.backends import build_train_step
    from gyre.training.weight_snapshot import (CoreSnapshotStamps, MooncakeSnapshotClient, MooncakeSnapshotServer,
                                               flat_numel)

    from gyre.transfer_engine import set_transport

    set_transport(args.weight_transport.removeprefix("mooncake-"), args.weight_transport_device)
    device = _init_distributed(args, timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(args.run_dir)
    ckpt = find_checkpoint(args.load) if args.load else None
    resume = ControllerState.load(ckpt) if ckpt else None
    start_step = resume.iteration if resume else 0
    lock = None  # rank 0 holds the run directory's lock while pretrain runs
    if rank == 0:
        try:
            lock = RunDirectoryLock(run_dir).acquire()
        except RunDirectoryLockedError as exc:
            raise ArgumentError(f"argument --run-dir: {exc}") from None
        print(f"gyre: run directory {run_dir.resolve()}", file=sys.stderr, flush=True)
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
    host = node_address()  # where other ranks reach this rank's servers (loopback on one machine)
    store, connect = _store(rank, world, host)
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
        sglang = _sglang_cpu_cell_engine(args, cell, host, model_dir, start_step)
    else:
        sglang = _sglang_cell_engine(args, cell_group, device, host, model_dir, start_step)
    worker = CellWorker(CellConfig.from_args(args), cell, connect() if rank == 0 else store, groups, model_dir,
                        train_step, start_version=start_step, initial_role=initial, host=host, cell_group=cell_group,
                        device=str(device), engine=sglang if shard == 0 else None)
    if sglang is not None and shard != 0:  # another node of a multi-node cell: its part of the server
        sglang.start(wait_healthy=False)
    server, handle = None, None
    if cell == 0:  # one snapshot per core shard: shard s of a satellite reads shard s of the core
        tensors = worker.training.host_tensors()
        server = MooncakeSnapshotServer(flat_numel(tensors), host=host)
        server.publish(tensors, version=start_step)
        worker.snapshot = Snapshot(server=server)
        handle = server.handle
    handles: list[Any] = [None] * world
    dist.all_gather_object(handles, handle)
    if cell != 0:
        worker.snapshot = Snapshot(client=MooncakeSnapshotClient(handles[shard], host=host))
    urls: list[Any] = [None] * world
    dist.all_gather_object(urls, worker.engine.url if worker.engine is not None else None)
    urls = [urls[r] for r in cell_group.layout.leaders()]
    if rank != 0:
        worker.run()
        if sglang is not None and shard != 0:
            sglang.stop()
        dist.barrier()
        return None
    stamps = CoreSnapshotStamps(server, [MooncakeSnapshotClient(h, host=host, header_only=True)
                                         for h in handles[1:per_cell]])
    summary = _run_rank0(args, store, connect, worker, stamps, urls, model_dir, ckpt, resume)
    dist.barrier()  # only on success: the other ranks reach it after Shutdown (a failure ends the job instead)
    lock.release()
    return summary


def _run_rank0(args, store, connect, worker, server, urls, model_dir, ckpt, resume) -> dict[str, Any]:
    from gyre.harness import harness_from_args
    from gyre.metrics import MetricsSink
    from gyre.proxy.engines import ClientEngine
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.runtime.config import ControllerConfig
    from gyre.runtime.controller import Controller
    from gyre.runtime.plot import plot_run
    from gyre.runtime.standalone import StandalonePool
    from gyre.tasks import load_tasks
    from gyre.training import control as ctl
    from gyre.training.streaming import MicroStepStream

    run_dir = Path(args.run_dir)
    loaded = load_tasks(args.tasks.split(","))
    tasks = loaded.tasks
    if args.execution_fleet:
        from gyre.fleet.launcher import launcher_from_args

        harness = launcher_from_args(args)  # the same launcher interface; executions run on the fleet's nodes
    else:
        harness = harness_from_args(args)
    harness.ensure_installed()
    harness.sweep(run_dir)  # sandboxes an earlier, crashed attempt of this run directory left
    proxy = _rank0_proxy(args, model_dir, run_dir, harness)
    for c, url in enumerate(urls):  # an SGLang engine's requests each get a seed (ClientEngine)
        proxy.add_engine(ClientEngine(AsyncEngineClient(url), f"engine-{c}"))
    start_step = resume.iteration if resume else 0
    standalone = _standalone_pool(args, connect, worker, server, model_dir, start_step, proxy)
    proxy.start(args.proxy_host, args.proxy_port)
    wandb = None
    if args.wandb_project:
        wandb = {"project": args.wandb_project, "name": args.wandb_exp_name, "dir": args.wandb_save_dir or str(run_dir),
                 "mode": args.wandb_mode, "config": json.loads((run_dir / "args.json").read_text())}
    sink = MetricsSink(run_dir, tensorboard_dir=args.tensorboard_dir, wandb=wandb)
    sink.event("run_start", start_step=start_step, placement=args.placement, proxy=proxy.url,
               proxy_workers=proxy.urls if args.proxy_workers > 1 else [proxy.url],
               engines={f"engine-{c}": url for c, url in enumerate(urls)}, resumed_from=str(ckpt) if ckpt else None)
    cell0 = threading.Thread(target=worker.run, name="gyre-cell0", daemon=True)
    cell0.start()
    controller = Controller(ControllerConfig.from_args(args), proxy, ctl.ControlChannel(store, "rank0"),
                            MicroStepStream(store, args.num_cells), harness, tasks, server, sink, resume=resume,
                            standalone=standalone)
    controller.acct.tasks_skipped = loaded.skipped
    progress = _progress(args, start_step)
    try:
        summary = controller.run(progress=progress.update if progress else None)
        if isinstance(standalone, StandalonePool):
            sink.event("standalone_engines", engines=standalone.server_info(), t=controller.now())
        cell0.join(timeout=120)  # it stopped on Shutdown (after a failure nothing waits for it)
    finally:
        if progress:
            progress.close(controller.sched.steps_done)
        proxy.stop()
        harness.close()
        if isinstance(standalone, StandalonePool):
            standalone.stop()
        sink.close()
    try:
        plot_run(run_dir)
    except Exception as exc:  # a plot must not fail a finished run
        logger.warning("run plots failed: %s", exc)
    return summary


def _rank0_proxy(args, model_dir, run_dir: Path, harness):
    """Rank 0's proxy: a :class:`ProxyServer` in this process, or ``--proxy-workers`` K > 1
    processes (:class:`gyre.proxy.workers.ProxyWorkers`) with the same configuration."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.request_body import limits_from_args
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.proxy.workers import ProxyWorkers, WorkerSpec
    from gyre.trajectory.store import TrajectoryStore

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    config = ProxyConfig(model_name="gyre-policy", default_max_tokens=args.rollout_max_new_tokens,
                         max_tokens_cap=args.rollout_max_new_tokens,
                         max_context_tokens=args.rollout_max_context_tokens
                         or min(int(cfg.get("max_position_embeddings", args.seq_length)), args.seq_length),
                         default_sampling={"temperature": args.rollout_temperature, "top_p": args.rollout_top_p},
                         kv_migration=args.rollout_kv_migration, kv_transport=args.rollout_kv_transport,
                         ).with_limits(limits_from_args(args))
    if args.proxy_workers > 1:
        spec = WorkerSpec(str(model_dir), str(run_dir / "records"), config, role_rules=harness.roles)
        return ProxyWorkers(spec, args.proxy_workers, spec_path=run_dir / "proxy_workers" / "spec.pickle",
                            log_dir=run_dir / "proxy_workers")
    return ProxyServer(ChatRenderer(load_tokenizer(model_dir)),
                       store=TrajectoryStore(run_dir / "records", fsync_every=0, max_open=1024), config=config)


def _standalone_pool(args, connect, worker, server, model_dir, version: int, proxy):
    """The standalone pool (``--standalone-engines K``): ``K`` engines on this rank serving
    ``version``, registered with ``proxy``, reading the core's snapshot over Mooncake and replying
    on their own store client.  Without the flag: a :class:`StandaloneRoutes` of cells only."""
    from gyre.proxy.engines import ClientEngine
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.runtime.cell_worker import Snapshot
    from gyre.runtime.standalone import StandalonePool, StandaloneRoutes
    from gyre.training import control as ctl
    from gyre.training.weight_snapshot import MooncakeSnapshotClient

    if not args.standalone_engines:
        return StandaloneRoutes()
    pool = StandalonePool.start(args.standalone_engines, model_dir, concurrency=args.standalone_concurrency,
                                seed=args.seed, num_cells=args.num_cells,
                                snapshot=Snapshot(client=MooncakeSnapshotClient(server.handle, host=server.host)),
                                train_step=worker.train_step, shapes=worker.shapes,
                                channel=ctl.ControlChannel(connect(), "standalone"),
                                version=version)
    for eid, url in zip(pool.engine_ids, pool.urls):
        proxy.add_engine(ClientEngine(AsyncEngineClient(url), eid))
    return pool


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

    def close(self, steps_done: int | None = None) -> None:
        if steps_done is not None:  # the last update may have been skipped by the 0.5 s throttle
            self.bar.n = steps_done
            self.bar.refresh()
        self.bar.close()


def _progress(args, start_step: int) -> _Progress | None:
    if args.no_progress:
        return None
    return _Progress(args.train_steps, start_step)
