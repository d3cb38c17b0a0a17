"""One training step: a batch of micro-steps -> gradient accumulation -> one optimizer update.

The backend-independent pieces: :class:`TrainStep` (the interface a cell trains through, whatever
the backend), :class:`MicroStepBatch` (torch view of a micro-step), :func:`micro_step_loss`, the
forward-only pass that gives executions split over micro-steps their log-ratio sums, the optimizer
settings. Backends: :mod:`gyre.training.hf_step` (``transformers``, AdamW) and
:mod:`gyre.training.megatron_step` (megatron-core ``GPTModel``, Megatron DDP and optimizer);
:func:`gyre.training.backends.build_train_step` builds the one the arguments ask for.

Whatever the number of micro-steps, gradients are accumulated un-normalised and divided by the
batch normaliser ``|E|`` once, then clipped, then one Adam update. Optimizer defaults: Adam with
decoupled weight decay, lr 1e-6, betas (0.9, 0.95), eps 1e-15, weight decay 0.01 on matrices only
(Megatron skips 1-D parameters), global grad-norm clip 1.0.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from gyre.buffer.packing import MicroStep
from gyre.rl.objective import ObjectiveConfig, ObjectiveInputs, ObjectiveOutput, ObjectiveStats, execution_objective

__all__ = [
    "AdamConfig",
    "LogprobFn",
    "MicroStepBatch",
    "StepResult",
    "TrainStep",
    "add_split_log_ratios",
    "apply_log_ratio_sums",
    "checked_temperature",
    "micro_step_loss",
    "optimizer_updates",
    "precompute_log_ratio_sums",
]

#: A policy: ``batch -> (target log-probs [N], entropy [N] or None)``.
LogprobFn = Callable[["MicroStepBatch"], tuple[torch.Tensor, "torch.Tensor | None"]]


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class AdamConfig:
    """Optimizer settings (Megatron-LM flag names).

    ``lr`` (``--lr``), ``adam_beta1``/``adam_beta2`` (``--adam-beta1/2``), ``adam_eps``
    (``--adam-eps``), ``weight_decay`` (``--weight-decay``, decoupled, matrices only),
    ``clip_grad`` (``--clip-grad``: max global L2 norm; 0 = no clipping), ``lr_warmup_iters``
    (``--lr-warmup-iters``: linear warm-up from 0 over that many updates, Megatron's
    ``OptimizerParamScheduler``: the update after ``k`` earlier ones uses ``lr * min(1, k / iters)``,
    so the first one only fills Adam's moments).
    """

    lr: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-15
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AdamConfig":
        """From parsed arguments (``--lr``, ``--adam-beta1/2``, ``--adam-eps``, ``--weight-decay``,
        ``--clip-grad``, ``--lr-warmup-iters``)."""
        d = cls()
        return cls(**{k: type(getattr(d, k))(vars(args)[k]) for k in cls.__slots__})

    def lr_at(self, num_updates: int) -> float:
        """Learning rate of the update that follows ``num_updates`` earlier ones (warm-up, then constant)."""
        if self.lr_warmup_iters > 0 and num_updates < self.lr_warmup_iters:
            return self.lr * num_updates / self.lr_warmup_iters
        return self.lr

    def set_lr(self, optimizer, num_updates: int) -> None:
        """Set every parameter group of ``optimizer`` to :meth:`lr_at` ``(num_updates)``."""
        lr = self.lr_at(num_updates)
        for group in optimizer.param_groups:
            group["lr"] = lr


def optimizer_updates(optimizer) -> int:
    """Updates an Adam(W) optimizer has made: the largest per-parameter ``step`` in its state, so the
    count survives a checkpoint of the optimizer's ``state_dict`` (torch and Megatron optimizers)."""
    steps = [st["step"] for _, st in optimizer.state.items() if "step" in st]  # Megatron's: a ProxyDict
    return int(max(float(x) for x in steps)) if steps else 0


def checked_temperature(temperature: float) -> float:
    """``temperature`` as a float; raises ``ValueError`` unless ``> 0``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return float(temperature)


@dataclass(slots=True)
class StepResult:
    """What one training step reports.

    ``metrics``: ``loss`` (batch objective), ``grad_norm`` (global L2 norm before clipping),
    ``normaliser`` (``|E|``; targets for ``ppo``), ``optimizer_steps`` (always 1),
    ``micro_steps``, token counts (``real_tokens``, ``forward_tokens``, ``row_tokens``,
    ``log_ratio_pass_tokens``: tokens of the forward-only pass), ``time_s`` (seconds),
    ``tokens_per_s`` (row tokens per second: the same work measure whatever the layout), and
    the objective metrics of :meth:`gyre.rl.objective.ObjectiveStats.metrics`.
    """

    metrics: dict[str, float]
    stats: ObjectiveStats = field(default_factory=ObjectiveStats)

    @classmethod
    def of(cls, stats: ObjectiveStats, grad_norm: float, micro_steps: Sequence[MicroStep], pass_tokens: int,
           dt: float) -> "StepResult":
        """The result of a step that took ``dt`` seconds."""
        m = stats.metrics()
        m.update(micro_steps=float(len(micro_steps)),
                 real_tokens=float(sum(ms.real_tokens for ms in micro_steps)),
                 forward_tokens=float(sum(ms.forward_tokens for ms in micro_steps)),
                 row_tokens=float(sum(ms.row_tokens for ms in micro_steps)))
        m.update(grad_norm=float(grad_norm), normaliser=float(stats.normaliser), optimizer_steps=1.0,
                 log_ratio_pass_tokens=float(pass_tokens), time_s=dt,
                 tokens_per_s=m["row_tokens"] / dt if dt > 0 else math.nan)
        return cls(metrics=m, stats=stats)


# --------------------------------------------------------------------------- batch


@dataclass(slots=True)
class MicroStepBatch:
    """Torch tensors of one :class:`~gyre.buffer.packing.MicroStep`.

    * ``input_ids``/``position_ids`` -- ``int64 [b, s]``;
    * ``attention_allowed`` -- ``bool [b, 1, s, s]``, True where attention is allowed, or None
      when plain causal attention is exact (:attr:`~gyre.buffer.packing.MicroStep.is_causal`) or
      when ``tree`` stands for it;
    * ``tree`` -- ``(enter, exit)`` ``int64 [b, s]`` in place of the dense mask
      (:meth:`~gyre.buffer.packing.MicroStep.ancestor_intervals`; built on request, for fused
      attention kernels), else None;
    * ``target_index``/``target_ids`` -- ``int64 [N]`` (flat ``row * s + col``, vocab id);
    * ``objective_inputs`` -- :class:`~gyre.rl.objective.ObjectiveInputs`;
    * ``micro_step`` -- the source micro-step.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_allowed: torch.Tensor | None
    target_index: torch.Tensor
    target_ids: torch.Tensor
    objective_inputs: ObjectiveInputs
    micro_step: MicroStep
    tree: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_micro_step(cls, ms: MicroStep, device: torch.device | str = "cpu",
                        tree_intervals: bool = False) -> "MicroStepBatch":
        """Convert.  A micro-step that is not plain causal gets the ``[b, 1, s, s]`` mask, or with
        ``tree_intervals`` its ``O(s)`` ancestor intervals instead."""
        t = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), dtype=dt, device=device)  # noqa: E731
        tree = None
        if tree_intervals and not ms.is_causal:
            tree = tuple(t(a, torch.int64) for a in ms.ancestor_intervals())
        return cls(
            input_ids=t(ms.input_ids, torch.int64),
            position_ids=t(ms.position_ids, torch.int64),
            attention_allowed=(None if ms.is_causal or tree is not None
                               else t(ms.attention_mask(), torch.bool)[:, None]),
            target_index=t(ms.target_index, torch.int64),
            target_ids=t(ms.target_ids, torch.int64),
            objective_inputs=ObjectiveInputs(
                behaviour_logprobs=t(ms.behaviour_logprobs, torch.float32),
                target_execution=t(ms.target_execution, torch.int64),
                num_execution_targets=t(ms.num_execution_targets, torch.int64),
                advantages=t(ms.advantages, torch.float64),
                counted=t(ms.counted, torch.bool),
                log_ratio_sum=t(ms.log_ratio_sum, torch.float64),
            ),
            micro_step=ms,
            tree=tree,
        )


# --------------------------------------------------------------------------- per micro-step


def micro_step_loss(policy: LogprobFn, batch: MicroStepBatch,
                    objective: ObjectiveConfig | None = None) -> ObjectiveOutput:
    """Forward one micro-step and evaluate its objective term (no backward, no normalisation).

    Returns :class:`~gyre.rl.objective.ObjectiveOutput`: ``loss_sum`` (backward it to accumulate
    gradients) and ``normaliser`` (this micro-step's share of ``|E|``).

    Raises:
        ValueError: see :func:`~gyre.rl.objective.execution_objective` (e.g. a split execution
            whose ``log_ratio_sum`` was not filled).
    """
    lp, ent = policy(batch)
    return execution_objective(lp, batch.objective_inputs, objective, ent)


def add_split_log_ratios(sums: dict[str, float], batch: MicroStepBatch, logprobs: torch.Tensor) -> None:
    """Add ``l_t - b_t`` (float64, summed per execution) of ``batch``'s split executions to ``sums``."""
    ms, inp = batch.micro_step, batch.objective_inputs
    per = torch.zeros(len(ms.execution_ids), dtype=torch.float64, device=logprobs.device).index_add_(
        0, inp.target_execution, logprobs.double() - inp.behaviour_logprobs.double())
    for e in np.flatnonzero(ms.split):
        eid = ms.execution_ids[e]
        sums[eid] = sums.get(eid, 0.0) + float(per[e])


def precompute_log_ratio_sums(policy: LogprobFn, micro_steps: Sequence[MicroStep],
                              device: torch.device | str = "cpu") -> tuple[dict[str, float], int]:
    """Forward-only pass for executions split over micro-steps.

    A sequence-level ratio needs the sum of ``l_t - b_t`` over all of an execution's targets, so an
    execution split over micro-steps needs it before any of them is backwarded. Runs the policy
    without gradients on every micro-step that holds a split execution and sums ``l_t - b_t``
    (float64) over each split execution's targets.

    Returns:
        ``({execution_id: sum of l_t - b_t}, forward tokens run)``; empty when nothing is split.
        With several cells, all-reduce the sums before :func:`apply_log_ratio_sums`.
    """
    sums: dict[str, float] = {}
    tokens = 0
    for ms in micro_steps:
        if not ms.split.any():
            continue
        batch = MicroStepBatch.from_micro_step(ms, device)
        with torch.no_grad():
            lp, _ = policy(batch)
        tokens += ms.forward_tokens
        add_split_log_ratios(sums, batch, lp)
    return sums, tokens


def apply_log_ratio_sums(micro_steps: Sequence[MicroStep], sums: dict[str, float]) -> None:
    """Write ``sums`` into each micro-step's ``log_ratio_sum`` for its split executions.

    Raises:
        KeyError: a split execution has no sum.
    """
    for ms in micro_steps:
        for e in np.flatnonzero(ms.split):
            ms.log_ratio_sum[e] = sums[ms.execution_ids[e]]


# --------------------------------------------------------------------------- the interface


class TrainStep(Protocol):
    """What a cell trains through, whatever the backend.

    ``params`` / ``param_names``: the trained tensors in a fixed order (what the weight snapshot and
    the prefix-group gradient sum carry); ``model`` and ``optimizer``: the backend's own objects
    (the optimizer's ``state_dict`` is checkpointed). A streaming cell calls :meth:`zero_grad`,
    then per work item :meth:`precompute_log_ratio_sums` and :meth:`accumulate`, sums
    :meth:`grad_tensors` over its prefix group, and the core calls :meth:`optimizer_step` with the
    batch normaliser. Backends that subclass this inherit :meth:`num_updates` and ``__call__``
    (one whole step in a single process).
    """

    model: torch.nn.Module
    optimizer: Any
    params: list[torch.Tensor]
    param_names: list[str]

    def zero_grad(self) -> None:
        """Clear the accumulated gradients."""
        ...

    def precompute_log_ratio_sums(self, micro_steps: Sequence[MicroStep]) -> tuple[dict[str, float], int]:
        """:func:`precompute_log_ratio_sums` with this step's model."""
        ...

    def accumulate(self, micro_steps: Sequence[MicroStep]) -> tuple[int, ObjectiveStats]:
        """Add the un-normalised gradients of ``micro_steps`` (no cross-replica reduction, no update);
        returns ``(normaliser, stats)`` of these micro-steps."""
        ...

    def grad_tensors(self) -> list[torch.Tensor | None]:
        """Where each parameter's accumulated gradient lives (shaped like :attr:`params`)."""
        ...

    def optimizer_step(self, normaliser: int | None) -> float:
        """Divide the gradients by ``normaliser`` (``|E|``), clip, one Adam update; returns the
        gradient norm before clipping."""
        ...

    def hf_named(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (shaped like :attr:`params`) under HF names and layout (for the rollout engine)."""
        ...

    def hf_named_buckets(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """:meth:`hf_named` in consecutive buckets of at most ``bucket_bytes`` (a larger tensor gets
        its own); a replica split over ranks yields them on its first rank only."""
        from gyre.rollout.weights import bucket_named_tensors

        for bucket in bucket_named_tensors(self.hf_named(tensors), bucket_bytes):
            yield dict(bucket)

    def save_hf(self, directory) -> None:
        """Write the weights as a servable HF checkpoint."""
        ...

    def _accumulate_and_update(self, micro_steps: Sequence[MicroStep]) -> tuple[float, ObjectiveStats]:
        """Gradients of ``micro_steps`` divided by ``|E|``, then the update: ``(grad_norm, stats)``."""
        ...

    def num_updates(self) -> int:
        """Optimizer updates so far (:func:`optimizer_updates`; survives a checkpoint)."""
        return optimizer_updates(self.optimizer)

    def __call__(self, micro_steps: Sequence[MicroStep]) -> StepResult:
        """One step: forward-only pass for split executions, accumulate, one update."""
        t0 = time.perf_counter()
        self.zero_grad()
        sums, pass_tokens = self.precompute_log_ratio_sums(micro_steps)
        apply_log_ratio_sums(micro_steps, sums)
        grad_norm, stats = self._accumulate_and_update(micro_steps)
        return StepResult.of(stats, grad_norm, micro_steps, pass_tokens, time.perf_counter() - t0)
