"""Core attention of the Megatron replica without a dense ``[s, s]`` mask (``--attention-kernel fused``).

Rows are 10k-100k+ tokens, so a ``[b, 1, s, s]`` mask (and the ``[b, heads, s, s]`` scores that
Megatron's ``DotProductAttention`` builds) does not fit.  :class:`FusedCoreAttention` takes the
place of ``DotProductAttention`` in the layer spec (:func:`fused_layer_spec`) and picks a kernel by
what the micro-step needs:

* ``attention_mask is None`` (plain causal rows): ``scaled_dot_product_attention(is_causal=True)``
  (flash / memory-efficient kernels on GPU);
* a FlexAttention ``BlockMask`` (a tree-packed micro-step): ``flex_attention`` with the mask
  :func:`tree_block_mask` builds from :meth:`gyre.buffer.packing.MicroStep.ancestor_intervals` --
  two ``int64 [b, s]`` tensors, never a dense mask;
* a dense boolean mask (``True`` = masked, Megatron's convention): SDPA with that mask.

FlexAttention has no backward on CPU, so the CPU main job keeps the dense path (``dense``); on CPU
this module is checked forward-only against it.  On GPU, ``flex_attention`` and the block mask are
compiled (``torch.compile``) so that neither materialises ``[s, s]``; that path has not run here.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F

from gyre.training.megatron_import import import_megatron_core

import_megatron_core()  # before megatron's own modules: its import-time torch.compile deferred
from megatron.core.transformer.module import MegatronModule  # noqa: E402


def tree_block_mask(enter: torch.Tensor, exit_: torch.Tensor):
    """The FlexAttention ``BlockMask`` of a tree-packed micro-step: query ``q`` sees key ``k`` iff
    ``enter[k] <= enter[q] <= exit[k]`` (same row).  Compiled on CUDA (no ``[s, s]`` tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q, k):
        return (enter[b, k] <= enter[b, q]) & (enter[b, q] <= exit_[b, k])

    b, s = enter.shape
    return create_block_mask(visible, B=b, H=None, Q_LEN=s, KV_LEN=s, device=enter.device,
                             _compile=enter.device.type == "cuda")


_compiled_flex: Any = None


def _flex(q, k, v, block_mask, scale):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale)


class FusedCoreAttention(MegatronModule):
    """Megatron core attention (the constructor and ``forward`` of ``DotProductAttention``) with
    fused kernels; see the module docstring.  Query ``[sq, b, heads/TP, d]``, key and value
    ``[sk, b, groups/TP, d]``; returns ``[sq, b, heads/TP * d]``."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("FusedCoreAttention takes no attention bias and no packed-sequence parameters")
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        if self.groups != self.heads:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        elif isinstance(attention_mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.scale)
        else:
            out = _flex(q, k, v, attention_mask, self.scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)


def fused_layer_spec(spec):
    """A copy of a Megatron local GPT layer spec whose core attention is :class:`FusedCoreAttention`."""
    out = copy.deepcopy(spec)
    out.submodules.self_attention.submodules.core_attention = FusedCoreAttention
    return out
