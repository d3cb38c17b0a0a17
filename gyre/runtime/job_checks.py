"""Checks of the main job before anything starts (``pretrain_gyre.py``, also ``--check-config``).

:func:`check_main_job_args` runs after :func:`gyre.arguments.validate_args`: the main job's checks
of flags against flags (:func:`gyre.arguments.check_main_job_flags`), then what the flags name on
this machine -- the GPU layout, the installed packages, the checkpoint ``--load`` resumes from,
the model directories, the run directory's lock, the task files and the execution backend.
:func:`check_gpu_runtime` is what a ``--backend gpu`` rank checks once it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gyre.arguments import ArgumentError, check_main_job_flags
from gyre.process_guard import RunDirectoryLock
from gyre.runtime.checkpointing import ControllerState, find_checkpoint


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
    check_main_job_flags(args)
    if args.backend == "gpu":
        from gyre.runtime.gpu_cells import check_gpu_layout

        problems = check_gpu_layout(args, args.world_size, gpus_per_node(args.world_size))
        if problems:
            raise ArgumentError(problems[0])
    _check_installed(args)
    ckpt = _check_resume(args) if args.load is not None else None
    elsewhere = _check_model_dirs(args, ckpt)
    if not elsewhere:
        if args.tensor_model_parallel_size * args.pipeline_model_parallel_size > 1:
            _check_layout(args, ckpt)
        if args.backend == "gpu" and args.rollout_engine == "sglang":
            _check_sglang_model(args, ckpt)
    if not RunDirectoryLock(args.run_dir).is_free():
        raise ArgumentError(f"argument --run-dir: {args.run_dir} is in use by another job")
    _check_tasks(args)


def _check_installed(args: argparse.Namespace) -> None:
    """SGLang cells on the CPU run from the SGLang environment; ``--wandb-project`` needs wandb."""
    if args.rollout_engine == "sglang" and args.backend == "cpu":
        from gyre.rollout.sglang_driver.launch import cpu_server_launcher

        if cpu_server_launcher() is None:
            raise ArgumentError("argument --rollout-engine: SGLang cells on the CPU run from the SGLang environment "
                                "(bash tools/setup_sglang.sh; then its bin/python or bin/torchrun)")
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ArgumentError("argument --wandb-project: the wandb package is not installed "
                                "(bash tools/setup.sh installs it)") from None


def _check_resume(args: argparse.Namespace) -> Path:
    """``--load``: the newest checkpoint exists, holds optimizer state of this training backend and
    of cells of TP x PP ranks, and fewer than ``--train-steps`` steps; returns it."""
    from gyre.runtime.checkpointing import optimizer_file

    ckpt = find_checkpoint(args.load)
    if ckpt is None:
        raise ArgumentError(f"argument --load: no checkpoint under {args.load}")
    state = ControllerState.load(ckpt)
    if state.training_backend != args.training_backend:
        raise ArgumentError(f"argument --load: {ckpt} holds a --training-backend {state.training_backend} "
                            f"optimizer state; this run asks for {args.training_backend}")
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
    return ckpt


def _check_model_dirs(args: argparse.Namespace, ckpt: Path | None) -> bool:
    """``--model-dir`` and the checkpoint's ``hf/`` hold a loadable model.  Returns whether the
    model directory is elsewhere: a ``--backend gpu --check-config`` of a ``--model-dir`` that is
    not on this machine (a cluster config checked on a laptop; a note on rank 0, nothing more)."""
    from gyre.embedded_model import model_dir_problem

    elsewhere = (args.backend == "gpu" and getattr(args, "check_config", False) and args.model_dir is not None
                 and not Path(args.model_dir).exists())
    if elsewhere and os.environ.get("RANK", "0") == "0":
        print(f"note: argument --model-dir: {args.model_dir} is not on this machine; the model and its split into "
              f"TP x PP are checked when the job starts", file=sys.stderr)
    for flag, model_dir in (("--model-dir", None if elsewhere else args.model_dir),
                            ("--load", ckpt / "hf" if ckpt is not None else None)):
        problem = model_dir_problem(model_dir) if model_dir is not None else None
        if problem:
            raise ArgumentError(f"argument {flag}: {model_dir}: {problem}")
    return elsewhere


def _model_to_check(args: argparse.Namespace, ckpt: Path | None):
    from gyre.embedded_model import ensure_tiny_model

    return ckpt / "hf" if ckpt is not None else args.model_dir or ensure_tiny_model(args.tokenizer_kind,
                                                                                    args.model_cache_dir)


def _check_sglang_model(args: argparse.Namespace, ckpt: Path | None) -> None:
    """``--backend gpu`` SGLang cells: the model fits SGLang's split over the cell's GPUs."""
    from transformers import AutoConfig

    from gyre.runtime.gpu_cells import check_model_for_sglang

    model_dir = _model_to_check(args, ckpt)
    problems = check_model_for_sglang(args, AutoConfig.from_pretrained(str(model_dir), local_files_only=True))
    if problems:
        raise ArgumentError(problems[0])


def _check_tasks(args: argparse.Namespace) -> None:
    """Load every task file (see :func:`check_main_job_args`), then check the fleet or the backend."""
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
    import torch  # here, not at the top: --check-config and the flag checks run without Torch

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

    from gyre.training.checkpoint_conversion import check_parallel_sizes

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    model_dir = _model_to_check(args, ckpt)
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
