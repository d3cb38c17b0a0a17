"""Gyre command-line arguments, in the shape of Megatron-LM's ``megatron/training/arguments.py``.

One ``_add_<area>_args(parser)`` per concern, each an argument group with kebab-case flags named
after the quantities they set (``N``, ``B``, ``phi``, ``mu``, ``K``, ...); :func:`add_gyre_args`
adds every Gyre group and can be handed to Megatron's
``parse_args(extra_args_provider=add_gyre_args)``.  :func:`add_megatron_core_args` adds the few
Megatron-LM flags Gyre uses (parallel sizes, optimizer, seed) for runs that only install
megatron-core, which ships no argument parser.

``--config FILE.yaml`` supplies defaults: keys are flag names with ``-`` or ``_`` (``steps-per-burst``
or ``steps_per_burst``), values are type-checked like the flag; command-line flags override the file.
Every error -- unknown flag or key, bad value, broken invariant -- exits with status 2 and one line
naming the flag or key and the reason.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from gyre.sandbox.registry import BACKENDS
from gyre.sandbox.spec import Environment, parse_size

ROLES = ("main", "subagent", "compaction", "auxiliary", "evaluator")
PLACEMENTS = ("elastic", "async", "colocate")
HARNESS_NAMES = ("reference", "claude-code", "codex", "mini-swe-agent")


class ArgumentError(Exception):
    """A bad flag, config key or value; :func:`parse_args` turns it into exit status 2."""


class GyreHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` formatter: each flag's help ends with ``(default: VALUE)``, except where the
    default is ``None`` (unset; the help text says what unset means) or the text already names
    ``%(default)s``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


class GyreArgumentParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line on stderr and exit status 2; ``--help`` shows
    defaults (:class:`GyreHelpFormatter`) unless another ``formatter_class`` is given."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", GyreHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _host_port(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def _ratio_above_one(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not v > 1:
        raise argparse.ArgumentTypeError(f"must be > 1, got {text}")
    return v


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _size_or_none(text: str) -> int | None:
    if text.strip().lower() in ("none", "0", "off"):
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _environment(text: str) -> str:
    try:
        return Environment.parse(text).describe()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _role_list(text: str | Sequence[str]) -> list[str]:
    items = [r.strip() for r in text.split(",")] if isinstance(text, str) else [str(r) for r in text]
    for r in items:
        if r not in ROLES:
            raise argparse.ArgumentTypeError(f"unknown role {r!r} (expected one of {', '.join(ROLES)})")
    if len(set(items)) != len(items):
        raise argparse.ArgumentTypeError("roles must not repeat")
    return items


# --------------------------------------------------------------------------- groups


def _add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="model")
    group.add_argument("--model-dir", type=str, default=None,
                       help="HF-layout model directory; default: the embedded tiny Qwen3, built on first use.")
    group.add_argument("--tokenizer-kind", choices=("qwen", "local"), default="local",
                       help="Embedded tokenizer: the full offline Qwen BPE or its 4k-rank prefix (fast).")
    group.add_argument("--model-cache-dir", type=str, default=None,
                       help="Where embedded models are cached "
                            "(default $GYRE_CACHE_DIR, <venv>/share/gyre or ~/.cache/gyre).")
    group.add_argument("--backend", choices=("cpu", "gpu"), default="cpu",
                       help="cpu: gloo, embedded engine, megatron_patches applied; gpu: each rank on its GPU "
                            "(LOCAL_RANK), NCCL for tensors, SGLang or the embedded engine on CUDA.")
    group.add_argument("--distributed-backend", choices=("nccl", "gloo"), default="nccl",
                       help="--backend gpu: the collective backend for CUDA tensors (objects always go over gloo); "
                            "gloo lets several ranks share one GPU (checks on a single GPU).")
    group.add_argument("--training-backend", choices=("megatron", "hf"), default="megatron",
                       help="Model implementation the training cells run (hf is the reference).")
    group.add_argument("--seq-length", type=_positive_int, default=4096,
                       help="Longest token row trained or served (tokens).")
    return parser


def _add_rollout_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="rollout")
    group.add_argument("--n-samples-per-prompt", type=int, default=4,
                       help="N: executions per rollout group.")
    group.add_argument("--global-batch-groups", type=int, default=2,
                       help="B: rollout groups per optimizer step.")
    group.add_argument("--extra-dispatch", type=float, default=0.0,
                       help="phi: extra dispatch in units of B groups (queue depth (phi + mu) * B).")
    group.add_argument("--steps-per-burst", type=int, default=1,
                       help="mu: optimizer steps between two weight publications.")
    group.add_argument("--oversample-executions", type=int, default=0,
                       help="Extra executions launched per group; the first N valid ones are used.")
    group.add_argument("--rollout-engine", choices=("embedded", "sglang"), default="embedded",
                       help="Engine each rollout cell serves from.")
    group.add_argument("--rollout-temperature", type=float, default=1.0,
                       help="Sampling temperature of rollouts; training log-probs use the same "
                            "softmax(logits / T) (the engine returns tempered log-probs).")
    group.add_argument("--rollout-top-p", type=float, default=1.0, help="Nucleus sampling threshold.")
    group.add_argument("--rollout-max-new-tokens", type=_positive_int, default=512,
                       help="Output tokens per model call: the default when a request sets no max_tokens, "
                            "and the cap on every call (a request asking for more gets this many; its record "
                            "says so in max_tokens_capped).")
    group.add_argument("--rollout-kv-migration", action="store_true",
                       help="A request moved to another engine (a role switch) first copies its KV there, so the "
                            "destination does not recompute its context, and an execution's context follows any "
                            "route change (embedded engines; a failed copy recomputes).")
    group.add_argument("--rollout-kv-transport", choices=("mooncake", "http"), default="mooncake",
                       help="How --rollout-kv-migration moves KV: engine to engine over Mooncake (HTTP through "
                            "the proxy if that fails) or always through the proxy over HTTP.")
    group.add_argument("--rollout-shared-kv-store", type=_host_port, default=None, metavar="HOST:PORT",
                       help="SGLang cells: a Mooncake master; every SGLang server runs its hierarchical cache "
                            "with this shared Mooncake store as the storage tier, so a request moved to another "
                            "cell finds its prefix there (--enable-hierarchical-cache --hicache-storage-backend "
                            "mooncake; flags you set with --sglang-* win).")
    group.add_argument("--rollout-shared-kv-protocol", choices=("rdma", "tcp"), default="rdma",
                       help="Transport of the shared KV store.")
    group.add_argument("--rollout-shared-kv-device", default="",
                       help="RDMA NICs for the shared KV store (e.g. mlx5_0,mlx5_1; empty: Mooncake picks).")
    group.add_argument("--rollout-shared-kv-segment-gb", type=_positive_int, default=4,
                       help="Host memory (GiB) each SGLang server gives the shared KV store.")
    group.add_argument("--rollout-shared-kv-host-ratio", type=_ratio_above_one, default=1.2,
                       help="Host KV pool of each SGLang server as a multiple of its GPU KV pool (SGLang's "
                            "hicache ratio; it must exceed 1, and SGLang's own default of 2 in pinned host memory "
                            "rarely fits a node running one server per GPU).")
    group.add_argument("--rollout-max-context-tokens", type=_positive_int, default=None,
                       help="Prompt + output limit per model call (longer prompts get 400 'prompt is too long'; "
                            "output is cut to the room left). Default: the model's max_position_embeddings, "
                            "at most --seq-length in the main job.")
    return parser


def _add_sglang_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--sglang-<flag>``: SGLang server flags passed through (slime style) when
    ``--rollout-engine sglang``; see ``gyre/rollout/sglang_driver/engine.py``.  Every one defaults to
    unset (SGLang's own default); all of SGLang's ``ServerArgs`` when SGLang is importable."""
    from gyre.rollout.sglang_driver.flags import add_sglang_arguments

    add_sglang_arguments(parser.add_argument_group(title="sglang (passed to sglang.launch_server)"))
    return parser


def _add_placement_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="placement")
    group.add_argument("--placement", choices=PLACEMENTS, default="elastic",
                       help="elastic (waterlevel), async (fixed split) or colocate (whole pool switches).")
    group.add_argument("--num-cells", type=int, default=1,
                       help="K: cells; each serves rollouts or hosts one training replica.")
    group.add_argument("--train-cells", type=int, default=1,
                       help="async only: cells fixed in training (the first ones).")
    group.add_argument("--rollout-concurrency-per-cell", type=int, default=8,
                       help="c: concurrent executions one rollout cell serves.")
    group.add_argument("--standalone-engines", type=int, default=0,
                       help="Engines that only ever serve rollouts (the main job starts them on rank 0; "
                            "needs --standalone-concurrency > 0).")
    group.add_argument("--standalone-concurrency", type=int, default=0,
                       help="c_s: concurrent executions the standalone pool serves in total.")
    group.add_argument("--streaming-training", action=argparse.BooleanOptionalAction, default=True,
                       help="Ready groups enter the current step one by one, so training starts before the "
                            "step's batch is complete (off: a step's groups enter together once all are ready).")
    group.add_argument("--standalone-handoff", action="store_true",
                       help="colocate with a standalone pool: the pool switches together once the unfinished "
                            "executions fit on the standalone pool, which keeps serving them (allows "
                            "--extra-dispatch > 0; without streaming, also once the burst's data is ready).")
    group.add_argument("--max-switch-failures", type=int, default=3,
                       help="A cell whose switch into training fails this many times in a row stays in rollout, "
                            "with every cell above it (the core: the run ends).")
    group.add_argument("--weight-transport", choices=("mooncake-tcp", "mooncake-rdma"), default="mooncake-tcp",
                       help="How weight snapshots (and engine-to-engine KV copies) move between nodes: Mooncake "
                            "over TCP, or over RDMA (the CUDA build of Mooncake on InfiniBand/RoCE).")
    group.add_argument("--weight-transport-device", default="",
                       help="RDMA NICs for --weight-transport mooncake-rdma "
                            "(e.g. mlx5_0,mlx5_1; empty: Mooncake picks).")
    group.add_argument("--update-weight-buffer-size", type=_positive_int, default=512 << 20,
                       help="Bytes per bucket when a cell loads the policy into its engine (the model goes over "
                            "in buckets of about this size, gathered from the cell's shards unit by unit).")
    group.add_argument("--cell-lease-s", type=float, default=60.0,
                       help="A training cell whose stream heartbeat is older than this (seconds) is dead; "
                            "its micro-steps are queued again.")
    return parser


def _add_admission_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="admission")
    group.add_argument("--max-trajectories-per-execution", type=int, default=5,
                       help="J_max: admitted trajectories per execution.")
    group.add_argument("--role-priority", type=_role_list, default=["main", "subagent", "compaction", "auxiliary"],
                       help="Comma-separated role classes, highest first (evaluator is never trainable).")
    group.add_argument("--train-undelivered", action="store_true",
                       help="Also train on outputs the harness never received.")
    group.add_argument("--advantage-std-scaling", action=argparse.BooleanOptionalAction, default=True,
                       help="A_i = (R_i - mean) / (std + eps) (on) or R_i - mean (off).")
    group.add_argument("--filter-zero-std-groups", action="store_true",
                       help="Drop groups whose rewards are all equal.")
    group.add_argument("--advantage-leave-one-out", action="store_true",
                       help="Baseline of A_i is the mean of the other rewards of the group (RLOO).")
    return parser


def _add_objective_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="objective")
    group.add_argument("--loss-type", choices=("gspo", "ppo", "grpo"), default="gspo",
                       help="gspo: execution-level ratio and clipping; ppo/grpo: token-level clip.")
    group.add_argument("--token-is-cap", type=float, default=5.0, help="C: cap on token importance weights.")
    group.add_argument("--seq-clip-low", type=float, default=0.005, help="eps_low of execution-level clipping.")
    group.add_argument("--seq-clip-high", type=float, default=0.005, help="eps_high of execution-level clipping.")
    group.add_argument("--micro-step-tokens", type=_positive_int, default=4096,
                       help="Token budget of one packed micro-step.")
    group.add_argument("--token-clip-low", type=float, default=0.2,
                       help="ppo/grpo only: lower token-level clip range (ratio >= 1 - this).")
    group.add_argument("--token-clip-high", type=float, default=0.2,
                       help="ppo/grpo only: upper token-level clip range (ratio <= 1 + this).")
    group.add_argument("--packing", choices=("pack", "pad"), default="pad",
                       help="Micro-step layout: pad a batch of rows (default; faster on CPU, bench/train.py) "
                            "or pack rows into one sequence (block-diagonal mask).")
    group.add_argument("--tree-packed-forward", action="store_true",
                       help="Compute a prefix shared by rows of one execution once (trie attention mask); "
                            "off by default: slower than per-row on CPU for real trace replays (bench/train.py).")
    group.add_argument("--logprob-chunk-size", type=_positive_int, default=1024,
                       help="Targets per chunk when computing target log-probs (memory: chunk x vocab floats).")
    return parser


def _add_evaluation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="evaluation")
    group.add_argument("--eval-timeout-s", type=float, default=300.0, help="Limit of one assessment (s).")
    group.add_argument("--eval-max-retries", type=int, default=3, help="Retries of an unresolved assessment.")
    group.add_argument("--eval-retry-backoff-s", type=float, default=5.0,
                       help="Wait before the first retry of an unresolved assessment (s); doubles per retry.")
    group.add_argument("--eval-budget-s", type=float, default=None,
                       help="Overall assessment budget of one execution, retries and waits included (s); "
                            "default (eval-max-retries + 1) * eval-timeout-s + the backoff waits.")
    group.add_argument("--custom-rm-path", type=str, default=None,
                       help="Scoring rule 'pkg.mod:fn' (or pkg.mod.fn) of executable evaluators whose task names "
                            "no 'scoring:' (instead of junit): fn takes a gyre.evaluation.CheckResult and returns "
                            "a score, or (score, details); raising gyre.evaluation.Unresolved or returning None "
                            "leaves the assessment unresolved. Judges and tasks with their own 'scoring:' ignore it.")
    group.add_argument("--judge-base-url", type=str, default=None,
                       help="OpenAI-compatible base URL (http://host:port/v1) judge tasks call; default: the run's "
                            "proxy, i.e. the policy judges, with the execution's key and role evaluator (recorded, "
                            "never trained). A task's own evaluator base_url wins.")
    group.add_argument("--judge-model", type=str, default=None,
                       help="'model' of judge requests whose task names none (default: policy).")
    group.add_argument("--judge-api-key-env", type=str, default=None,
                       help="Environment variable holding the key sent to --judge-base-url (needs it).")
    return parser


def _add_harness_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="harness")
    group.add_argument("--harness", type=str, default="reference",
                       help="Black-box harness each execution runs: " + ", ".join(HARNESS_NAMES)
                            + ", or a dotted path pkg.module:Class to a gyre.harness.Harness subclass.")
    group.add_argument("--tasks", type=str, default=None,
                       help="Task file (JSONL/YAML) or directory; several, comma-separated.")
    group.add_argument("--strict-tasks", action="store_true",
                       help="Refuse the run (exit 2) if a task file has any problem; by default each bad task "
                            "is skipped with one 'file:line: reason' warning on stderr.")
    group.add_argument("--execution-timeout-s", type=float, default=600.0,
                       help="Wall-clock budget of one execution (s); timed-out work is still scored.")
    group.add_argument("--harness-isolation", choices=("auto", "require", "off"), default="auto",
                       help="Hide the run directory and tasks' hidden paths from harnesses (mount/pid namespaces).")
    group.add_argument("--harness-max-turns", type=_positive_int, default=None,
                       help="Model turns per execution (reference/claude-code max turns, mini-swe-agent step limit).")
    group.add_argument("--reference-tools", type=str, default=None,
                       help="Reference agent tools, comma-separated (default all: bash,read_file,write_file,"
                            "edit_file,delegate).")
    group.add_argument("--reference-compact-threshold-tokens", type=int, default=None,
                       help="Reference agent compacts above this context size (tokens); default 0.75 * seq-length, "
                            "0 disables.")
    group.add_argument("--reference-system-prompt", type=str, default=None,
                       help="Replaces the reference agent's system prompt ('' for none).")
    group.add_argument("--proxy-host", type=str, default="127.0.0.1", help="Address the proxy binds.")
    group.add_argument("--proxy-port", type=int, default=0,
                       help="Proxy port (0: pick a free one); with --proxy-workers K, worker i serves on port + i.")
    group.add_argument("--proxy-workers", type=int, default=1,
                       help="Proxy processes on rank 0 (1: the proxy runs in rank 0's process; K > 1: K worker "
                            "processes, each owning the executions whose id hashes to it).")
    group.add_argument("--proxy-max-body-bytes", type=_size, default=parse_size("32m"),
                       help="Largest model-call body (e.g. 32m), as declared, as received and after gzip/deflate "
                            "decoding; larger ones get 413.")
    group.add_argument("--proxy-max-json-depth", type=_positive_int, default=128,
                       help="Deepest nesting of arrays and objects in a model-call body (400 beyond).")
    group.add_argument("--proxy-max-messages", type=_positive_int, default=20_000,
                       help="Messages (Responses: input items) per model call (400 beyond).")
    group.add_argument("--proxy-max-tools", type=_positive_int, default=1_024,
                       help="Tool definitions per model call (400 beyond).")
    group.add_argument("--proxy-max-tool-results", type=_positive_int, default=2_048,
                       help="Tool results in one turn of a model call (400 beyond).")
    return parser


def _add_execution_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="executions")
    group.add_argument("--execution-backend", choices=("auto", *BACKENDS), default="auto",
                       help="Where each execution's harness runs: bwrap (bubblewrap sandbox over the host's root "
                            "read-only, no network), podman / docker (a container of the task's image), local "
                            "(plain processes; paths masked with --harness-isolation). auto: bwrap where it works, "
                            "else local with a warning.")
    group.add_argument("--execution-network", action="store_true",
                       help="Give sandboxes ordinary networking (e.g. package installs); by default a sandbox "
                            "reaches the proxy only.")
    group.add_argument("--execution-pids-limit", type=_positive_int, default=1024,
                       help="Processes and threads one sandboxed execution may have at once (bwrap, podman, docker).")
    group.add_argument("--execution-memory-limit", type=_size_or_none, default=parse_size("4g"),
                       help="Memory of one sandboxed execution, e.g. 4g (bwrap, podman, docker; 'none': no limit).")
    group.add_argument("--execution-workspace-limit", type=_size_or_none, default=parse_size("10g"),
                       help="Size of one execution's directory (workspace, home, tmp), e.g. 10g; past it the "
                            "execution ends as crashed ('none': no limit).")
    group.add_argument("--task-environment", type=_environment, default="host",
                       help="Environment of the tasks that name none: host (the machine's root, read-only), "
                            "image:NAME (podman, docker), dockerfile:PATH, rootfs:PATH.")
    group.add_argument("--docker-host", type=str, default=None,
                       help="The Docker daemon the docker backend talks to (DOCKER_HOST; default: the CLI's).")
    group.add_argument("--execution-fleet", type=str, default=None, metavar="ADDRESS|auto",
                       help="Run executions on the nodes of a Ray cluster (needs requirements-fleet.txt): ADDRESS of "
                            "its head (host:port or ray://...), or auto (RAY_ADDRESS or a cluster started on this "
                            "machine with `ray start`, else a one-node fleet started here). Each node offers "
                            "gyre_execution_slot resources and runs executions in its own --execution-backend; rank 0 "
                            "keeps the proxy (see docs/fleet.md).")
    group.add_argument("--fleet-slots-per-node", type=_positive_int, default=4,
                       help="--execution-fleet auto without a cluster: execution slots of the one-node fleet "
                            "started here (nodes started with `ray start` declare their own).")
    return parser


def _add_run_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="run")
    group.add_argument("--train-steps", type=int, default=2, help="Optimizer steps to run.")
    group.add_argument("--run-dir", type=str, default=None, help="Output directory (default runs/<timestamp>).")
    group.add_argument("--save-interval", type=int, default=0, help="Checkpoint every this many steps (0: end only).")
    group.add_argument("--load", type=str, default=None, help="Resume from this run directory or checkpoint.")
    group.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO",
                       help="Logging level of the run's log lines.")
    group.add_argument("--tensorboard-dir", type=str, default=None, help="Also write TensorBoard scalars here.")
    group.add_argument("--wandb-project", type=str, default=None, help="Also log to Weights & Biases (this project).")
    group.add_argument("--wandb-exp-name", type=str, default=None, help="W&B run name.")
    group.add_argument("--wandb-save-dir", type=str, default=None, help="W&B files (default: the run directory).")
    group.add_argument("--wandb-mode", choices=("online", "offline", "disabled"), default=None,
                       help="W&B mode (default: online with WANDB_API_KEY set, else offline: no network).")
    return parser


def add_gyre_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every Gyre argument group; usable as Megatron's ``extra_args_provider``."""
    for add in (_add_model_args, _add_rollout_args, _add_sglang_args, _add_placement_args, _add_admission_args,
                _add_objective_args, _add_evaluation_args, _add_harness_args, _add_execution_args, _add_run_args):
        add(parser)
    return parser


def add_megatron_core_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Megatron-LM flags Gyre reads, with Megatron-LM's names.

    Only for runs without Megatron-LM's own parser (megatron-core ships none).
    """
    group = parser.add_argument_group(title="distributed (Megatron-LM names)")
    group.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1,
                       help="TP: tensor-parallel ranks of one training replica (the CPU main job needs 1).")
    group.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1,
                       help="PP: pipeline stages of one training replica (the CPU main job needs 1).")
    group.add_argument("--seed", type=int, default=1234,
                       help="Random seed of the task order, engine sampling (cell c: seed + 1000 c) and torch.")
    group = parser.add_argument_group(title="optimizer (Megatron-LM names)")
    group.add_argument("--optimizer", choices=("adam",), default="adam",
                       help="Optimizer: Adam with decoupled weight decay (the only choice).")
    group.add_argument("--lr", type=float, default=1e-6, help="Learning rate (constant after the warm-up).")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1 (first-moment decay).")
    group.add_argument("--adam-beta2", type=float, default=0.95, help="Adam beta2 (second-moment decay).")
    group.add_argument("--adam-eps", type=float, default=1e-15, help="Adam epsilon (added to the denominator).")
    group.add_argument("--weight-decay", type=float, default=0.01,
                       help="Decoupled weight decay of weight matrices (biases and norms: none).")
    group.add_argument("--clip-grad", type=float, default=1.0,
                       help="Clip the global gradient L2 norm to this (0: no clipping).")
    group.add_argument("--lr-warmup-iters", type=int, default=0,
                       help="Linear learning-rate warm-up from 0 over this many optimizer updates.")
    group.add_argument("--attention-kernel", choices=("auto", "dense", "fused"), default="auto",
                       help="Megatron attention: dense (a [s, s] mask; the CPU path), fused (causal SDPA and "
                            "FlexAttention block masks for tree-packed micro-steps, no [s, s] mask; GPU only), "
                            "auto: fused on GPU.")
    group.add_argument("--bf16", action="store_true",
                       help="Train in bfloat16 (--training-backend megatron only; not exercised on CPU).")
    return parser


# --------------------------------------------------------------------------- config file


def _actions_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}


def _coerce(action: argparse.Action, key: str, value: Any) -> Any:
    """Type-check one YAML value the way the flag would; raise ArgumentError naming ``key``."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                           argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ArgumentError(f"config key '{key}': expected true or false, got {value!r}")
        return value
    if value is None:
        return None
    numeric = action.type in (int, float, _positive_int, _non_negative_float)
    if isinstance(value, dict) or (isinstance(value, list) and action.type is not _role_list):
        raise ArgumentError(f"config key '{key}': expected a scalar, got {type(value).__name__}")
    if isinstance(value, bool) and numeric:
        raise ArgumentError(f"config key '{key}': expected a number, got {value!r}")
    try:
        if isinstance(value, list):
            converted = _role_list(value)
        else:
            converted = action.type(str(value)) if action.type is not None else value
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ArgumentError(f"config key '{key}': invalid value {value!r} ({exc})") from None
    if action.choices is not None and converted not in action.choices:
        raise ArgumentError(
            f"config key '{key}': invalid choice {value!r} (choose from {', '.join(map(str, action.choices))})")
    return converted


def load_config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Read ``path`` (YAML mapping of flag names to values) into ``{dest: value}``.

    Raises:
        ArgumentError: unreadable file, not a mapping, unknown key or invalid value.
    """
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ArgumentError(f"config {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ArgumentError(f"config {path}:{where} not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(f"config {path}: expected a mapping of flag names to values")
    actions = _actions_by_key(parser)
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions:
            raise ArgumentError(f"config key '{key}': unknown (not a flag of {parser.prog})")
        out[dest] = _coerce(actions[dest], str(key), value)
    return out


# --------------------------------------------------------------------------- validation


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check invariants and derive values; raise :class:`ArgumentError` on the first violation.

    Derived: ``queue_depth_groups = (phi + mu) * B``, ``expected_staleness = phi + (mu - 1) / 2``
    (paper App. A), ``executions_per_step = N * B``, ``run_dir`` (``runs/<timestamp>`` when unset).
    """
    def need(cond: bool, flag: str, why: str) -> None:
        if not cond:
            raise ArgumentError(f"argument --{flag}: {why}")

    need(args.n_samples_per_prompt >= 2, "n-samples-per-prompt", "N must be >= 2 (group-relative advantages)")
    need(args.global_batch_groups >= 1, "global-batch-groups", "B must be >= 1")
    need(args.steps_per_burst >= 1, "steps-per-burst", "mu must be >= 1")
    need(args.extra_dispatch >= 0 and math.isfinite(args.extra_dispatch), "extra-dispatch", "phi must be >= 0")
    need(args.oversample_executions >= 0, "oversample-executions", "must be >= 0")
    need(args.max_trajectories_per_execution >= 1, "max-trajectories-per-execution", "J_max must be >= 1")
    need(args.num_cells >= 1, "num-cells", "K must be >= 1")
    need(args.rollout_concurrency_per_cell >= 1, "rollout-concurrency-per-cell", "must be >= 1")
    need(args.standalone_engines >= 0, "standalone-engines", "must be >= 0")
    need(args.standalone_concurrency >= 0, "standalone-concurrency", "must be >= 0")
    need(args.standalone_engines > 0 or args.standalone_concurrency == 0, "standalone-concurrency",
         "needs --standalone-engines > 0")
    need(args.train_steps >= 1, "train-steps", "must be >= 1")
    need(args.max_switch_failures >= 1, "max-switch-failures", "must be >= 1")
    need(args.save_interval >= 0, "save-interval", "must be >= 0")
    need(args.token_is_cap > 0, "token-is-cap", "C must be > 0")
    need(0 <= args.seq_clip_low < 1, "seq-clip-low", "eps_low must be in [0, 1)")
    need(args.seq_clip_high >= 0, "seq-clip-high", "eps_high must be >= 0")
    need(0 <= args.token_clip_low < 1, "token-clip-low", "must be in [0, 1)")
    need(args.token_clip_high >= 0, "token-clip-high", "must be >= 0")
    need(args.rollout_temperature > 0, "rollout-temperature", "must be > 0")
    need(0 < args.rollout_top_p <= 1, "rollout-top-p", "must be in (0, 1]")
    need(args.execution_timeout_s > 0, "execution-timeout-s", "must be > 0")
    missing = [t for t in (args.tasks or "").split(",") if t and not Path(t).exists()]
    need(not missing, "tasks", f"task file or directory not found: {','.join(missing)}")
    need(args.reference_compact_threshold_tokens is None or args.reference_compact_threshold_tokens >= 0,
         "reference-compact-threshold-tokens", "must be >= 0")
    if args.reference_tools is not None:
        from gyre.harness.reference_agent.tools import ALL_TOOLS

        bad = [t for t in args.reference_tools.split(",") if t and t not in ALL_TOOLS]
        need(not bad, "reference-tools", f"unknown tools {bad} (known: {', '.join(ALL_TOOLS)})")
    if args.harness not in HARNESS_NAMES:
        need(":" in args.harness or "." in args.harness, "harness",
             f"unknown harness {args.harness!r} (choose from {', '.join(HARNESS_NAMES)} or a dotted path "
             f"pkg.module:Class)")
        from gyre.harness.registry import load_harness_class

        try:
            load_harness_class(args.harness)
        except Exception as exc:  # a user module may raise anything on import
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            need(False, "harness", f"cannot load {args.harness!r}: {reason}")
    need(args.eval_timeout_s > 0, "eval-timeout-s", "must be > 0")
    need(args.eval_max_retries >= 0, "eval-max-retries", "must be >= 0")
    need(args.eval_retry_backoff_s >= 0, "eval-retry-backoff-s", "must be >= 0")
    need(args.eval_budget_s is None or args.eval_budget_s > 0, "eval-budget-s", "must be > 0")
    if args.custom_rm_path is not None:
        from gyre.evaluation import load_callable

        try:
            load_callable(args.custom_rm_path)
        except Exception as exc:  # a user module may raise anything on import
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            need(False, "custom-rm-path", f"cannot load {args.custom_rm_path!r}: {reason}")
    need(args.judge_base_url is None or args.judge_base_url.startswith(("http://", "https://")), "judge-base-url",
         f"must be an http(s) URL, got {args.judge_base_url!r}")
    need(args.judge_model is None or bool(args.judge_model.strip()), "judge-model", "must not be empty")
    if args.judge_api_key_env is not None:
        need(args.judge_base_url is not None, "judge-api-key-env",
             "needs --judge-base-url (the run's proxy takes the execution's key)")
        need(bool(os.environ.get(args.judge_api_key_env)), "judge-api-key-env",
             f"${args.judge_api_key_env} is not set")
    need(0 <= args.proxy_port <= 65535, "proxy-port", "must be in [0, 65535]")
    need(args.proxy_workers >= 1, "proxy-workers", "must be >= 1")
    need(args.proxy_port == 0 or args.proxy_port + args.proxy_workers - 1 <= 65535, "proxy-workers",
         "the workers' ports (proxy-port + i) must be <= 65535")
    need("evaluator" not in args.role_priority, "role-priority", "evaluator tokens are never trainable")
    if args.placement == "colocate" and not args.standalone_handoff:
        need(args.extra_dispatch == 0, "extra-dispatch", "colocate requires phi = 0 (unless --standalone-handoff)")
    if args.standalone_handoff:
        need(args.placement == "colocate", "standalone-handoff", "is for --placement colocate")
        need(args.standalone_concurrency > 0, "standalone-handoff",
             "needs a standalone pool (--standalone-concurrency > 0)")
    if args.placement == "async":
        need(args.num_cells >= 2, "num-cells", "async needs >= 2 cells (training and rollout)")
        need(1 <= args.train_cells < args.num_cells, "train-cells", f"must be in [1, {args.num_cells - 1}] for async")
    if hasattr(args, "tensor_model_parallel_size"):
        need(args.lr >= 0, "lr", "must be >= 0")
        need(0 <= args.adam_beta1 < 1, "adam-beta1", "must be in [0, 1)")
        need(0 <= args.adam_beta2 < 1, "adam-beta2", "must be in [0, 1)")
        need(args.adam_eps > 0, "adam-eps", "must be > 0")
        need(args.lr_warmup_iters >= 0, "lr-warmup-iters", "must be >= 0")
        need(args.clip_grad >= 0, "clip-grad", "must be >= 0")
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        cell = tp * pp
        text = os.environ.get("WORLD_SIZE", str(args.num_cells * cell))
        need(text.isdigit() and int(text) > 0, "num-cells", f"WORLD_SIZE={text!r} is not a positive integer")
        world = int(text)
        need(world == args.num_cells * cell, "num-cells",
             f"WORLD_SIZE={world} must be --num-cells x TP x PP = {args.num_cells} x {tp} x {pp} = "
             f"{args.num_cells * cell} (no data parallelism inside a cell)")
        args.world_size = world
        args.ranks_per_cell = world // args.num_cells
    args.queue_depth_groups = (args.extra_dispatch + args.steps_per_burst) * args.global_batch_groups
    args.expected_staleness = args.extra_dispatch + (args.steps_per_burst - 1) / 2
    args.executions_per_step = args.n_samples_per_prompt * args.global_batch_groups
    if args.run_dir is None:
        args.run_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    return args


# --------------------------------------------------------------------------- entry


def build_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    prog: str | None = None,
    description: str = "Gyre: elastic online RL for xLong-horizon agents",
) -> GyreArgumentParser:
    """Parser with ``--config``, the Megatron-LM subset, every Gyre group and any extras."""
    parser = GyreArgumentParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--config", type=str, default=None,
                        help="YAML file of flag defaults (keys with - or _); flags override it.")
    add_megatron_core_args(parser)
    add_gyre_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                      validate: Callable[[argparse.Namespace], argparse.Namespace]) -> argparse.Namespace:
    """Parse ``argv`` with ``parser``, taking defaults from ``--config FILE.yaml`` first, then ``validate``.

    Any :class:`ArgumentError` (from the file, a value or ``validate``) exits with status 2 and one line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    try:
        if known.config is not None:
            parser.set_defaults(**load_config_defaults(parser, known.config))
        return validate(parser.parse_args(argv))
    except ArgumentError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def parse_args(
    argv: Sequence[str] | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    prog: str | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) with ``--config`` defaults, then :func:`validate_args`.

    Exits with status 2 and one line on stderr for any error.
    """
    return parse_with_config(build_parser(extra_args_provider, prog=prog), argv, validate_args)
