"""Checks of parsed flags against each other, and the values derived from them.

:func:`validate_args` runs after every parse (``pretrain_gyre.py``, ``serve_rollout``, tests);
besides comparing flags it loads what a flag names (task paths exist, a ``--harness`` class or
``--custom-rm-path`` callable imports, the ``--judge-api-key-env`` variable is set, ``WORLD_SIZE``
matches the cell layout).  :func:`check_main_job_flags` holds the main job's further checks of
flags against flags; the main job's checks of the machine, the model and the task files are
:func:`gyre.runtime.job_checks.check_main_job_args`, which runs it first.  Every failure is an
:class:`ArgumentError` of one line, ``argument --flag: reason``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from gyre.arguments.values import HARNESS_NAMES, ArgumentError


def _need(cond: bool, flag: str, why: str) -> None:
    if not cond:
        raise ArgumentError(f"argument --{flag}: {why}")


def _load_error(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _check_sizes(args: argparse.Namespace) -> None:
    """Group, burst, cell and objective sizes, sampling and the execution timeout."""
    _need(args.n_samples_per_prompt >= 2, "n-samples-per-prompt", "N must be >= 2 (group-relative advantages)")
    _need(args.global_batch_groups >= 1, "global-batch-groups", "B must be >= 1")
    _need(args.steps_per_burst >= 1, "steps-per-burst", "mu must be >= 1")
    _need(args.extra_dispatch >= 0 and math.isfinite(args.extra_dispatch), "extra-dispatch", "phi must be >= 0")
    _need(args.oversample_executions >= 0, "oversample-executions", "must be >= 0")
    _need(args.max_trajectories_per_execution >= 1, "max-trajectories-per-execution", "J_max must be >= 1")
    _need(args.num_cells >= 1, "num-cells", "K must be >= 1")
    _need(args.rollout_concurrency_per_cell >= 1, "rollout-concurrency-per-cell", "must be >= 1")
    _need(args.standalone_engines >= 0, "standalone-engines", "must be >= 0")
    _need(args.standalone_concurrency >= 0, "standalone-concurrency", "must be >= 0")
    _need(args.standalone_engines > 0 or args.standalone_concurrency == 0, "standalone-concurrency",
          "needs --standalone-engines > 0")
    _need(args.train_steps >= 1, "train-steps", "must be >= 1")
    _need(args.max_switch_failures >= 1, "max-switch-failures", "must be >= 1")
    _need(args.save_interval >= 0, "save-interval", "must be >= 0")
    _need(args.keep_checkpoints >= 0, "keep-checkpoints", "must be >= 0")
    _need(args.token_is_cap > 0, "token-is-cap", "C must be > 0")
    _need(0 <= args.seq_clip_low < 1, "seq-clip-low", "eps_low must be in [0, 1)")
    _need(args.seq_clip_high >= 0, "seq-clip-high", "eps_high must be >= 0")
    _need(0 <= args.token_clip_low < 1, "token-clip-low", "must be in [0, 1)")
    _need(args.token_clip_high >= 0, "token-clip-high", "must be >= 0")
    _need(args.rollout_temperature > 0, "rollout-temperature", "must be > 0")
    _need(0 < args.rollout_top_p <= 1, "rollout-top-p", "must be in (0, 1]")
    _need(args.execution_timeout_s > 0, "execution-timeout-s", "must be > 0")


def _check_harness(args: argparse.Namespace) -> None:
    """The task paths exist, the reference agent's settings, and the harness is known or imports."""
    missing = [t for t in (args.tasks or "").split(",") if t and not Path(t).exists()]
    _need(not missing, "tasks", f"task file or directory not found: {','.join(missing)}")
    _need(args.reference_compact_threshold_tokens is None or args.reference_compact_threshold_tokens >= 0,
          "reference-compact-threshold-tokens", "must be >= 0")
    if args.reference_tools is not None:
        from gyre.harness.reference_agent.tools import ALL_TOOLS

        bad = [t for t in args.reference_tools.split(",") if t and t not in ALL_TOOLS]
        _need(not bad, "reference-tools", f"unknown tools {bad} (known: {', '.join(ALL_TOOLS)})")
    if args.harness not in HARNESS_NAMES:
        _need(":" in args.harness or "." in args.harness, "harness",
              f"unknown harness {args.harness!r} (choose from {', '.join(HARNESS_NAMES)} or a dotted path "
              f"pkg.module:Class)")
        from gyre.harness.registry import load_harness_class

        try:
            load_harness_class(args.harness)
        except Exception as exc:  # a user module may raise anything on import
            _need(False, "harness", f"cannot load {args.harness!r}: {_load_error(exc)}")


def _check_evaluation(args: argparse.Namespace) -> None:
    """Assessment limits, the custom reward rule imports, the judge's URL, model and key."""
    _need(args.eval_timeout_s > 0, "eval-timeout-s", "must be > 0")
    _need(args.eval_max_retries >= 0, "eval-max-retries", "must be >= 0")
    _need(args.eval_retry_backoff_s >= 0, "eval-retry-backoff-s", "must be >= 0")
    _need(args.eval_budget_s is None or args.eval_budget_s > 0, "eval-budget-s", "must be > 0")
    if args.custom_rm_path is not None:
        from gyre.evaluation import load_callable

        try:
            load_callable(args.custom_rm_path)
        except Exception as exc:  # a user module may raise anything on import
            _need(False, "custom-rm-path", f"cannot load {args.custom_rm_path!r}: {_load_error(exc)}")
    _need(args.judge_base_url is None or args.judge_base_url.startswith(("http://", "https://")), "judge-base-url",
          f"must be an http(s) URL, got {args.judge_base_url!r}")
    _need(args.judge_model is None or bool(args.judge_model.strip()), "judge-model", "must not be empty")
    if args.judge_api_key_env is not None:
        _need(args.judge_base_url is not None, "judge-api-key-env",
              "needs --judge-base-url (the run's proxy takes the execution's key)")
        _need(bool(os.environ.get(args.judge_api_key_env)), "judge-api-key-env",
              f"${args.judge_api_key_env} is not set")


def _check_proxy_and_placement(args: argparse.Namespace) -> None:
    """The proxy's ports, the trainable roles, and what colocate, async and the handoff need."""
    _need(0 <= args.proxy_port <= 65535, "proxy-port", "must be in [0, 65535]")
    _need(args.proxy_workers >= 1, "proxy-workers", "must be >= 1")
    _need(args.proxy_port == 0 or args.proxy_port + args.proxy_workers - 1 <= 65535, "proxy-workers",
          "the workers' ports (proxy-port + i) must be <= 65535")
    _need("evaluator" not in args.role_priority, "role-priority", "evaluator tokens are never trainable")
    if args.placement == "colocate" and not args.standalone_handoff:
        _need(args.extra_dispatch == 0, "extra-dispatch", "colocate requires phi = 0 (unless --standalone-handoff)")
    if args.standalone_handoff:
        _need(args.placement == "colocate", "standalone-handoff", "is for --placement colocate")
        _need(args.standalone_concurrency > 0, "standalone-handoff",
              "needs a standalone pool (--standalone-concurrency > 0)")
    if args.placement == "async":
        _need(args.num_cells >= 2, "num-cells", "async needs >= 2 cells (training and rollout)")
        _need(1 <= args.train_cells < args.num_cells, "train-cells", f"must be in [1, {args.num_cells - 1}] for async")


def _check_training_layout(args: argparse.Namespace) -> None:
    """With the Megatron-LM-named flags: the optimizer's settings, and ``WORLD_SIZE`` (default: the
    flags' own) = cells x TP x PP; sets ``world_size`` and ``ranks_per_cell``."""
    _need(args.lr >= 0, "lr", "must be >= 0")
    _need(0 <= args.adam_beta1 < 1, "adam-beta1", "must be in [0, 1)")
    _need(0 <= args.adam_beta2 < 1, "adam-beta2", "must be in [0, 1)")
    _need(args.adam_eps > 0, "adam-eps", "must be > 0")
    _need(args.lr_warmup_iters >= 0, "lr-warmup-iters", "must be >= 0")
    _need(args.clip_grad >= 0, "clip-grad", "must be >= 0")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cell = tp * pp
    text = os.environ.get("WORLD_SIZE", str(args.num_cells * cell))
    _need(text.isdigit() and int(text) > 0, "num-cells", f"WORLD_SIZE={text!r} is not a positive integer")
    world = int(text)
    _need(world == args.num_cells * cell, "num-cells",
          f"WORLD_SIZE={world} must be --num-cells x TP x PP = {args.num_cells} x {tp} x {pp} = "
          f"{args.num_cells * cell} (no data parallelism inside a cell)")
    args.world_size = world
    args.ranks_per_cell = world // args.num_cells


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check invariants and derive values; raise :class:`ArgumentError` on the first violation.

    Derived: ``queue_depth_groups = (phi + mu) * B``, ``expected_staleness = phi + (mu - 1) / 2``
    (paper App. A), ``executions_per_step = N * B``, ``run_dir`` (``runs/<timestamp>`` when unset);
    with the Megatron-LM-named flags also ``world_size`` and ``ranks_per_cell``.
    """
    _check_sizes(args)
    _check_harness(args)
    _check_evaluation(args)
    _check_proxy_and_placement(args)
    if hasattr(args, "tensor_model_parallel_size"):
        _check_training_layout(args)
    args.queue_depth_groups = (args.extra_dispatch + args.steps_per_burst) * args.global_batch_groups
    args.expected_staleness = args.extra_dispatch + (args.steps_per_burst - 1) / 2
    args.executions_per_step = args.n_samples_per_prompt * args.global_batch_groups
    if args.run_dir is None:
        args.run_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    return args


def check_main_job_flags(args: argparse.Namespace) -> None:
    """The main job's checks of flags against flags, beyond :func:`validate_args`: it needs
    ``--tasks``; cells of several ranks train with Megatron and have no standalone pool; a
    standalone pool needs a concurrency; fused attention needs a GPU; SGLang cells on the CPU are
    of one rank; the shared KV store is for SGLang cells.

    Raises:
        ArgumentError: one line naming the flag.
    """
    if args.tasks is None:
        raise ArgumentError("argument --tasks: the main job needs a task file or directory")
    per_cell = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
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
    if args.rollout_engine == "sglang" and args.backend == "cpu" and per_cell > 1:
        raise ArgumentError("argument --tensor-model-parallel-size: SGLang cells on the CPU are cells of one rank")
    if args.rollout_shared_kv_store and args.rollout_engine != "sglang":
        raise ArgumentError("argument --rollout-shared-kv-store: only SGLang cells use the shared KV store "
                            "(--rollout-engine sglang)")
