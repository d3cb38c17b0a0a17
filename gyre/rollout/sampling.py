"""Next-token sampling and behaviour log-probs (pure torch maths, no engine state).

Semantics follow SGLang's sampler (``python/sglang/srt/layers/sampler.py`` and
``sampling/sampling_params.py``):

* ``temperature == 0`` is greedy: ``argmax(logits)``; its log-prob is ``log_softmax(logits)``
  (temperature 1), because SGLang rewrites greedy to ``top_k = 1, temperature = 1``.
* otherwise ``p = softmax(logits / temperature)``; top-k, top-p (the smallest prefix of the
  sorted distribution whose mass reaches ``top_p``) and min-p (drop tokens with
  ``p < min_p * p_max``) truncate ``p``, which is renormalised and sampled with the request's
  own ``torch.Generator`` by the Gumbel-max trick (``argmax(log p + G)``, ``G = -log(-log U)``):
  an exact draw from ``p`` that depends only on the request's own seed and position, never on
  the rest of the batch.
* ``min_new_tokens`` sets the stop ids' logits to ``-inf`` before all of the above (SGLang's
  min-new-tokens penalizer), so returned log-probs then come from those masked logits.

Which log-prob is returned is :func:`sample_next_tokens`'s ``logprob_mode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gyre.rollout.sglang_api import SamplingParams

LOGPROB_MODES = ("tempered", "truncated")


@dataclass(slots=True)
class SampleResult:
    """Sampled ids, their log-probs (natural log) and optional top-k ``(logprob, id)`` lists."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]] | None]


def truncate_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Apply top-k, top-p and min-p to one distribution and renormalise.

    Args:
        probs: ``[V]`` float probabilities summing to 1.
        top_k: ``-1`` (off) or ``>= 1``.
        top_p: ``(0, 1]``; a token is kept when the mass of strictly more probable tokens is
            below ``top_p`` (so the most probable token is always kept).
        min_p: ``[0, 1]``; keep tokens with ``p >= min_p * max(p)``.
    Returns:
        ``[V]`` renormalised probabilities with truncated entries exactly 0.
    """
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k != -1 and top_k < sorted_p.numel():
        keep[top_k:] = False
    if top_p < 1.0:
        mass_before = torch.cumsum(sorted_p, 0) - sorted_p
        keep &= mass_before < top_p
    if min_p > 0.0:
        keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs)
    out[order] = kept / kept.sum()
    return out


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    *,
    banned: Sequence[Sequence[int] | None] | None = None,
    top_logprobs_num: Sequence[int] | None = None,
    logprob_mode: str = "tempered",
) -> SampleResult:
    """Sample one token per row and return its behaviour log-prob.

    Args:
        logits: ``[B, V]`` (any float dtype; computed in fp32).
        params: ``B`` sampling parameters.
        generators: ``B`` CPU ``torch.Generator`` (consumed only by non-greedy rows).
        banned: per row ids whose logits are set to ``-inf`` first (``min_new_tokens``), or None.
        top_logprobs_num: per row how many top ``(logprob, id)`` pairs to return (0: none).
        logprob_mode: ``"tempered"``: ``log_softmax(logits / T)[token]``, the untruncated
            tempered distribution, from exactly the logits that were sampled from (a trainer
            computing ``log_softmax(logits / T)`` at the same weights reproduces it).  With
            top-k, top-p or min-p truncation the draw came from the truncated distribution, so
            this is then not its exact probability.  ``"truncated"``:
            ``log(p_truncated_renormalised[token])``, the exact probability of the draw.
    Returns:
        :class:`SampleResult` with ``B`` ids and log-probs.
    Raises:
        ValueError: unknown ``logprob_mode`` or mismatched lengths.
    """
    if logprob_mode not in LOGPROB_MODES:
        raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}, got {logprob_mode!r}")
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows but {len(params)} params and {len(generators)} generators")
    logits = logits.float()
    if banned is not None and any(banned):
        logits = logits.clone()
        for b, ids in enumerate(banned):
            if ids:
                logits[b, list(ids)] = float("-inf")
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         dtype=logits.dtype)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = [0] * B
    lps = [0.0] * B
    # Greedy rows: argmax of the (masked) logits.
    greedy = [b for b, p in enumerate(params) if p.greedy]
    if greedy:
        idx = torch.tensor(greedy)
        picks = torch.argmax(logits[idx], dim=-1)
        vals = logp[idx, picks].tolist() if logprob_mode == "tempered" else [0.0] * len(greedy)
        for b, t, v in zip(greedy, picks.tolist(), vals):
            tokens[b], lps[b] = t, v
    # Sampled rows: Gumbel-max over log-probs (exact draw from the (truncated) distribution);
    # each row's uniforms come from its own generator, so a draw never depends on the batch.
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if sampled:
        idx = torch.tensor(sampled)
        rows = logp[idx]
        trunc_rows = {}
        for k, b in enumerate(sampled):
            p = params[b]
            if p.truncates:
                trunc = truncate_probs(rows[k].exp(), p.top_k, p.top_p, p.min_p)
                trunc_rows[b] = trunc
                rows[k] = torch.log(trunc)
        u = torch.stack([torch.rand(rows.shape[1], generator=generators[b], dtype=rows.dtype) for b in sampled])
        gumbel = -torch.log(-torch.log(u))
        picks = torch.argmax(rows + gumbel, dim=-1)
        vals = logp[idx, picks].tolist()
        for b, t, v in zip(sampled, picks.tolist(), vals):
            tokens[b] = t
            lps[b] = float(torch.log(trunc_rows[b][t])) if logprob_mode == "truncated" and b in trunc_rows else v
    tops: list[list[tuple[float, int]] | None] = []
    for b in range(B):
        k = top_logprobs_num[b] if top_logprobs_num is not None else 0
        if k:
            vals, ids = torch.topk(logp[b], min(k, logp.shape[1]))
            tops.append([(float(v), int(i)) for v, i in zip(vals, ids)])
        else:
            tops.append(None)
    return SampleResult(tokens, lps, tops)
