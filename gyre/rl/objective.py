"""The execution-level GSPO-style objective (paper §6.1 and App. B; GSPO: Zheng et al. 2025,
arXiv:2507.18071). For execution ``i`` with admitted targets ``T_i`` (``L_i = |T_i|``),
behaviour log-probs ``b_t`` and current log-probs ``l_t``:

* ``rho_t = min(exp(sg(l_t) - b_t), C)``;  ``s_i = exp((1/L_i) * sum_{t in T_i} (l_t - b_t))``;
* ``m_i = 0`` when ``A_i > 0 and s_i > 1 + eps_high`` or ``A_i < 0 and s_i < 1 - eps_low``, else 1;
* ``loss = -(1/|E|) * sum_{i in E} (m_i / L_i) * sum_{t in T_i} rho_t * A_i * l_t``, ``E`` the
  executions of the batch with at least one target.

``s_i`` is the mean log-ratio over the execution's whole target set and only decides the mask;
``rho_t`` is a stop-gradient weight; each execution weighs the same whatever its length.
:func:`execution_objective` computes one micro-step's un-normalised share; whoever aggregates
all micro-steps divides once by ``|E|``. ``--loss-type ppo``/``grpo`` switch to token-level
PPO-clip baselines (see :func:`execution_objective`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields

import torch

__all__ = [
    "LOSS_TYPES",
    "ObjectiveConfig",
    "ObjectiveInputs",
    "ObjectiveOutput",
    "ObjectiveStats",
    "execution_objective",
]

LOSS_TYPES = ("gspo", "ppo", "grpo")


@dataclass(frozen=True, slots=True)
class ObjectiveConfig:
    """Settings of the objective; the defaults are those of the ``gyre.arguments`` flags.

    * ``loss_type`` -- ``gspo`` | ``ppo`` | ``grpo`` (``--loss-type``).
    * ``token_is_cap`` -- ``C`` (``--token-is-cap``, default 5); ``> 0``.
    * ``seq_clip_low`` / ``seq_clip_high`` -- ``eps_low``/``eps_high`` of the execution-level
      clip (``--seq-clip-low/high``, default 0.005 each); ``0 <= eps_low < 1``, ``eps_high >= 0``.
    * ``token_clip_low`` / ``token_clip_high`` -- PPO/GRPO token clip range
      (``--token-clip-low/high``, default 0.2 each); unused by ``gspo``.

    Raises:
        ValueError: unknown ``loss_type`` or an out-of-range value.
    """

    loss_type: str = "gspo"
    token_is_cap: float = 5.0
    seq_clip_low: float = 0.005
    seq_clip_high: float = 0.005
    token_clip_low: float = 0.2
    token_clip_high: float = 0.2

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if not (self.token_is_cap > 0):
            raise ValueError(f"token_is_cap must be > 0, got {self.token_is_cap!r}")
        for name in ("seq_clip_low", "token_clip_low"):
            v = getattr(self, name)
            if not (0 <= v < 1):
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        for name in ("seq_clip_high", "token_clip_high"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite value >= 0, got {v!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ObjectiveConfig":
        """From parsed Gyre arguments (``--loss-type``, ``--token-is-cap``, ``--seq-clip-low/high``,
        ``--token-clip-low/high``)."""
        return cls(
            loss_type=args.loss_type,
            token_is_cap=float(args.token_is_cap),
            seq_clip_low=float(args.seq_clip_low),
            seq_clip_high=float(args.seq_clip_high),
            token_clip_low=float(args.token_clip_low),
            token_clip_high=float(args.token_clip_high),
        )


@dataclass(slots=True)
class ObjectiveInputs:
    """What the objective needs about one micro-step besides the current log-probs.

    Targets (``N`` of them, any order):

    * ``behaviour_logprobs`` -- ``float [N]``: ``b_t`` (natural log).
    * ``target_execution`` -- ``int64 [N]``: index of the target's execution in ``0..E_m-1``.

    Executions present in the micro-step (``E_m``):

    * ``num_execution_targets`` -- ``int64 [E_m]``: ``L_i`` over the whole batch (all rows).
    * ``advantages`` -- ``float [E_m]``: ``A_i``.
    * ``counted`` -- ``bool [E_m]``: this micro-step counts the execution in ``|E|`` (exactly one
      micro-step does, for executions split over several). Default: all True.
    * ``log_ratio_sum`` -- ``float64 [E_m]`` or None: ``sum_{t in T_i} (l_t - b_t)`` from a
      forward-only pass for executions split over micro-steps; NaN (or None) = compute it here,
      which requires all ``L_i`` targets to be in this micro-step.
    """

    behaviour_logprobs: torch.Tensor
    target_execution: torch.Tensor
    num_execution_targets: torch.Tensor
    advantages: torch.Tensor
    counted: torch.Tensor | None = None
    log_ratio_sum: torch.Tensor | None = None

    @property
    def num_executions(self) -> int:
        """``E_m``."""
        return int(self.num_execution_targets.shape[0])


@dataclass(slots=True)
class ObjectiveStats:
    """Additive statistics of one or more micro-steps (merge with :meth:`merge`, also across ranks).

    Counts are over *counted* executions (each execution once) and over targets; sums are in
    nats (log-ratios, entropy). :meth:`metrics` turns them into the reported numbers.
    """

    loss_sum: float = 0.0
    normaliser: int = 0
    executions: int = 0
    clipped_high: int = 0
    clipped_low: int = 0
    targets: int = 0
    rho_sum: float = 0.0
    rho_max: float = 0.0
    capped: int = 0
    abs_log_ratio_sum: float = 0.0
    entropy_sum: float = 0.0
    entropy_targets: int = 0
    token_clipped: int = 0

    def merge(self, other: "ObjectiveStats") -> "ObjectiveStats":
        """Add ``other`` into ``self`` (max for ``rho_max``); returns ``self``."""
        for f in fields(self):
            if f.name == "rho_max":
                self.rho_max = max(self.rho_max, other.rho_max)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def metrics(self) -> dict[str, float]:
        """Reported metrics (NaN where undefined, e.g. no targets).

        * ``loss`` -- ``loss_sum / normaliser`` (the batch objective);
        * ``clip_fraction`` -- executions masked by the execution-level clip / executions
          (``clip_fraction_high``/``_low`` by direction); for ``ppo``/``grpo`` the token-level
          clip fraction is ``token_clip_fraction``;
        * ``rho_mean``/``rho_max`` -- token importance weights ``rho_t`` (capped);
        * ``rho_capped_fraction`` -- targets with ``exp(l_t - b_t) > C``;
        * ``train_inference_mismatch`` -- mean ``|l_t - b_t|`` (nats);
        * ``entropy`` -- mean entropy of the predicting distributions at targets (nats).
        """
        nan = math.nan
        ex, tg = self.executions, self.targets
        return {
            "loss": self.loss_sum / self.normaliser if self.normaliser else nan,
            "executions": float(ex),
            "targets": float(tg),
            "clip_fraction": (self.clipped_high + self.clipped_low) / ex if ex else nan,
            "clip_fraction_high": self.clipped_high / ex if ex else nan,
            "clip_fraction_low": self.clipped_low / ex if ex else nan,
            "token_clip_fraction": self.token_clipped / tg if tg else nan,
            "rho_mean": self.rho_sum / tg if tg else nan,
            "rho_max": self.rho_max if tg else nan,
            "rho_capped_fraction": self.capped / tg if tg else nan,
            "train_inference_mismatch": self.abs_log_ratio_sum / tg if tg else nan,
            "entropy": self.entropy_sum / self.entropy_targets if self.entropy_targets else nan,
        }


@dataclass(slots=True)
class ObjectiveOutput:
    """Result of :func:`execution_objective` for one micro-step.

    * ``loss_sum`` -- 0-d float64 tensor, differentiable w.r.t. the log-probs: the micro-step's
      term of the batch loss *before* dividing by the normaliser.
    * ``normaliser`` -- this micro-step's share of the divisor: counted executions (``gspo``,
      ``grpo``) or targets (``ppo``).
    * ``token_weights`` -- ``float64 [N]`` (detached): ``d loss_sum / d l_t`` for ``gspo``
      (``-m_i rho_t A_i / L_i``); for ``ppo``/``grpo`` the same at ``r_t``'s current value.
    * ``execution_mask`` -- ``bool [E_m]``: ``m_i`` (``gspo``; all True otherwise).
    * ``stats`` -- :class:`ObjectiveStats` of this micro-step.
    """

    loss_sum: torch.Tensor
    normaliser: int
    token_weights: torch.Tensor
    execution_mask: torch.Tensor
    stats: ObjectiveStats = field(default_factory=ObjectiveStats)


def _validate(logprobs: torch.Tensor, inp: ObjectiveInputs) -> None:
    n = logprobs.shape[0] if logprobs.ndim == 1 else -1
    if logprobs.ndim != 1 or inp.behaviour_logprobs.shape != (n,) or inp.target_execution.shape != (n,):
        raise ValueError(f"logprobs, behaviour_logprobs and target_execution must be [N]; got "
                         f"{tuple(logprobs.shape)}, {tuple(inp.behaviour_logprobs.shape)}, "
                         f"{tuple(inp.target_execution.shape)}")
    e = inp.num_executions
    for name in ("advantages", "counted", "log_ratio_sum"):
        t = getattr(inp, name)
        if t is not None and t.shape != (e,):
            raise ValueError(f"{name} must be [E_m={e}], got {tuple(t.shape)}")
    if n and (int(inp.target_execution.min()) < 0 or int(inp.target_execution.max()) >= e):
        raise ValueError(f"target_execution out of range [0, {e})")
    if e and int(inp.num_execution_targets.min()) < 1:
        raise ValueError("num_execution_targets (L_i) must be >= 1 for every execution present")
    if e and not bool(torch.isfinite(inp.advantages).all()):
        raise ValueError("advantages must be finite (NaN placeholder not replaced?)")


def execution_objective(
    logprobs: torch.Tensor,
    inputs: ObjectiveInputs,
    config: ObjectiveConfig | None = None,
    entropy: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """The objective's term for one micro-step (formulas in the module docstring).

    ``rho_t = min(exp(sg(l_t) - b_t), C)`` (``C``: ``--token-is-cap``), the mask uses
    ``--seq-clip-high``/``--seq-clip-low``, and ``d loss / d l_t = -(1/|E|) * m_i * rho_t * A_i / L_i``
    -- a per-execution mean, unlike a global token mean (``1 / sum_i L_i``).

    Separability: returns the un-normalised ``loss_sum`` (the sum over this micro-step's
    executions, without ``1/|E|``) and its share of the normaliser (``normaliser``: executions
    counted here). Whoever aggregates the gradients of all micro-steps (the core, or
    Megatron's ``finalize_model_grads`` with ``calculate_per_token_loss``) divides once by the
    total. An execution split over several micro-steps gets its ``s_i`` from a forward-only pass
    (``log_ratio_sum``) and is counted in ``|E|`` by exactly one micro-step (``counted``).

    Comparison switch (``--loss-type``): ``gspo`` (default) is the objective above; ``ppo`` is
    token-level PPO-clip, ``r_t = exp(l_t - b_t)`` (with gradient),
    ``-min(r_t A_i, clip(r_t, 1 - e_lo, 1 + e_hi) A_i)`` (``--token-clip-low/high``), averaged
    over all targets of the batch (normaliser = targets); ``grpo`` is the same token-level clip
    averaged per execution (``1/L_i``) then over executions (``1/|E|``), as GRPO's per-sample
    mean (Shao et al. 2024, DeepSeekMath, eq. 3).

    Args:
        logprobs: ``float [N]`` current log-probs ``l_t`` of the micro-step's targets (with grad).
        inputs: behaviour log-probs, execution ids, ``L_i``, ``A_i``, ``counted``, ``log_ratio_sum``.
        config: objective settings (default :class:`ObjectiveConfig`).
        entropy: optional ``float [N]`` entropy at the targets, only for the statistics.
        reference_logprobs: optional ``float [N]``: the values of ``sg(l_t)`` used in ``rho_t``,
            ``s_i`` and the masks; default ``logprobs.detach()``. Lets ``gradcheck`` hold the
            stop-gradient weights fixed while ``logprobs`` moves.

    Returns:
        :class:`ObjectiveOutput`; the batch loss is ``sum(loss_sum) / sum(normaliser)`` over
        the batch's micro-steps.

    Raises:
        ValueError: shape/range errors, non-finite advantages, ``L_i < 1``, or (``gspo``) an
            execution whose targets are not all in this micro-step and that has no
            ``log_ratio_sum``.
    """
    config = config or ObjectiveConfig()
    _validate(logprobs, inputs)
    dev = logprobs.device
    n, e = logprobs.shape[0], inputs.num_executions
    ex = inputs.target_execution.to(dev)
    L = inputs.num_execution_targets.to(dev, torch.float64)
    adv = inputs.advantages.to(dev, torch.float64)
    counted = (torch.ones(e, dtype=torch.bool, device=dev) if inputs.counted is None
               else inputs.counted.to(dev, torch.bool))
    lp64 = logprobs.to(torch.float64)
    ref = lp64.detach() if reference_logprobs is None else reference_logprobs.detach().to(dev, torch.float64)
    if ref.shape != lp64.shape:
        raise ValueError(f"reference_logprobs must be [N={n}], got {tuple(ref.shape)}")
    diff = ref - inputs.behaviour_logprobs.to(dev, torch.float64)  # sg(l_t) - b_t
    ratio = torch.exp(diff)
    cap = float(config.token_is_cap)
    rho = torch.clamp(ratio, max=cap)
    stats = _ratio_stats(n, int(counted.sum()), diff, ratio, rho, cap, entropy)
    if config.loss_type == "gspo":
        loss_sum, weights, mask = _gspo_terms(lp64, diff, rho, inputs, ex, L, adv, counted, config, stats)
        normaliser = stats.executions
    else:
        mask = torch.ones(e, dtype=torch.bool, device=dev)
        loss_sum, weights, normaliser = _token_clip_terms(lp64, ratio, inputs, ex, L, adv, config, stats)
    stats.loss_sum = float(loss_sum.detach())
    stats.normaliser = normaliser
    return ObjectiveOutput(loss_sum=loss_sum, normaliser=normaliser, token_weights=weights.detach(),
                           execution_mask=mask, stats=stats)


def _ratio_stats(n: int, executions: int, diff: torch.Tensor, ratio: torch.Tensor, rho: torch.Tensor, cap: float,
                 entropy: torch.Tensor | None) -> ObjectiveStats:
    """The statistics of the importance ratios (and the entropy) of ``n`` targets."""
    stats = ObjectiveStats(targets=n, executions=executions)
    if n:
        stats.rho_sum = float(rho.sum())
        stats.rho_max = float(rho.max())
        stats.capped = int((ratio > cap).sum())
        stats.abs_log_ratio_sum = float(diff.abs().sum())
    if entropy is not None:
        stats.entropy_sum = float(entropy.detach().to(torch.float64).sum())
        stats.entropy_targets = int(entropy.shape[0])
    return stats


def _gspo_terms(lp64: torch.Tensor, diff: torch.Tensor, rho: torch.Tensor, inputs: ObjectiveInputs,
                ex: torch.Tensor, L: torch.Tensor, adv: torch.Tensor, counted: torch.Tensor,
                config: ObjectiveConfig, stats: ObjectiveStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss_sum, token weights, execution mask)`` of the GSPO objective: each execution's
    ratio ``s_i`` from its mean log-ratio (this micro-step's, or ``log_ratio_sum``), the
    sequence-clip mask, and the per-token weights ``-(m_i rho_t A_i / L_i)``; counts the clipped
    executions into ``stats``."""
    dev = lp64.device
    e = inputs.num_executions
    lrs_here = torch.zeros(e, dtype=torch.float64, device=dev).index_add_(0, ex, diff)
    count_here = torch.bincount(ex, minlength=e).to(torch.float64)
    lrs = lrs_here
    if inputs.log_ratio_sum is not None:
        given = inputs.log_ratio_sum.to(dev, torch.float64)
        lrs = torch.where(torch.isnan(given), lrs_here, given)
        need = torch.isnan(given)
    else:
        need = torch.ones(e, dtype=torch.bool, device=dev)
    incomplete = need & (count_here != L)
    if bool(incomplete.any()):
        i = int(torch.nonzero(incomplete)[0])
        raise ValueError(f"execution {i} has {int(count_here[i])} of its L_i={int(L[i])} targets in this "
                         "micro-step and no log_ratio_sum: run the forward-only log-ratio pass first")
    s = torch.exp(lrs / L)  # GSPO execution ratio: mean log-ratio over T_i
    high = (adv > 0) & (s > 1.0 + config.seq_clip_high)
    low = (adv < 0) & (s < 1.0 - config.seq_clip_low)
    mask = ~(high | low)
    stats.clipped_high = int((high & counted).sum())
    stats.clipped_low = int((low & counted).sum())
    weights = -(mask[ex].to(torch.float64) * rho * adv[ex] / L[ex])
    return (weights * lp64).sum(), weights, mask


def _token_clip_terms(lp64: torch.Tensor, ratio: torch.Tensor, inputs: ObjectiveInputs, ex: torch.Tensor,
                      L: torch.Tensor, adv: torch.Tensor, config: ObjectiveConfig,
                      stats: ObjectiveStats) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(loss_sum, token weights, normaliser)`` of token-level PPO-clip: summed over targets
    (``ppo``, normaliser = targets) or per execution over ``L_i`` (``grpo``, normaliser =
    executions counted); counts the clipped tokens into ``stats``."""
    a_t, L_t = adv[ex], L[ex]
    lo, hi = 1.0 - config.token_clip_low, 1.0 + config.token_clip_high
    r = torch.exp(lp64 - inputs.behaviour_logprobs.to(lp64.device, torch.float64))  # with grad (no sg in PPO)
    surr = torch.minimum(r * a_t, torch.clamp(r, lo, hi) * a_t)
    clipped = ((a_t > 0) & (ratio > hi)) | ((a_t < 0) & (ratio < lo))
    stats.token_clipped = int(clipped.sum())
    if config.loss_type == "ppo":
        return -surr.sum(), -(a_t * ratio * (~clipped).to(torch.float64)), lp64.shape[0]
    # grpo
    return -(surr / L_t).sum(), -(a_t * ratio * (~clipped).to(torch.float64)) / L_t, stats.executions
