"""Log-probs (and entropy) of the target tokens only, in chunks over the targets.

With a 151k vocabulary a 2k-token row's full fp32 ``log_softmax`` is 1.2 GB, so the trainer never
materialises ``[T, V]`` log-probs. Both functions take the positions that predict a target
(``index``) and the target ids and process ``chunk_size`` targets at a time: gather the rows,
``logsumexp`` over the vocabulary, pick the target logit. Backward recomputes each chunk's softmax
from the saved ``logsumexp``, so the extra memory is ``chunk_size x V`` whatever the row length
(the "fused linear cross-entropy" trick). :func:`target_logprobs_from_hidden` (HF) forms the
logits from the final hidden states chunk by chunk; :func:`target_logprobs_from_logits`
(Megatron, whose ``GPTModel`` returns logits) avoids the second ``[N, V]`` copy of
``log_softmax(...).gather(...)``. With tensor parallelism the Megatron logits are vocabulary
shards: given the tensor-parallel ``group``, :func:`target_logprobs_from_logits` all-reduces, per
chunk, the max over the vocabulary (MAX), then the sum of ``exp``, the target logit (taken on the
rank whose shard holds it) and the entropy's ``sum p * z`` (one SUM), so every rank gets the
log-probs and entropy of the full distribution; the backward needs no communication (each rank's
logits gradient is ``onehot - softmax`` restricted to its shard). Numbers equal
``torch.log_softmax(logits, -1).gather(-1, targets)`` to float rounding; arithmetic is in fp32
(bf16 inputs are upcast per chunk) or fp64 for fp64 inputs.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_CHUNK_SIZE", "target_logprobs_from_hidden", "target_logprobs_from_logits"]

#: Targets per chunk: ``chunk_size x V`` floats are live at once (1024 x 151936 x 4 B = 622 MB).
DEFAULT_CHUNK_SIZE = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_stats(z: torch.Tensor, tgt: torch.Tensor, want_entropy: bool):
    """``z [c, V]`` logits -> (target log-prob [c], logsumexp [c], entropy [c] or None)."""
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(1, tgt[:, None]).squeeze(1) - lse
    ent = None
    if want_entropy:
        p = torch.exp(z - lse[:, None])
        ent = lse - (p * z).sum(-1)
    return lp, lse, ent


def _shard_stats(z: torch.Tensor, tgt: torch.Tensor, want_entropy: bool, group, vocab_start: int):
    """``z [c, V/tp]`` (this rank's vocabulary shard, ids ``vocab_start..``) -> the full
    distribution's (target log-prob [c], logsumexp [c], entropy [c] or None), all-reduced over
    ``group``."""
    import torch.distributed as dist

    m = z.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    local = tgt - vocab_start
    here = (local >= 0) & (local < z.shape[1])
    sums = torch.zeros(3 if want_entropy else 2, z.shape[0], dtype=z.dtype, device=z.device)
    sums[0] = torch.exp(z - m[:, None]).sum(-1)
    sums[1] = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1) * here
    if want_entropy:  # sum_v exp(z_v - m) * z_v; divided by the global sum below
        sums[2] = (torch.exp(z - m[:, None]) * z).sum(-1)
    dist.all_reduce(sums, group=group)
    lse = m + torch.log(sums[0])
    ent = lse - sums[2] / sums[0] if want_entropy else None
    return sums[1] - lse, lse, ent


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, index, targets, chunk_size, want_entropy, group, vocab_start):
        cdt = _compute_dtype(logits.dtype)
        n = index.shape[0]
        lp = torch.empty(n, dtype=cdt, device=logits.device)
        lse = torch.empty(n, dtype=cdt, device=logits.device)
        ent = torch.empty(n if want_entropy else 0, dtype=cdt, device=logits.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = logits.index_select(0, index[s:e]).to(cdt)
            if group is None:
                a, b, c = _chunk_stats(z, targets[s:e], want_entropy)
            else:
                a, b, c = _shard_stats(z, targets[s:e], want_entropy, group, vocab_start)
            lp[s:e], lse[s:e] = a, b
            if want_entropy:
                ent[s:e] = c
        ctx.save_for_backward(logits, index, targets, lse)
        ctx.chunk_size, ctx.vocab_start = chunk_size, vocab_start
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        logits, index, targets, lse = ctx.saved_tensors
        grad_logits = None
        if ctx.needs_input_grad[0]:
            cdt = lse.dtype
            grad_logits = torch.zeros(logits.shape, dtype=cdt, device=logits.device)
            n, width = index.shape[0], logits.shape[1]
            for s in range(0, n, ctx.chunk_size):
                e = min(s + ctx.chunk_size, n)
                z = logits.index_select(0, index[s:e]).to(cdt)
                g = grad_lp[s:e].to(cdt)
                dz = -torch.exp(z - lse[s:e, None]) * g[:, None]
                local = targets[s:e] - ctx.vocab_start
                here = (local >= 0) & (local < width)
                dz.scatter_add_(1, local.clamp(0, width - 1)[:, None], (g * here)[:, None])
                grad_logits.index_add_(0, index[s:e], dz)
            grad_logits = grad_logits.to(logits.dtype)
        return grad_logits, None, None, None, None, None, None


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, want_entropy):
        cdt = _compute_dtype(hidden.dtype)
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=cdt, device=hidden.device)
        lse = torch.empty(n, dtype=cdt, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=cdt, device=hidden.device)
        w = weight.to(cdt)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = hidden[s:e].to(cdt) @ w.t()
            a, b, c = _chunk_stats(z, targets[s:e], want_entropy)
            lp[s:e], lse[s:e] = a, b
            if want_entropy:
                ent[s:e] = c
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        cdt = lse.dtype
        w = weight.to(cdt)
        n = hidden.shape[0]
        grad_h = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h = hidden[s:e].to(cdt)
            z = h @ w.t()
            g = grad_lp[s:e].to(cdt)
            dz = -torch.exp(z - lse[s:e, None]) * g[:, None]
            dz.scatter_add_(1, targets[s:e, None], g[:, None])
            if grad_h is not None:
                grad_h[s:e] = dz @ w
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h)
        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype), None, None, None)


def _check(index: torch.Tensor, targets: torch.Tensor, rows: int, vocab: int, chunk_size: int) -> None:
    if index.ndim != 1 or targets.ndim != 1 or index.shape != targets.shape:
        raise ValueError(f"index and targets must be 1-D of equal length, got {tuple(index.shape)} "
                         f"and {tuple(targets.shape)}")
    if index.dtype != torch.int64 or targets.dtype != torch.int64:
        raise ValueError("index and targets must be int64")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if index.numel():
        if int(index.min()) < 0 or int(index.max()) >= rows:
            raise ValueError(f"index out of range [0, {rows})")
        if int(targets.min()) < 0 or int(targets.max()) >= vocab:
            raise ValueError(f"target id out of range [0, {vocab})")


def target_logprobs_from_logits(
    logits: torch.Tensor,
    index: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` under the softmax of ``logits[index]``, chunked.

    Args:
        logits: ``[M, V]`` (any float dtype; flatten ``[b, s, V]`` to ``[b*s, V]`` first), or
            with ``group`` this rank's vocabulary shard ``[M, V / |group|]`` holding the ids
            ``rank * V/|group| ..`` (Megatron's contiguous vocab-parallel split).
        index: ``int64 [N]`` rows of ``logits`` that predict each target (position ``t - 1``
            for token ``t``); repeats allowed; the same on every rank of ``group``.
        targets: ``int64 [N]`` vocabulary ids (of the full vocabulary).
        chunk_size: targets per chunk (peak extra memory ``chunk_size x V``).
        with_entropy: also return the entropy of each predicting distribution (nats, no grad).
        group: the tensor-parallel process group over which the vocabulary is split; ``None``:
            ``logits`` hold the whole vocabulary. Every rank of ``group`` must call with the same
            ``index``, ``targets``, ``chunk_size`` and ``with_entropy`` (collectives per chunk).

    Returns:
        ``(logprobs [N], entropy [N] or None)`` of the full distribution, fp32 (fp64 for fp64
        input), the same on every rank of ``group``; ``logprobs`` is differentiable w.r.t.
        ``logits`` (this rank's shard).

    Raises:
        ValueError: bad shapes/dtypes, out-of-range ``index`` or ``targets``, ``chunk_size < 1``.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [M, V], got {tuple(logits.shape)}")
    vocab_start, vocab = 0, logits.shape[1]
    if group is not None:
        import torch.distributed as dist

        vocab_start, vocab = dist.get_rank(group) * logits.shape[1], dist.get_world_size(group) * logits.shape[1]
    _check(index, targets, logits.shape[0], vocab, chunk_size)
    lp, ent = _FromLogits.apply(logits, index, targets, chunk_size, with_entropy, group, vocab_start)
    return lp, (ent if with_entropy else None)


def target_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(hidden[index] @ weight.T)``, never forming ``[M, V]``.

    Args:
        hidden: ``[M, h]`` final hidden states (after the final norm).
        weight: ``[V, h]`` output-layer (``lm_head``) weight; no bias, no logit scaling.
        index, targets, chunk_size, with_entropy: as in :func:`target_logprobs_from_logits`.

    Returns:
        ``(logprobs [N], entropy [N] or None)``; ``logprobs`` is differentiable w.r.t.
        ``hidden`` and ``weight``.

    Raises:
        ValueError: bad shapes/dtypes, out-of-range ``index`` or ``targets``, ``chunk_size < 1``.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [M, h] and weight [V, h] expected, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    _check(index, targets, hidden.shape[0], weight.shape[0], chunk_size)
    h = hidden.index_select(0, index)
    lp, ent = _FromHidden.apply(h, weight, targets, chunk_size, with_entropy)
    return lp, (ent if with_entropy else None)
