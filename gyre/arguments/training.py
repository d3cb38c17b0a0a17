"""Flag groups of what is trained and how: ``admission`` (which trajectories and tokens enter a
step, advantages), ``objective`` (the loss and its clipping) and ``micro-steps`` (the layout of
one packed micro-step and the lease of the cell that trains it).
"""

from __future__ import annotations

import argparse

from gyre.arguments.values import positive_int, role_list


def add_admission_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="admission")
    group.add_argument("--max-trajectories-per-execution", type=int, default=5,
                       help="J_max: admitted trajectories per execution.")
    group.add_argument("--role-priority", type=role_list, default=["main", "subagent", "compaction", "auxiliary"],
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


def add_objective_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="objective")
    group.add_argument("--loss-type", choices=("gspo", "ppo", "grpo"), default="gspo",
                       help="gspo: execution-level ratio and clipping; ppo/grpo: token-level clip.")
    group.add_argument("--token-is-cap", type=float, default=5.0, help="C: cap on token importance weights.")
    group.add_argument("--seq-clip-low", type=float, default=0.005, help="eps_low of execution-level clipping.")
    group.add_argument("--seq-clip-high", type=float, default=0.005, help="eps_high of execution-level clipping.")
    group.add_argument("--token-clip-low", type=float, default=0.2,
                       help="ppo/grpo only: lower token-level clip range (ratio >= 1 - this).")
    group.add_argument("--token-clip-high", type=float, default=0.2,
                       help="ppo/grpo only: upper token-level clip range (ratio <= 1 + this).")
    return parser


def add_micro_step_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="micro-steps")
    group.add_argument("--micro-step-tokens", type=positive_int, default=4096,
                       help="Token budget of one packed micro-step.")
    group.add_argument("--packing", choices=("pack", "pad"), default="pad",
                       help="Micro-step layout: pad a batch of rows (default; faster on CPU, bench/train.py) "
                            "or pack rows into one sequence (block-diagonal mask).")
    group.add_argument("--tree-packed-forward", action="store_true",
                       help="Compute a prefix shared by rows of one execution once (trie attention mask); "
                            "off by default: slower than per-row on CPU for real trace replays (bench/train.py).")
    group.add_argument("--logprob-chunk-size", type=positive_int, default=1024,
                       help="Targets per chunk when computing target log-probs (memory: chunk x vocab floats).")
    group.add_argument("--cell-lease-s", type=float, default=60.0,
                       help="A training cell whose stream heartbeat is older than this (seconds) is dead; "
                            "its micro-steps are queued again.")
    return parser
