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
  min-new-tokens penalizer); the masked logits choose the token.

The behaviour log-prob returned for a token is always *raw*: ``log_softmax(logits / T)`` at
that token over the full vocabulary, from the model's logits before any masking or truncation
(``T = 1`` for greedy rows), whatever processing (EOS masking, top-k, top-p, min-p) chose the
token. That is what the trainer computes (``log_softmax(logits / T)`` at the same weights), so
the two agree whenever the weights are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gyre.rollout.api.sglang_api import SamplingParams

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
) -> SampleResult:
    """Sample one token per row and return its raw behaviour log-prob (module docstring).

    Args:
        logits: ``[B, V]`` (any float dtype; computed in fp32).
        params: ``B`` sampling parameters.
        generators: ``B`` CPU ``torch.Generator`` (consumed only by non-greedy rows).
        banned: per row ids whose logits are set to ``-inf`` for the draw (``min_new_tokens``),
            or None; they do not change the returned log-probs.
        top_logprobs_num: per row how many top ``(logprob, id)`` pairs to return (0: none), from
            the same raw distribution.
    Returns:
        :class:`SampleResult` with ``B`` ids and their ``log_softmax(logits / T)`` values.
    Raises:
        ValueError: mismatched lengths.
    """
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows but {len(params)} params and {len(generators)} generators")
    logits = logits.float().cpu()  # the sampler draws from per-request CPU generators
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         dtype=logits.dtype)
    raw_logp = torch.log_softmax(logits / temps[:, None], dim=-1)  # what is returned
    masked = logits
    if banned is not None and any(banned):
        masked = logits.clone()
        for b, ids in enumerate(banned):
            if ids:
                masked[b, list(ids)] = float("-inf")
    logp = torch.log_softmax(masked / temps[:, None], dim=-1) if masked is not logits else raw_logp
    tokens = [0] * B
    # Greedy rows: argmax of the (masked) logits.
    greedy = [b for b, p in enumerate(params) if p.greedy]
    if greedy:
        picks = torch.argmax(masked[torch.tensor(greedy)], dim=-1)
        for b, t in zip(greedy, picks.tolist()):
            tokens[b] = t
    # Sampled rows: Gumbel-max over the (masked, truncated) log-probs: an exact draw from that
    # distribution; each row's uniforms come from its own generator, so a draw never depends
    # on the batch.
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = logp[torch.tensor(sampled)]
        for k, b in enumerate(sampled):
            p = params[b]
            if p.truncates:
                rows[k] = torch.log(truncate_probs(rows[k].exp(), p.top_k, p.top_p, p.min_p))
        u = torch.stack([torch.rand(rows.shape[1], generator=generators[b], dtype=rows.dtype) for b in sampled])
        gumbel = -torch.log(-torch.log(u))
        picks = torch.argmax(rows + gumbel, dim=-1)
        for b, t in zip(sampled, picks.tolist()):
            tokens[b] = t
    lps = [float(raw_logp[b, t]) for b, t in enumerate(tokens)]
    tops: list[list[tuple[float, int]] | None] = []
    for b in range(B):
        k = top_logprobs_num[b] if top_logprobs_num is not None else 0
        if k:
            vals, ids = torch.topk(raw_logp[b], min(k, raw_logp.shape[1]))
            tops.append([(float(v), int(i)) for v, i in zip(vals, ids)])
        else:
            tops.append(None)
    return SampleResult(tokens, lps, tops)
