"""A megatron-core ``GPTModel`` as a policy: target log-probs of a micro-step (:mod:`gyre.training.megatron_step`).

:class:`MegatronPolicy` runs the model (logits ``[b, s, V]``, RoPE at the micro-step's position
ids through :class:`RotaryPositions`, the packed/tree attention mask) and gathers the targets'
log-probs chunk by chunk; at TP > 1 the logits are vocabulary shards and the target log-probs and
entropy are all-reduced over the TP group (:func:`gyre.training.logprobs.target_logprobs_from_logits`).
"""

from __future__ import annotations

import torch

from gyre.training.logprobs import DEFAULT_CHUNK_SIZE, target_logprobs_from_logits
from gyre.training.megatron_model import causal_attention_mask
from gyre.training.step import MicroStepBatch, checked_temperature

__all__ = ["MegatronPolicy", "RotaryPositions", "unwrap_model"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``model``'s wrappers (DDP, ...)."""
    while hasattr(model, "module"):
        model = model.module
    return model


class RotaryPositions:
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
    def install(cls, gpt_model: torch.nn.Module) -> "RotaryPositions":
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

    ``logits(model, batch)`` runs the model (``[b, s, V / TP]`` logits, this rank's vocabulary
    shard, no labels) with the micro-step's mask (complement of ``attention_allowed``; with
    :class:`~gyre.training.attention.FusedCoreAttention` in the model, no mask for causal rows and a
    FlexAttention block mask from the batch's ``tree`` intervals) and RoPE at the micro-step's
    position ids; ``target_logprobs(logits, batch)`` gathers the targets chunk by
    chunk, all-reducing over the TP group when TP > 1 (every TP rank gets the full distribution's
    log-probs and entropy). ``temperature``: as :class:`~gyre.training.hf_step.HFPolicy`; the
    logits are divided by it in place (a ``[b, s, V]`` copy would double the largest tensor of the
    step; the output layer's backward does not need its output).

    Raises:
        ValueError: ``temperature <= 0``.
    """

    def __init__(self, model: torch.nn.Module, chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = True,
                 temperature: float = 1.0):
        from megatron.core import parallel_state as ps

        self.temperature = checked_temperature(temperature)
        self.tp_group = None
        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
            self.tp_group = ps.get_tensor_model_parallel_group()
        self.model = model
        self.gpt = unwrap_model(model)
        self.rope = RotaryPositions.install(self.gpt)
        self.chunk_size = chunk_size
        self.with_entropy = with_entropy
        from gyre.training.attention import FusedCoreAttention

        self.fused = any(isinstance(m, FusedCoreAttention) for m in model.modules())

    def logits(self, model: torch.nn.Module, batch: MicroStepBatch) -> torch.Tensor:
        """``[b, s, V]`` logits of ``model`` (the wrapped or bare GPTModel) for ``batch``."""
        allowed = batch.attention_allowed
        if batch.tree is not None:
            from gyre.training.attention import tree_block_mask

            mask = tree_block_mask(*batch.tree)
        elif allowed is not None:
            mask = ~allowed
        else:  # plain causal: the fused kernel needs no mask at all
            mask = None if self.fused else causal_attention_mask(batch.input_ids.shape[1], batch.input_ids.device)
        self.rope.positions = batch.position_ids
        try:
            return model(batch.input_ids, batch.position_ids, mask)
        finally:
            self.rope.positions = None

    def target_logprobs(self, logits: torch.Tensor, batch: MicroStepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [N], entropy [N] or None)`` from ``logits [b, s, V / TP]`` (collective over
        the TP group when TP > 1)."""
        if self.temperature != 1.0:
            logits = logits.div_(self.temperature)
        return target_logprobs_from_logits(logits.reshape(-1, logits.shape[-1]), batch.target_index,
                                           batch.target_ids, self.chunk_size, self.with_entropy, group=self.tp_group)

    def __call__(self, batch: MicroStepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both steps on ``self.model``."""
        return self.target_logprobs(self.logits(self.model, batch), batch)
