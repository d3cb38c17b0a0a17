"""Convert Qwen3 and Llama weights between HF (``transformers``) and Megatron ``GPTModel`` state dicts.

Megatron layout (local spec, ``megatron/core/models/gpt``), per TP rank ``r`` of ``T`` and PP
stage ``p`` of ``P`` (``L/P`` layers each, numbered locally from 0):

* ``embedding.word_embeddings.weight`` ``[V/T, h]``: vocabulary rows ``r*V/T ..``; tied output.
* ``self_attention.linear_qkv.weight`` ``[(g/T) * (q/g + 2) * d, h]``: for each of this rank's
  query groups, its ``q/g`` query heads, then its key head, then its value head (``d`` rows each).
* ``self_attention.linear_qkv.bias`` ``[(g/T) * (q/g + 2) * d]`` (``add_qkv_bias``, the HF
  ``q_proj``/``k_proj``/``v_proj`` biases): the same order as the weight's rows.  A HF config with
  ``attention_bias`` also gives ``o_proj`` a bias, which Megatron's ``linear_proj`` does not have:
  it converts to HF as zeros, and a non-zero one is refused.
* ``self_attention.linear_proj.weight`` ``[h, q*d/T]`` (column shard of ``o_proj``).
* ``mlp.linear_fc1.weight`` ``[2*f/T, h]``: ``[gate_r; up_r]`` (SwiGLU halves of this rank).
* ``mlp.linear_fc2.weight`` ``[h, f/T]``; norms (``input_layernorm``, ``pre_mlp_layernorm``,
  ``q_layernorm``, ``k_layernorm`` ``[d]`` (Qwen3's per-head q/k norm; a Llama has none, see
  :func:`has_qk_norm`), ``decoder.final_layernorm``) replicated.

Both directions are exact permutations/slices (no arithmetic), so logits agree to float rounding.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_QK_NORMS = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
#: HF model types whose attention normalises each query and key head (RMSNorm over ``head_dim``).
QK_NORM_MODEL_TYPES = ("qwen3",)


def has_qk_norm(cfg: Any) -> bool:
    """Whether the HF config's architecture has per-head q/k norms (Qwen3: yes; Llama: no)."""
    return getattr(cfg, "model_type", None) in QK_NORM_MODEL_TYPES


def _norms(cfg: Any) -> dict[str, str]:
    return {**_NORMS, **_QK_NORMS} if has_qk_norm(cfg) else _NORMS


def _dims(cfg: Any) -> tuple[int, int, int, int]:
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, groups, d, cfg.hidden_size


def check_parallel_sizes(cfg: Any, tp_size: int, pp_size: int) -> None:
    """Raise ``ValueError`` unless the model of ``cfg`` splits into ``tp_size`` x ``pp_size`` shards
    (heads, KV heads, FFN and vocabulary by TP; layers by PP)."""
    heads, groups, _, _ = _dims(cfg)
    for what, n, k in (("num_key_value_heads", groups, tp_size), ("num_attention_heads", heads, tp_size),
                       ("intermediate_size", cfg.intermediate_size, tp_size),
                       ("vocab_size", cfg.vocab_size, tp_size), ("num_hidden_layers", cfg.num_hidden_layers, pp_size)):
        if n % k:
            raise ValueError(f"{what}={n} is not divisible by {k}")


def hf_to_megatron(hf_sd: Mapping[str, torch.Tensor], cfg: Any, tp_rank: int = 0, tp_size: int = 1,
                   pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """Return the Megatron state dict of one (TP rank, PP stage) shard.

    Args:
        hf_sd: ``Qwen3ForCausalLM`` or ``LlamaForCausalLM`` state dict (``model.*`` / ``lm_head.weight`` keys).
        cfg: its HF config (``Qwen3Config`` or ``LlamaConfig``).
    Raises:
        ValueError: a dimension is not divisible by the parallel size, or an ``o_proj`` bias is
            not zero.
        KeyError: a HF tensor is missing.
    """
    check_parallel_sizes(cfg, tp_size, pp_size)
    heads, groups, d, h = _dims(cfg)
    qpg = heads // groups
    gl = groups // tp_size
    per_stage = cfg.num_hidden_layers // pp_size
    out: dict[str, torch.Tensor] = {}
    tied = bool(cfg.tie_word_embeddings)
    vshard = cfg.vocab_size // tp_size
    if pp_rank == 0:
        emb = hf_sd["model.embed_tokens.weight"]
        out["embedding.word_embeddings.weight"] = emb[tp_rank * vshard:(tp_rank + 1) * vshard].clone()
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = hf_sd["model.norm.weight"].clone()
        if not tied:
            out["output_layer.weight"] = hf_sd["lm_head.weight"][tp_rank * vshard:(tp_rank + 1) * vshard].clone()
        elif pp_size > 1:
            # Megatron keeps a copy of the tied embedding on the last stage (synced at init).
            emb = hf_sd["model.embed_tokens.weight"]
            out["output_layer.weight"] = emb[tp_rank * vshard:(tp_rank + 1) * vshard].clone()
    ffn_shard = cfg.intermediate_size // tp_size
    for local in range(per_stage):
        i = pp_rank * per_stage + local
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        q = hf_sd[src + "self_attn.q_proj.weight"].view(groups, qpg * d, h)
        k = hf_sd[src + "self_attn.k_proj.weight"].view(groups, d, h)
        v = hf_sd[src + "self_attn.v_proj.weight"].view(groups, d, h)
        qkv = torch.cat([q, k, v], dim=1)[tp_rank * gl:(tp_rank + 1) * gl]
        out[dst + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, h).clone()
        if src + "self_attn.q_proj.bias" in hf_sd:
            qb = hf_sd[src + "self_attn.q_proj.bias"].view(groups, qpg * d)
            kb = hf_sd[src + "self_attn.k_proj.bias"].view(groups, d)
            vb = hf_sd[src + "self_attn.v_proj.bias"].view(groups, d)
            qkv_b = torch.cat([qb, kb, vb], dim=1)[tp_rank * gl:(tp_rank + 1) * gl]
            out[dst + "self_attention.linear_qkv.bias"] = qkv_b.reshape(-1).clone()
        o_bias = hf_sd.get(src + "self_attn.o_proj.bias")
        if o_bias is not None and bool(o_bias.any()):
            raise ValueError(f"{src}self_attn.o_proj.bias is not zero: Megatron's linear_proj has no bias")
        o = hf_sd[src + "self_attn.o_proj.weight"]
        cols = heads * d // tp_size
        out[dst + "self_attention.linear_proj.weight"] = o[:, tp_rank * cols:(tp_rank + 1) * cols].clone()
        gate = hf_sd[src + "mlp.gate_proj.weight"][tp_rank * ffn_shard:(tp_rank + 1) * ffn_shard]
        up = hf_sd[src + "mlp.up_proj.weight"][tp_rank * ffn_shard:(tp_rank + 1) * ffn_shard]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0).clone()
        down = hf_sd[src + "mlp.down_proj.weight"]
        out[dst + "mlp.linear_fc2.weight"] = down[:, tp_rank * ffn_shard:(tp_rank + 1) * ffn_shard].clone()
        for hf_name, mg_name in _norms(cfg).items():
            out[dst + mg_name] = hf_sd[src + hf_name].clone()
    return out


def megatron_to_hf(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], cfg: Any) -> dict[str, torch.Tensor]:
    """Merge Megatron shards ``{(tp_rank, pp_rank): state_dict}`` back into one HF state dict.

    Raises:
        ValueError: the shard grid is incomplete.
        KeyError: a Megatron tensor is missing.
    """
    tp_size = 1 + max(t for t, _ in shards)
    pp_size = 1 + max(p for _, p in shards)
    if len(shards) != tp_size * pp_size:
        raise ValueError(f"expected {tp_size * pp_size} shards (TP={tp_size} x PP={pp_size}), got {len(shards)}")
    check_parallel_sizes(cfg, tp_size, pp_size)
    out: dict[str, torch.Tensor] = {}
    for unit, stage, prefix in megatron_units(cfg, pp_size):
        out.update(megatron_unit_to_hf(unit, [_strip(shards[(t, stage)], prefix) for t in range(tp_size)], cfg))
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def megatron_units(cfg: Any, pp_size: int = 1) -> list[tuple[tuple, int, str]]:
    """The model in conversion units, in HF order: ``(unit, pipeline stage holding it, prefix of
    its Megatron names on that stage)``; ``unit`` is ``("embedding",)``, ``("layer", i)`` (global
    layer ``i``) or ``("final",)`` (final norm and an untied output layer)."""
    per_stage = cfg.num_hidden_layers // pp_size
    units = [(("embedding",), 0, "embedding.")]
    units += [(("layer", p * per_stage + local), p, f"decoder.layers.{local}.")
              for p in range(pp_size) for local in range(per_stage)]
    return units + [(("final",), pp_size - 1, "")]


def unit_names(unit: tuple, names: Sequence[str], prefix: str) -> list[str]:
    """Those of ``names`` (one stage's Megatron names) that belong to ``unit`` (its ``prefix``)."""
    if unit[0] == "final":
        return [n for n in names if n in ("decoder.final_layernorm.weight", "output_layer.weight")]
    return [n for n in names if n.startswith(prefix)]


def _strip(sd: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def megatron_unit_to_hf(unit: tuple, pieces: Sequence[Mapping[str, torch.Tensor]], cfg: Any) -> dict[str, torch.Tensor]:
    """HF tensors of one conversion unit (:func:`megatron_units`) from its Megatron tensors on each
    TP rank (``pieces[t]``, names without the unit's prefix).  A tied ``lm_head`` is left out; with
    ``add_qkv_bias`` the q/k/v biases are split like the weights' rows, and a config with
    ``attention_bias`` gets a zero ``o_proj`` bias.

    Raises:
        KeyError: a Megatron tensor is missing.
    """
    tp_size = len(pieces)
    heads, groups, d, h = _dims(cfg)
    qpg = heads // groups
    gl = groups // tp_size

    def cat(key: str, dim: int) -> torch.Tensor:
        return torch.cat([p[key] for p in pieces], dim=dim)

    if unit[0] == "embedding":
        return {"model.embed_tokens.weight": cat("word_embeddings.weight", 0)}
    if unit[0] == "final":
        out = {"model.norm.weight": pieces[0]["decoder.final_layernorm.weight"].clone()}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = cat("output_layer.weight", 0)
        return out
    dst = f"model.layers.{unit[1]}."
    out = {}
    qkv = torch.cat([p["self_attention.linear_qkv.weight"].view(gl, (qpg + 2) * d, h) for p in pieces], dim=0)
    out[dst + "self_attn.q_proj.weight"] = qkv[:, : qpg * d].reshape(-1, h).clone()
    out[dst + "self_attn.k_proj.weight"] = qkv[:, qpg * d: (qpg + 1) * d].reshape(-1, h).clone()
    out[dst + "self_attn.v_proj.weight"] = qkv[:, (qpg + 1) * d:].reshape(-1, h).clone()
    if "self_attention.linear_qkv.bias" in pieces[0]:
        qkv_b = torch.cat([p["self_attention.linear_qkv.bias"].view(gl, (qpg + 2) * d) for p in pieces], dim=0)
        out[dst + "self_attn.q_proj.bias"] = qkv_b[:, : qpg * d].reshape(-1).clone()
        out[dst + "self_attn.k_proj.bias"] = qkv_b[:, qpg * d: (qpg + 1) * d].reshape(-1).clone()
        out[dst + "self_attn.v_proj.bias"] = qkv_b[:, (qpg + 1) * d:].reshape(-1).clone()
    if getattr(cfg, "attention_bias", False):  # HF's o_proj has a bias there; Megatron's linear_proj none
        w = pieces[0]["self_attention.linear_proj.weight"]
        out[dst + "self_attn.o_proj.bias"] = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    out[dst + "self_attn.o_proj.weight"] = cat("self_attention.linear_proj.weight", 1)
    fc1 = [p["mlp.linear_fc1.weight"].chunk(2, dim=0) for p in pieces]
    out[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1], dim=0)
    out[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1], dim=0)
    out[dst + "mlp.down_proj.weight"] = cat("mlp.linear_fc2.weight", 1)
    for hf_name, mg_name in _norms(cfg).items():
        out[dst + hf_name] = pieces[0][mg_name].clone()
    return out


def load_into_megatron(model: torch.nn.Module, shard: Mapping[str, torch.Tensor]) -> None:
    """Copy a converted shard into a (possibly DDP-wrapped) Megatron model; strict on tensors.

    Raises:
        KeyError: a parameter of the model has no tensor in ``shard`` or vice versa.
    """
    module = getattr(model, "module", model)
    params = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(params) - set(shard))
    unexpected = sorted(set(shard) - set(params))
    if missing or unexpected:
        raise KeyError(f"shard mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    with torch.no_grad():
        for k, v in params.items():
            v.copy_(shard[k])


def megatron_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors (no ``_extra_state``), detached clones on CPU."""
    module = getattr(model, "module", model)
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
