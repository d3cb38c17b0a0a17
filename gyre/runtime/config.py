"""Typed configuration of the main job's two shells, built once from the parsed arguments."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gyre.buffer.packing import PackingConfig
from gyre.evaluation.settings import EvaluatorSettings
from gyre.evaluation.validity import RetryPolicy
from gyre.rl.advantages import AdvantageConfig
from gyre.scheduler.config import SchedulerConfig
from gyre.trajectory.admission import AdmissionConfig


@dataclass(frozen=True)
class ControllerConfig:
    """What rank 0's controller and the components it builds (scheduler, buffer, reward manager,
    admission, packer) need of the flags."""

    run_dir: Path
    seed: int
    num_cells: int
    train_steps: int
    save_interval: int
    keep_checkpoints: int
    placement: str
    training_backend: str
    execution_timeout_s: float
    n_samples_per_prompt: int
    max_executions_in_flight: int
    scheduler: SchedulerConfig
    advantages: AdvantageConfig
    retry: RetryPolicy
    admission: AdmissionConfig
    packing: PackingConfig
    evaluation: EvaluatorSettings = EvaluatorSettings()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ControllerConfig":
        return cls(run_dir=Path(args.run_dir), seed=int(args.seed), num_cells=int(args.num_cells),
                   train_steps=int(args.train_steps), save_interval=int(args.save_interval),
                   keep_checkpoints=int(args.keep_checkpoints),
                   placement=str(args.placement), training_backend=str(args.training_backend),
                   execution_timeout_s=float(args.execution_timeout_s),
                   n_samples_per_prompt=int(args.n_samples_per_prompt),
                   max_executions_in_flight=int(args.num_cells) * int(args.rollout_concurrency_per_cell)
                   + int(args.standalone_concurrency),
                   scheduler=SchedulerConfig.from_args(args), advantages=AdvantageConfig.from_args(args),
                   retry=RetryPolicy.from_args(args),
                   admission=AdmissionConfig(j_max=args.max_trajectories_per_execution,
                                             role_priority=tuple(args.role_priority),
                                             include_undelivered=bool(args.train_undelivered)),
                   packing=PackingConfig.from_args(args), evaluation=EvaluatorSettings.from_args(args))


@dataclass(frozen=True)
class CellConfig:
    """What one cell's loop needs of the flags."""

    num_cells: int
    seed: int
    max_running_requests: int
    lease_s: float
    update_weight_buffer_size: int = 512 << 20
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CellConfig":
        return cls(num_cells=int(args.num_cells), seed=int(args.seed),
                   max_running_requests=max(int(args.rollout_concurrency_per_cell), 1),
                   lease_s=float(args.cell_lease_s),
                   update_weight_buffer_size=int(args.update_weight_buffer_size),
                   tensor_model_parallel_size=int(args.tensor_model_parallel_size),
                   pipeline_model_parallel_size=int(args.pipeline_model_parallel_size))
