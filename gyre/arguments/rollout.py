"""Flag groups of the model and of serving it: ``model``, ``rollout`` (sampling, output and context
limits, KV moves between engines) and ``sglang`` (SGLang server flags passed through).
"""

from __future__ import annotations

import argparse

from gyre.arguments.values import host_port, positive_int, ratio_above_one


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    group.add_argument("--seq-length", type=positive_int, default=4096,
                       help="Longest token row trained or served (tokens).")
    return parser


def add_rollout_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    group.add_argument("--rollout-max-new-tokens", type=positive_int, default=512,
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
    group.add_argument("--rollout-shared-kv-store", type=host_port, default=None, metavar="HOST:PORT",
                       help="SGLang cells: a Mooncake master; every SGLang server runs its hierarchical cache "
                            "with this shared Mooncake store as the storage tier, so a request moved to another "
                            "cell finds its prefix there (--enable-hierarchical-cache --hicache-storage-backend "
                            "mooncake; flags you set with --sglang-* win).")
    group.add_argument("--rollout-shared-kv-protocol", choices=("rdma", "tcp"), default="rdma",
                       help="Transport of the shared KV store.")
    group.add_argument("--rollout-shared-kv-device", default="",
                       help="RDMA NICs for the shared KV store (e.g. mlx5_0,mlx5_1; empty: Mooncake picks).")
    group.add_argument("--rollout-shared-kv-segment-gb", type=positive_int, default=4,
                       help="Host memory (GiB) each SGLang server gives the shared KV store.")
    group.add_argument("--rollout-shared-kv-host-ratio", type=ratio_above_one, default=1.2,
                       help="Host KV pool of each SGLang server as a multiple of its GPU KV pool (SGLang's "
                            "hicache ratio; it must exceed 1, and SGLang's own default of 2 in pinned host memory "
                            "rarely fits a node running one server per GPU).")
    group.add_argument("--rollout-max-context-tokens", type=positive_int, default=None,
                       help="Prompt + output limit per model call (longer prompts get 400 'prompt is too long'; "
                            "output is cut to the room left). Default: the model's max_position_embeddings, "
                            "at most --seq-length in the main job.")
    return parser


def add_sglang_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--sglang-<flag>``: SGLang server flags passed through (slime style) when
    ``--rollout-engine sglang``; see ``gyre/rollout/sglang_driver/engine.py``.  Every one defaults to
    unset (SGLang's own default); all of SGLang's ``ServerArgs`` when SGLang is importable."""
    from gyre.rollout.sglang_driver.flags import add_sglang_arguments

    add_sglang_arguments(parser.add_argument_group(title="sglang (passed to sglang.launch_server)"))
    return parser
