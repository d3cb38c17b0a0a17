"""One training step: a batch of micro-steps -> gradient accumulation -> **one** optimizer update.

DESIGN.md §3.5 (objective, optimizer) and §4.4 (one update per batch whatever the number of
micro-steps; ``1/|E|`` applied once when gradients are aggregated). Single process here; the
streaming, multi-cell version reuses these pieces unchanged:

* :class:`MicroStepBatch` -- torch view of one :class:`~gyre.buffer.packing.MicroStep`
  (ids, position ids, attention mask, targets, objective inputs).
* Policies -- the model side of a micro-step, returning the targets' current log-probs (and
  entropy): :class:`HFPolicy` (``transformers`` causal LM, hidden states projected chunk by
  chunk: never ``[T, V]``) and :class:`MegatronPolicy` (megatron-core ``GPTModel``, logits
  ``[b, s, V]`` then chunked target log-probs). Both honour arbitrary position ids and the
  packed/tree attention mask, so ``pack``, ``pad`` and tree-packed micro-steps give the same
  numbers as one row at a time.
* :func:`micro_step_loss` -- forward of one micro-step + :func:`gyre.rl.objective.execution_objective`:
  the **separable per-micro-step computation** (un-normalised ``loss_sum`` and its share of the
  normaliser). Call ``.loss_sum.backward()`` on it to accumulate gradients.
* :func:`precompute_log_ratio_sums` / :func:`apply_log_ratio_sums` -- the forward-only pass that
  gives ``s_i`` to executions split over several micro-steps.
* :class:`HFTrainStep` -- ``forward_backward(micro_steps)`` (accumulate, no update) then
  ``optimizer_step(normaliser)`` (divide by ``|E|`` once, clip, AdamW); ``__call__`` does both.
* The streaming interface both train steps share (what a cell of DESIGN.md §4.4 calls, so the
  cell does not care which backend it trains): ``params`` / ``param_names`` (the tensors the core's
  weight snapshot and the prefix-group broadcast carry, in a fixed order), ``zero_grad()``,
  ``precompute_log_ratio_sums(micro_steps)``, ``accumulate(micro_steps)`` (un-normalised gradients,
  no cross-replica reduction), ``grad_tensors()`` (where those gradients live: ``.grad`` or
  Megatron's ``.main_grad``), ``optimizer_step(normaliser)``, ``hf_named(tensors)`` (HF names for
  the rollout engine) and ``save_hf(directory)``.
* :class:`MegatronTrainStep` -- the same through Megatron's ``get_forward_backward_func``
  (``forward_step`` is the Megatron ``forward_step_func`` of one micro-step; ``forward_backward``
  then ``optimizer_step``); the loss function returns the 3-tuple ``(loss_sum, normaliser, stats)`` with
  ``config.calculate_per_token_loss = True``, so ``finalize_model_grads`` divides the
  (data-parallel all-reduced) gradients by the total normaliser ``|E|`` once
  (``megatron/core/pipeline_parallel/schedules.py`` ``forward_step_calc_loss``;
  ``megatron/core/distributed/finalize_model_grads.py``).

Optimizer (DESIGN.md §3.5, all flags): Adam with decoupled weight decay, lr 1e-6 constant,
betas (0.9, 0.95), eps 1e-15, weight decay 0.01 on matrices only (Megatron's default skips
1-D parameters), global grad-norm clip 1.0 (``clip = max_norm / (norm + 1e-6)`` when below 1,
as ``torch.nn.utils.clip_grad_norm_`` and ``megatron/core/optimizer/clip_grads.py``).

Scope: TP = 1 (vocab-parallel log-softmax is not implemented; see :mod:`gyre.training.logprobs`);
PP > 1 would need ``config.variable_seq_lengths = True`` since micro-steps differ in shape.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gyre.buffer.packing import MicroStep
from gyre.rl.objective import ObjectiveConfig, ObjectiveInputs, ObjectiveOutput, ObjectiveStats, execution_objective
from gyre.training.logprobs import DEFAULT_CHUNK_SIZE, target_logprobs_from_hidden, target_logprobs_from_logits

__all__ = [
    "AdamConfig",
    "HFPolicy",
    "HFTrainStep",
    "MegatronPolicy",
    "MegatronTrainStep",
    "MicroStepBatch",
    "StepResult",
    "apply_log_ratio_sums",
    "build_hf_optimizer",
    "build_megatron_train_step",
    "build_train_step",
    "micro_step_loss",
    "optimizer_updates",
    "precompute_log_ratio_sums",
]

LogprobFn = Callable[["MicroStepBatch"], tuple[torch.Tensor, "torch.Tensor | None"]]


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class AdamConfig:
    """Optimizer settings (DESIGN.md §3.5 defaults; Megatron-LM flag names).

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
        return cls(**{k: type(getattr(d, k))(getattr(args, k, getattr(d, k))) for k in cls.__slots__})

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


# --------------------------------------------------------------------------- batch


@dataclass(slots=True)
class MicroStepBatch:
    """Torch tensors of one :class:`~gyre.buffer.packing.MicroStep`.

    * ``input_ids``/``position_ids`` -- ``int64 [b, s]``;
    * ``attention_allowed`` -- ``bool [b, 1, s, s]``, True where attention is allowed, or None
      when plain causal attention is exact (:attr:`~gyre.buffer.packing.MicroStep.is_causal`);
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

    @classmethod
    def from_micro_step(cls, ms: MicroStep, device: torch.device | str = "cpu") -> "MicroStepBatch":
        """Convert (builds the ``[b, 1, s, s]`` mask unless the micro-step is plain causal)."""
        t = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), dtype=dt, device=device)  # noqa: E731
        return cls(
            input_ids=t(ms.input_ids, torch.int64),
            position_ids=t(ms.position_ids, torch.int64),
            attention_allowed=None if ms.is_causal else t(ms.attention_mask(), torch.bool)[:, None],
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
        )


# --------------------------------------------------------------------------- policies


def _checked_temperature(temperature: float) -> float:
    """``temperature`` as a float; raises ``ValueError`` unless ``> 0``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return float(temperature)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


class HFPolicy:
    """Target log-probs from a ``transformers`` causal LM (``Qwen3ForCausalLM`` and alikes).

    Runs the decoder body (``model.model``) with the micro-step's position ids and a 4-D mask
    (``[b, 1, s, s]``, boolean for sdpa, additive otherwise; transformers uses a 4-D mask as
    given), then
    :func:`~gyre.training.logprobs.target_logprobs_from_hidden` with the output embedding.
    Assumes no logit soft-capping or scaling (true for Qwen2/Qwen3).

    ``temperature``: log-probs (and entropy) of ``softmax(logits / temperature)``, the
    distribution the rollout engine sampled from and whose log-probs it returned (SGLang and the
    embedded engine return tempered log-probs; slime and verl divide the logits the same way).
    Applied as ``hidden / temperature`` (exact: the output projection is linear, no bias).

    Raises:
        ValueError: ``temperature <= 0``.
    """

    def __init__(self, model: torch.nn.Module, chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = True,
                 temperature: float = 1.0):
        self.model = model
        self.chunk_size = chunk_size
        self.with_entropy = with_entropy
        self.temperature = _checked_temperature(temperature)

    def __call__(self, batch: MicroStepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [N], entropy [N] or None)`` of the batch's targets."""
        body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        weight = self.model.get_output_embeddings().weight
        if batch.attention_allowed is None:
            mask = None  # causal kernel (~1.7x faster than an explicit mask on CPU at 8k tokens)
        elif getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            mask = batch.attention_allowed  # torch sdpa: bool, True = attend (4x smaller than float)
        else:
            mask = torch.zeros(batch.attention_allowed.shape, dtype=weight.dtype, device=weight.device)
            mask.masked_fill_(~batch.attention_allowed, torch.finfo(weight.dtype).min)
        out = body(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                   use_cache=False)
        hidden = out.last_hidden_state
        if self.temperature != 1.0:
            hidden = hidden / self.temperature
        return target_logprobs_from_hidden(hidden.reshape(-1, hidden.shape[-1]), weight, batch.target_index,
                                           batch.target_ids, self.chunk_size, self.with_entropy)


class _RotaryPositions:
    """Make a megatron-core ``GPTModel``'s RoPE follow explicit position ids.

    ``GPTModel._preprocess`` builds RoPE for positions ``0..s-1`` of every sequence
    (``megatron/core/models/gpt/gpt_model.py``; ``position_ids`` only feed learned absolute
    embeddings), which is wrong for packed rows and trie segments. This replaces the forward
    of *this model instance's* ``rotary_pos_emb`` (no global patch): while ``positions``
    (``[b, s]``) is set it returns the frequencies gathered at those positions, shaped
    ``[s, b, 1, d]``, which ``_apply_rotary_pos_emb_bshd`` broadcasts against ``[s, b, h, d]``
    (``megatron/core/models/common/embeddings/rope_utils.py``). Unset, it is the original.
    """

    def __init__(self, rope: torch.nn.Module):
        self.rope, self.orig, self.positions = rope, rope.forward, None
        rope.forward = self._forward
        rope._gyre_positions = self

    @classmethod
    def install(cls, gpt_model: torch.nn.Module) -> "_RotaryPositions":
        """Install on ``gpt_model`` once; later calls return the installed instance."""
        rope = getattr(gpt_model, "rotary_pos_emb", None)
        if rope is None:
            raise ValueError("model has no rotary_pos_emb (expected position_embedding_type='rope')")
        return getattr(rope, "_gyre_positions", None) or cls(rope)

    def _forward(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
        pos = self.positions
        if pos is None:
            return self.orig(max_seq_len, offset, packed_seq, cp_group)
        emb = self.orig(int(pos.max()) + 1)  # [P, 1, 1, d]
        b, s = pos.shape
        return emb[pos.t().reshape(-1), 0, 0].reshape(s, b, 1, -1)


class MegatronPolicy:
    """Target log-probs from a megatron-core ``GPTModel`` (optionally wrapped in DDP).

    ``logits(model, batch)`` runs the model (``[b, s, V]`` logits, no labels) with the
    micro-step's mask (complement of ``attention_allowed``) and RoPE at the micro-step's
    position ids; ``target_logprobs(logits, batch)`` gathers the targets chunk by chunk.
    TP = 1 only (logits would be vocabulary shards). ``temperature``: as :class:`HFPolicy`;
    the logits are divided by it in place (a ``[b, s, V]`` copy would double the largest tensor
    of the step; the output layer's backward does not need its output).

    Raises:
        NotImplementedError: tensor parallelism > 1.
        ValueError: ``temperature <= 0``.
    """

    def __init__(self, model: torch.nn.Module, chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = True,
                 temperature: float = 1.0):
        from megatron.core import parallel_state as ps

        self.temperature = _checked_temperature(temperature)
        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
            raise NotImplementedError("MegatronPolicy: vocab-parallel target log-probs (TP > 1) are not implemented")
        self.model = model
        self.gpt = _unwrap(model)
        self.rope = _RotaryPositions.install(self.gpt)
        self.chunk_size = chunk_size
        self.with_entropy = with_entropy

    def logits(self, model: torch.nn.Module, batch: MicroStepBatch) -> torch.Tensor:
        """``[b, s, V]`` logits of ``model`` (the wrapped or bare GPTModel) for ``batch``."""
        from gyre.training.megatron_model import causal_attention_mask

        allowed = batch.attention_allowed
        mask = causal_attention_mask(batch.input_ids.shape[1]) if allowed is None else ~allowed
        self.rope.positions = batch.position_ids
        try:
            return model(batch.input_ids, batch.position_ids, mask)
        finally:
            self.rope.positions = None

    def target_logprobs(self, logits: torch.Tensor, batch: MicroStepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [N], entropy [N] or None)`` from ``logits [b, s, V]``."""
        if self.temperature != 1.0:
            logits = logits.div_(self.temperature)
        return target_logprobs_from_logits(logits.reshape(-1, logits.shape[-1]), batch.target_index,
                                           batch.target_ids, self.chunk_size, self.with_entropy)

    def __call__(self, batch: MicroStepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both steps on ``self.model``."""
        return self.target_logprobs(self.logits(self.model, batch), batch)


# --------------------------------------------------------------------------- per micro-step


def micro_step_loss(policy: LogprobFn, batch: MicroStepBatch, objective: ObjectiveConfig | None = None) -> ObjectiveOutput:
    """Forward one micro-step and evaluate its objective term (no backward, no normalisation).

    Returns :class:`~gyre.rl.objective.ObjectiveOutput`: ``loss_sum`` (backward it to accumulate
    gradients) and ``normaliser`` (this micro-step's share of ``|E|``).

    Raises:
        ValueError: see :func:`~gyre.rl.objective.execution_objective` (e.g. a split execution
            whose ``log_ratio_sum`` was not filled).
    """
    lp, ent = policy(batch)
    return execution_objective(lp, batch.objective_inputs, objective, ent)


def precompute_log_ratio_sums(policy: LogprobFn, micro_steps: Sequence[MicroStep]) -> tuple[dict[str, float], int]:
    """Forward-only pass for executions split over micro-steps (DESIGN.md §3.5).

    Runs the policy without gradients on every micro-step that holds a split execution and sums
    ``l_t - b_t`` (float64) over each split execution's targets.

    Returns:
        ``({execution_id: sum of l_t - b_t}, forward tokens run)``; empty when nothing is split.
        With several cells, all-reduce the sums before :func:`apply_log_ratio_sums`.
    """
    sums: dict[str, float] = {}
    tokens = 0
    for ms in micro_steps:
        if not ms.split.any():
            continue
        batch = MicroStepBatch.from_micro_step(ms)
        with torch.no_grad():
            lp, _ = policy(batch)
        tokens += ms.forward_tokens
        diff = lp.double() - batch.objective_inputs.behaviour_logprobs.double()
        per = torch.zeros(len(ms.execution_ids), dtype=torch.float64).index_add_(
            0, batch.objective_inputs.target_execution, diff)
        for e in np.flatnonzero(ms.split):
            eid = ms.execution_ids[e]
            sums[eid] = sums.get(eid, 0.0) + float(per[e])
    return sums, tokens


def apply_log_ratio_sums(micro_steps: Sequence[MicroStep], sums: dict[str, float]) -> None:
    """Write ``sums`` into each micro-step's ``log_ratio_sum`` for its split executions.

    Raises:
        KeyError: a split execution has no sum.
    """
    for ms in micro_steps:
        for e in np.flatnonzero(ms.split):
            ms.log_ratio_sum[e] = sums[ms.execution_ids[e]]


def _token_metrics(micro_steps: Sequence[MicroStep]) -> dict[str, float]:
    return {
        "micro_steps": float(len(micro_steps)),
        "real_tokens": float(sum(m.real_tokens for m in micro_steps)),
        "forward_tokens": float(sum(m.forward_tokens for m in micro_steps)),
        "row_tokens": float(sum(m.row_tokens for m in micro_steps)),
    }


# --------------------------------------------------------------------------- HF path


def optimizer_updates(optimizer) -> int:
    """Updates an Adam(W) optimizer has made: the largest per-parameter ``step`` in its state, so the
    count survives a checkpoint of the optimizer's ``state_dict`` (torch and Megatron optimizers)."""
    steps = [st["step"] for _, st in optimizer.state.items() if "step" in st]  # Megatron's: a ProxyDict
    return int(max(float(x) for x in steps)) if steps else 0


def build_hf_optimizer(model: torch.nn.Module, adam: AdamConfig | None = None) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with Megatron's parameter groups: weight decay on parameters with
    ``ndim >= 2``, none on 1-D ones (norms, biases) -- ``megatron/core/optimizer/__init__.py``
    ``get_standard_config_overrides``. Tied parameters appear once."""
    adam = adam or AdamConfig()
    seen: set[int] = set()
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": adam.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=adam.lr, betas=(adam.adam_beta1, adam.adam_beta2), eps=adam.adam_eps)


class HFTrainStep:
    """Training step on a ``transformers`` model (the reference path).

    Args:
        model: causal LM (trained in place).
        objective: :class:`~gyre.rl.objective.ObjectiveConfig`.
        adam: :class:`AdamConfig` (ignored when ``optimizer`` is given).
        chunk_size: targets per log-prob chunk.
        optimizer: an existing optimizer (default :func:`build_hf_optimizer`).
        temperature: the rollout sampling temperature (:class:`HFPolicy`).
    """

    def __init__(self, model: torch.nn.Module, objective: ObjectiveConfig | None = None,
                 adam: AdamConfig | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 optimizer: torch.optim.Optimizer | None = None, temperature: float = 1.0):
        self.model = model
        self.objective = objective or ObjectiveConfig()
        self.adam = adam or AdamConfig()
        self.policy = HFPolicy(model, chunk_size, temperature=temperature)
        self.optimizer = optimizer or build_hf_optimizer(model, self.adam)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        names = {id(p): n for n, p in model.named_parameters()}
        self.param_names = [names[id(p)] for p in self.params]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def precompute_log_ratio_sums(self, micro_steps: Sequence[MicroStep]) -> tuple[dict[str, float], int]:
        """:func:`precompute_log_ratio_sums` with this step's policy."""
        return precompute_log_ratio_sums(self.policy, micro_steps)

    def accumulate(self, micro_steps: Sequence[MicroStep]) -> tuple[int, ObjectiveStats]:
        """:meth:`forward_backward` (a ``transformers`` model never reduces across replicas)."""
        return self.forward_backward(micro_steps)

    def grad_tensors(self) -> list[torch.Tensor | None]:
        """Each parameter's accumulated gradient (``None`` where nothing flowed)."""
        return [p.grad for p in self.params]

    def hf_named(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (shaped like :attr:`params`) under their HF names."""
        return dict(zip(self.param_names, tensors))

    def save_hf(self, directory) -> None:
        """``save_pretrained`` of the model (weights and ``config.json``)."""
        self.model.save_pretrained(directory)

    def forward_backward(self, micro_steps: Sequence[MicroStep]) -> tuple[int, ObjectiveStats]:
        """Accumulate un-normalised gradients of ``micro_steps`` into ``.grad`` (no update).

        Split executions must already have ``log_ratio_sum`` (:func:`precompute_log_ratio_sums`).
        Returns ``(normaliser, stats)`` summed over the micro-steps.
        """
        stats = ObjectiveStats()
        for ms in micro_steps:
            out = micro_step_loss(self.policy, MicroStepBatch.from_micro_step(ms), self.objective)
            if out.loss_sum.requires_grad:
                out.loss_sum.backward()
            stats.merge(out.stats)
        return stats.normaliser, stats

    def optimizer_step(self, normaliser: int) -> float:
        """Divide accumulated gradients by ``normaliser`` (``|E|``) once, clip, one AdamW update.

        Returns the global gradient norm before clipping.
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        if normaliser > 0:
            for g in grads:
                g.div_(normaliser)
        if self.adam.clip_grad > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.adam.clip_grad))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        self.adam.set_lr(self.optimizer, self.num_updates())
        self.optimizer.step()
        return norm

    def num_updates(self) -> int:
        """Optimizer updates so far (:func:`optimizer_updates`)."""
        return optimizer_updates(self.optimizer)

    def __call__(self, micro_steps: Sequence[MicroStep]) -> StepResult:
        """One step: forward-only pass for split executions, accumulate, one update."""
        t0 = time.perf_counter()
        self.zero_grad()
        sums, pass_tokens = self.precompute_log_ratio_sums(micro_steps)
        apply_log_ratio_sums(micro_steps, sums)
        normaliser, stats = self.forward_backward(micro_steps)
        grad_norm = self.optimizer_step(normaliser)
        return _result(stats, grad_norm, micro_steps, pass_tokens, time.perf_counter() - t0)


def _result(stats: ObjectiveStats, grad_norm: float, micro_steps, pass_tokens: int, dt: float) -> StepResult:
    m = stats.metrics()
    m.update(_token_metrics(micro_steps))
    m.update(grad_norm=float(grad_norm), normaliser=float(stats.normaliser), optimizer_steps=1.0,
             log_ratio_pass_tokens=float(pass_tokens), time_s=dt,
             tokens_per_s=m["row_tokens"] / dt if dt > 0 else math.nan)
    return StepResult(metrics=m, stats=stats)


# --------------------------------------------------------------------------- Megatron path


class MegatronTrainStep:
    """Training step through megatron-core's ``get_forward_backward_func`` (single cell).

    Args:
        model: the DDP-wrapped ``GPTModel`` (:func:`gyre.training.megatron_model.wrap_ddp`);
            its ``TransformerConfig`` must have ``calculate_per_token_loss=True`` *before* the DDP
            wrap (DDP then skips its ``1/dp`` scaling and ``finalize_model_grads`` divides by the
            all-reduced normaliser).
        optimizer: Megatron optimizer (:func:`gyre.training.megatron_model.build_optimizer`).
        objective: :class:`~gyre.rl.objective.ObjectiveConfig`.
        chunk_size: targets per log-prob chunk.
        adam: :class:`AdamConfig` whose ``lr`` / ``lr_warmup_iters`` set each update's learning
            rate (default: leave the optimizer's learning rate alone).
        hf_config: the HF config the model was converted from (needed by :meth:`hf_named` and
            :meth:`save_hf`, i.e. for serving and saving the weights).

    Raises:
        ValueError: ``calculate_per_token_loss`` is off or ``finalize_model_grads_func`` is unset.
        NotImplementedError: TP > 1.
    """

    def __init__(self, model: torch.nn.Module, optimizer, objective: ObjectiveConfig | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, adam: AdamConfig | None = None, hf_config=None,
                 temperature: float = 1.0):
        from megatron.core.utils import get_model_config

        config = get_model_config(model)
        if not config.calculate_per_token_loss:
            raise ValueError("MegatronTrainStep needs TransformerConfig.calculate_per_token_loss=True "
                             "(set before wrap_ddp): 1/|E| is applied by finalize_model_grads")
        if config.finalize_model_grads_func is None:
            raise ValueError("config.finalize_model_grads_func is unset (use wrap_ddp)")
        self.model, self.optimizer, self.config = model, optimizer, config
        self.objective = objective or ObjectiveConfig()
        self.policy = MegatronPolicy(model, chunk_size, temperature=temperature)
        self.adam = adam
        self.hf_config = hf_config
        module = getattr(model, "module", model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        from gyre.training.megatron_model import apply_wd_mult

        apply_wd_mult(optimizer)  # idempotent; build_optimizer already applied it

    def num_updates(self) -> int:
        """Optimizer updates so far (:func:`optimizer_updates`; survives a checkpoint)."""
        return optimizer_updates(self.optimizer)

    def zero_grad(self) -> None:
        """Zero DDP's gradient buffers (``main_grad``) and drop the optimizer's ``.grad`` aliases."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def grad_tensors(self) -> list[torch.Tensor]:
        """Each parameter's accumulated gradient: DDP's ``main_grad`` (a view of its fp32 buffer)."""
        return [p.main_grad for p in self.params]

    def hf_named(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (shaped like :attr:`params`) converted to HF names and layout
        (:func:`gyre.training.checkpoint_conversion.megatron_to_hf`; a tied ``lm_head`` is left out).

        Raises:
            NotImplementedError: TP or PP > 1 inside the cell (the shards live on other ranks).
            ValueError: the step was built without ``hf_config``.
        """
        from megatron.core import parallel_state as ps

        from gyre.training.checkpoint_conversion import megatron_to_hf

        if self.hf_config is None:
            raise ValueError("MegatronTrainStep needs hf_config to name weights in HF layout")
        if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() != 1:
            raise NotImplementedError("hf_named gathers one shard only: TP = PP = 1 inside a cell")
        out = megatron_to_hf({(0, 0): dict(zip(self.param_names, tensors))}, self.hf_config)
        if self.hf_config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def save_hf(self, directory) -> None:
        """Write the weights as a servable HF checkpoint (``config.json`` + ``model.safetensors``)."""
        from pathlib import Path

        from safetensors.torch import save_file

        Path(directory).mkdir(parents=True, exist_ok=True)
        self.hf_config.save_pretrained(directory)
        named = self.hf_named([p.detach() for p in self.params])
        save_file({k: v.contiguous() for k, v in named.items()}, str(Path(directory) / "model.safetensors"),
                  metadata={"format": "pt"})

    def forward_step(self, data_iterator, model):
        """Megatron ``forward_step_func`` for one micro-step (the separable per-micro-step part).

        Takes the next :class:`MicroStepBatch` from ``data_iterator``, returns ``(logits,
        loss_func)``; ``loss_func(logits)`` returns the 3-tuple ``(loss_sum, normaliser (int
        tensor), {"stats": ObjectiveStats})`` that ``calculate_per_token_loss`` expects.
        """
        batch = next(data_iterator)
        logits = self.policy.logits(model, batch)

        def loss_func(output):
            lp, ent = self.policy.target_logprobs(output, batch)
            out = execution_objective(lp, batch.objective_inputs, self.objective, ent)
            return out.loss_sum, torch.tensor(out.normaliser, dtype=torch.int), {"stats": out.stats}

        return logits, loss_func

    def _forward_only_step(self, data_iterator, model):
        batch = next(data_iterator)
        logits = self.policy.logits(model, batch)

        def loss_func(output):
            lp, _ = self.policy.target_logprobs(output, batch)
            return torch.zeros(()), torch.tensor(0, dtype=torch.int), {"lp": lp.detach(), "batch": batch}

        return logits, loss_func

    def _run(self, step_func, micro_steps, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = [MicroStepBatch.from_micro_step(ms) for ms in micro_steps]
        shapes = [b.input_ids.shape for b in batches]
        return get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=iter(batches), model=[self.model],
            num_microbatches=len(batches), seq_length=max(s for _, s in shapes),
            micro_batch_size=max(b for b, _ in shapes), forward_only=forward_only)

    def precompute_log_ratio_sums(self, micro_steps: Sequence[MicroStep]) -> tuple[dict[str, float], int]:
        """:func:`precompute_log_ratio_sums` through the schedule (``forward_only=True``)."""
        todo = [ms for ms in micro_steps if ms.split.any()]
        if not todo:
            return {}, 0
        sums: dict[str, float] = {}
        for rec in self._run(self._forward_only_step, todo, forward_only=True):
            batch: MicroStepBatch = rec["batch"]
            ms = batch.micro_step
            inp = batch.objective_inputs
            per = torch.zeros(len(ms.execution_ids), dtype=torch.float64).index_add_(
                0, inp.target_execution, rec["lp"].double() - inp.behaviour_logprobs.double())
            for e in np.flatnonzero(ms.split):
                sums[ms.execution_ids[e]] = sums.get(ms.execution_ids[e], 0.0) + float(per[e])
        return sums, sum(ms.forward_tokens for ms in todo)

    def forward_backward(self, micro_steps: Sequence[MicroStep], finalize: bool = True) -> tuple[int, ObjectiveStats]:
        """Forward/backward of ``micro_steps`` through the schedule; ``finalize_model_grads`` then
        all-reduces the gradients and the normaliser over data parallelism and divides the gradients
        by it (``1/|E|`` once). No optimizer update. Returns ``(normaliser, stats)`` of these
        micro-steps (this rank's share). Split executions need ``log_ratio_sum`` first.

        ``finalize=False`` skips ``finalize_model_grads``: the un-normalised per-token-weighted
        gradients stay in ``main_grad`` and nothing is reduced (a streaming cell sums them over its
        prefix group itself, DESIGN.md §4.4)."""
        stats = ObjectiveStats()
        if micro_steps:
            saved = self.config.finalize_model_grads_func
            if not finalize:
                self.config.finalize_model_grads_func = None
            try:
                for rec in self._run(self.forward_step, micro_steps, forward_only=False):
                    stats.merge(rec["stats"])
            finally:
                self.config.finalize_model_grads_func = saved
        return stats.normaliser, stats

    def accumulate(self, micro_steps: Sequence[MicroStep]) -> tuple[int, ObjectiveStats]:
        """:meth:`forward_backward` with ``finalize=False`` (the streaming cell's micro-step)."""
        return self.forward_backward(micro_steps, finalize=False)

    def optimizer_step(self, normaliser: int | None = None) -> float:
        """Clip and one Adam update (Megatron optimizer); returns the grad norm before clipping.

        ``normaliser``: divide ``main_grad`` by it first (``|E|``, when the gradients were
        accumulated with ``finalize=False``); ``None``: ``finalize_model_grads`` already did."""
        if normaliser is not None and normaliser > 0:
            with torch.no_grad():
                for g in self.grad_tensors():
                    g.div_(normaliser)
        if self.adam is not None:
            self.adam.set_lr(self.optimizer, self.num_updates())
        _ok, grad_norm, _zeros = self.optimizer.step()
        return float(grad_norm) if grad_norm is not None else math.nan

    def __call__(self, micro_steps: Sequence[MicroStep]) -> StepResult:
        """One step: forward-only pass for split executions, forward/backward of every
        micro-step (gradients divided by ``|E|`` in ``finalize_model_grads``), one update."""
        t0 = time.perf_counter()
        self.zero_grad()
        sums, pass_tokens = self.precompute_log_ratio_sums(micro_steps)
        apply_log_ratio_sums(micro_steps, sums)
        _, stats = self.forward_backward(micro_steps)
        grad_norm = self.optimizer_step()
        return _result(stats, grad_norm, micro_steps, pass_tokens, time.perf_counter() - t0)


def build_megatron_train_step(hf_model: torch.nn.Module, objective: ObjectiveConfig | None = None,
                              adam: AdamConfig | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                              bf16: bool = False, temperature: float = 1.0) -> MegatronTrainStep:
    """Megatron ``GPTModel`` holding ``hf_model``'s weights, DDP, optimizer -> :class:`MegatronTrainStep`.

    Call :func:`gyre.training.megatron_model.initialize_megatron_cpu` (or the GPU equivalent)
    first. Sets ``calculate_per_token_loss=True`` before the DDP wrap.
    """
    from megatron.core import parallel_state as ps

    from gyre.training.checkpoint_conversion import hf_to_megatron, load_into_megatron
    from gyre.training.megatron_model import build_gpt_model, build_optimizer, transformer_config_from_hf, wrap_ddp

    adam = adam or AdamConfig()
    cfg = hf_model.config
    tcfg = transformer_config_from_hf(cfg, calculate_per_token_loss=True, bf16=bf16)
    model = build_gpt_model(cfg, tcfg)
    load_into_megatron(model, hf_to_megatron(
        hf_model.state_dict(), cfg, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()))
    ddp = wrap_ddp(model, tcfg)
    opt = build_optimizer(ddp, lr=adam.lr, weight_decay=adam.weight_decay, adam_beta1=adam.adam_beta1,
                          adam_beta2=adam.adam_beta2, adam_eps=adam.adam_eps, clip_grad=adam.clip_grad, bf16=bf16)
    return MegatronTrainStep(ddp, opt, objective, chunk_size, adam, hf_config=cfg, temperature=temperature)


def build_train_step(args: argparse.Namespace, hf_model: torch.nn.Module) -> HFTrainStep | MegatronTrainStep:
    """The training step the arguments ask for, holding ``hf_model``'s weights.

    Reads ``--training-backend`` (``hf``: trains ``hf_model`` in place; ``megatron``: a converted
    ``GPTModel``, call ``initialize_megatron_cpu`` first), the objective flags
    (:meth:`ObjectiveConfig.from_args`), the optimizer flags (:meth:`AdamConfig.from_args`),
    ``--logprob-chunk-size``, ``--rollout-temperature`` (the trained log-probs are those of the
    tempered distribution the engine sampled from) and ``--bf16`` (Megatron only; not exercised
    on CPU).
    """
    objective = ObjectiveConfig.from_args(args)
    adam = AdamConfig.from_args(args)
    chunk = int(getattr(args, "logprob_chunk_size", DEFAULT_CHUNK_SIZE))
    temperature = float(getattr(args, "rollout_temperature", 1.0))
    if getattr(args, "training_backend", "megatron") == "hf":
        return HFTrainStep(hf_model, objective, adam, chunk, temperature=temperature)
    return build_megatron_train_step(hf_model, objective, adam, chunk, bf16=bool(getattr(args, "bf16", False)),
                                     temperature=temperature)
