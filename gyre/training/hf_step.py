"""Training step on a ``transformers`` causal LM with ``torch.optim.AdamW`` (the reference backend).

:class:`HFPolicy` gives the targets' log-probs: the decoder body runs with the micro-step's position
ids and packed/tree attention mask, and the hidden states are projected onto the vocabulary chunk
by chunk (never ``[T, V]``), so packed, padded and tree-packed micro-steps give the same numbers
as one row at a time. :class:`HFTrainStep` accumulates gradients in ``.grad`` and performs the
update (:class:`~gyre.training.step.TrainStep`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gyre.buffer.packing import MicroStep
from gyre.rl.objective import ObjectiveConfig, ObjectiveStats
from gyre.training.logprobs import DEFAULT_CHUNK_SIZE, target_logprobs_from_hidden
from gyre.training.step import (AdamConfig, MicroStepBatch, TrainStep, checked_temperature, micro_step_loss,
                                precompute_log_ratio_sums)

__all__ = ["HFPolicy", "HFTrainStep", "build_hf_optimizer"]


class HFPolicy:
    """Target log-probs from a ``transformers`` causal LM (``Qwen3ForCausalLM`` and alikes).

    Runs the decoder body (``model.model``) with the micro-step's position ids and a 4-D mask
    (``[b, 1, s, s]``, boolean for sdpa, additive otherwise; transformers uses a 4-D mask as
    given), then :func:`~gyre.training.logprobs.target_logprobs_from_hidden` with the output
    embedding. Assumes no logit soft-capping or scaling (true for Qwen2/Qwen3).

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
        self.temperature = checked_temperature(temperature)

    def __call__(self, batch: MicroStepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [N], entropy [N] or None)`` of the batch's targets."""
        body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        weight = self.model.get_output_embeddings().weight
        if batch.attention_allowed is None:
            mask = None  # plain causal: the causal kernel, no explicit mask
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


class HFTrainStep(TrainStep):
    """Training step on a ``transformers`` model.

    Args:
        model: causal LM (trained in place).
        objective: :class:`~gyre.rl.objective.ObjectiveConfig`.
        adam: :class:`~gyre.training.step.AdamConfig` (ignored when ``optimizer`` is given).
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
        """Drop every ``.grad``."""
        self.optimizer.zero_grad(set_to_none=True)

    def precompute_log_ratio_sums(self, micro_steps: Sequence[MicroStep]) -> tuple[dict[str, float], int]:
        """:func:`~gyre.training.step.precompute_log_ratio_sums` with this step's policy."""
        return precompute_log_ratio_sums(self.policy, micro_steps, self.params[0].device)

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

        Split executions must already have ``log_ratio_sum``
        (:func:`~gyre.training.step.precompute_log_ratio_sums`). Returns ``(normaliser, stats)``
        summed over the micro-steps.
        """
        stats = ObjectiveStats()
        for ms in micro_steps:
            batch = MicroStepBatch.from_micro_step(ms, self.params[0].device)
            out = micro_step_loss(self.policy, batch, self.objective)
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

    def _accumulate_and_update(self, micro_steps: Sequence[MicroStep]) -> tuple[float, ObjectiveStats]:
        normaliser, stats = self.forward_backward(micro_steps)
        return self.optimizer_step(normaliser), stats
