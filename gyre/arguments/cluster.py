"""Flag groups of where the job runs and how its parts reach each other: ``placement`` (cells,
the standalone pool, switching), ``weight transfer`` (how snapshots and KV move between nodes and
into engines) and the Megatron-LM-named ``distributed`` and ``optimizer`` groups
(:func:`add_megatron_core_args`).
"""

from __future__ import annotations

import argparse

from gyre.arguments.values import PLACEMENTS, positive_int


def add_placement_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    return parser


def add_weight_transfer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="weight transfer")
    group.add_argument("--weight-transport", choices=("mooncake-tcp", "mooncake-rdma"), default="mooncake-tcp",
                       help="How weight snapshots (and engine-to-engine KV copies) move between nodes: Mooncake "
                            "over TCP, or over RDMA (the CUDA build of Mooncake on InfiniBand/RoCE).")
    group.add_argument("--weight-transport-device", default="",
                       help="RDMA NICs for --weight-transport mooncake-rdma "
                            "(e.g. mlx5_0,mlx5_1; empty: Mooncake picks).")
    group.add_argument("--update-weight-buffer-size", type=positive_int, default=512 << 20,
                       help="Bytes per bucket when a cell loads the policy into its engine (the model goes over "
                            "in buckets of about this size, gathered from the cell's shards unit by unit).")
    return parser


def add_megatron_core_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Megatron-LM flags Gyre reads, with Megatron-LM's names.

    Only for runs without Megatron-LM's own parser (megatron-core ships none).
    """
    group = parser.add_argument_group(title="distributed (Megatron-LM names)")
    group.add_argument("--tensor-model-parallel-size", type=positive_int, default=1,
                       help="TP: tensor-parallel ranks of one training replica (the CPU main job needs 1).")
    group.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1,
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
