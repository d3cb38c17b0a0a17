"""Group-relative advantages (paper §5.3).

For a rollout group with valid rewards ``R_1..R_n``: ``A_i = R_i - b_i`` (mean-centred) or
``A_i = (R_i - b_i) / (std(R) + eps)`` (std-scaled, default), where ``b_i`` is the group mean
or, with ``leave_one_out=True``, the mean of the *other* rewards (RLOO); ``std`` is the
population standard deviation of the whole group in both cases (:func:`group_advantages`).

A group whose rewards are all equal (within ``zero_std_tol``) carries no learning signal: every
advantage is exactly ``0.0`` and the group is reported (:attr:`GroupAdvantages.zero_std`); the
trajectory buffer drops it with ``--filter-zero-std-groups``. Excluded executions (reward
``None``) get no advantage and never enter the mean or the std (:func:`compute_advantages`).
NaN is refused, never read as a zero. Arithmetic is float64 whatever the input dtype.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "AdvantageConfig",
    "GroupAdvantages",
    "compute_advantages",
    "group_advantages",
]


@dataclass(slots=True, frozen=True)
class AdvantageConfig:
    """How group-relative advantages are computed.

    * ``std_scaling`` -- divide by ``std + eps`` (``--advantage-std-scaling``; default on).
    * ``leave_one_out`` -- baseline is the mean of the other rewards
      (``--advantage-leave-one-out``; default off). Needs ``n >= 2``.
    * ``eps`` -- added to the std (default ``1e-6``; ``>= 0``). ``eps = 0`` is safe because
      near-zero stds are caught by ``zero_std_tol`` first.
    * ``zero_std_tol`` -- a group is all-equal when ``std <= zero_std_tol * max(1, max|R|)``
      (default ``1e-6``: float32 rounding noise is ~1e-8 relative).
    * ``filter_zero_std_groups`` -- the buffer drops all-equal groups
      (``--filter-zero-std-groups``); the maths here only reports them.

    Raises:
        ValueError: negative ``eps`` or ``zero_std_tol``.
    """

    std_scaling: bool = True
    leave_one_out: bool = False
    eps: float = 1e-6
    zero_std_tol: float = 1e-6
    filter_zero_std_groups: bool = False

    def __post_init__(self) -> None:
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a finite value >= 0, got {self.eps!r}")
        if not (self.zero_std_tol >= 0 and math.isfinite(self.zero_std_tol)):
            raise ValueError(f"zero_std_tol must be a finite value >= 0, got {self.zero_std_tol!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AdvantageConfig":
        """From parsed Gyre arguments (``--advantage-std-scaling``, ``--advantage-leave-one-out``,
        ``--filter-zero-std-groups``)."""
        return cls(
            std_scaling=bool(args.advantage_std_scaling),
            leave_one_out=bool(args.advantage_leave_one_out),
            filter_zero_std_groups=bool(args.filter_zero_std_groups),
        )


@dataclass(slots=True, frozen=True)
class GroupAdvantages:
    """Advantages of one rollout group.

    * ``advantages`` -- ``execution id -> A_i`` for every execution with a valid reward, in
      input order;
    * ``excluded`` -- execution ids whose reward was ``None`` (no advantage, not in the baseline);
    * ``mean`` / ``std`` -- over the valid rewards (population std, ``ddof = 0``);
    * ``zero_std`` -- all valid rewards equal (within ``zero_std_tol``): every advantage is 0.
    """

    advantages: dict[Hashable, float]
    excluded: tuple[Hashable, ...]
    mean: float
    std: float
    zero_std: bool
    config: AdvantageConfig = field(default_factory=AdvantageConfig)

    @property
    def num_valid(self) -> int:
        """Executions in the baseline."""
        return len(self.advantages)


def group_advantages(rewards: Sequence[float] | np.ndarray, config: AdvantageConfig | None = None
                     ) -> tuple[np.ndarray, float, float, bool]:
    """Advantages of one group of valid rewards.

    With leave-one-out, ``b_i = (sum(R) - R_i) / (n - 1)``, so
    ``R_i - b_i = n / (n - 1) * (R_i - mean(R))``; the std stays the whole group's (``ddof = 0``):
    a per-``i`` leave-one-out std would blow up when the other rewards happen to be equal. When
    ``std(R) <= zero_std_tol * max(1, max|R|)`` every advantage is exactly ``0.0`` (not
    ``noise / eps``).

    Args:
        rewards: ``float[n]`` valid rewards (``n >= 1``; ``n >= 2`` with leave-one-out).
        config: default :class:`AdvantageConfig` (std scaling, group-mean baseline).

    Returns:
        ``(advantages float64[n], mean, std, zero_std)``.

    Raises:
        ValueError: empty group, non-finite reward (an unresolved reward is never a number),
            or leave-one-out with ``n < 2``.
    """
    config = config or AdvantageConfig()
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError("rewards must be finite; pass excluded executions as None to compute_advantages")
    n = int(r.size)
    if config.leave_one_out and n < 2:
        raise ValueError("leave-one-out baseline needs at least 2 valid rewards")
    mean = float(r.mean())
    std = float(r.std())  # population std, ddof = 0
    zero_std = std <= config.zero_std_tol * max(1.0, float(np.abs(r).max()))
    if zero_std:
        return np.zeros(n, np.float64), mean, std, True
    centred = r - mean
    if config.leave_one_out:
        centred = centred * (n / (n - 1))  # R_i - (sum - R_i)/(n - 1)
    adv = centred / (std + config.eps) if config.std_scaling else centred
    return adv, mean, std, False


def compute_advantages(rewards: Mapping[Hashable, float | None], config: AdvantageConfig | None = None
                       ) -> GroupAdvantages:
    """Advantages for a group given per-execution rewards, ``None`` marking excluded executions.

    Args:
        rewards: ``execution id -> reward`` (``None``: excluded -- unresolved after the retry
            budget; never read as 0). At least one valid reward.
        config: advantage settings.

    Raises:
        ValueError: no valid reward, or a NaN/inf reward (see :func:`group_advantages`).
    """
    config = config or AdvantageConfig()
    valid = [(k, v) for k, v in rewards.items() if v is not None]
    excluded = tuple(k for k, v in rewards.items() if v is None)
    if not valid:
        raise ValueError("a group needs at least one valid reward")
    adv, mean, std, zero_std = group_advantages([float(v) for _, v in valid], config)
    return GroupAdvantages(
        advantages={k: float(a) for (k, _), a in zip(valid, adv)},
        excluded=excluded,
        mean=mean,
        std=std,
        zero_std=zero_std,
        config=config,
    )
