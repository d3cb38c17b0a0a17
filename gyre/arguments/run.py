"""Flag groups of the run itself: ``run`` (steps, run directory, checkpoints, logging).
"""

from __future__ import annotations

import argparse


def add_run_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="run")
    group.add_argument("--train-steps", type=int, default=2, help="Optimizer steps to run.")
    group.add_argument("--run-dir", type=str, default=None, help="Output directory (default runs/<timestamp>).")
    group.add_argument("--save-interval", type=int, default=0, help="Checkpoint every this many steps (0: end only).")
    group.add_argument("--keep-checkpoints", type=int, default=0,
                       help="Keep only this many newest complete checkpoints, deleting older ones once a "
                            "newer one is complete (0: keep all).")
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
