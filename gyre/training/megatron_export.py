"""A Megatron model's weights in HF names and layout, gathered over its model-parallel group
(:class:`~gyre.training.megatron_step.MegatronTrainStep`'s ``hf_named``/``hf_named_buckets``).

Each rank holds its tensor-parallel shard of its pipeline stage's parameters. :func:`gather_hf_named`
all-gathers the shards over the TP group and the stages over the pipeline group and converts the
whole (:func:`gyre.training.checkpoint_conversion.megatron_to_hf`) on every rank;
:func:`hf_buckets` converts one unit (the embedding, one layer, the final norm) at a time on the
group's first rank, so that no rank holds more than a bucket and a unit of the gathered model.
Both are collective over the model-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from gyre.training.checkpoint_conversion import megatron_to_hf, megatron_unit_to_hf, megatron_units, unit_names

__all__ = ["gather_hf_named", "hf_buckets"]


def gather_hf_named(param_names: Sequence[str], tensors: Sequence[torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """``tensors`` (this rank's, named ``param_names``) in HF names and layout; a tied ``lm_head``
    is left out. At TP > 1 each tensor is all-gathered over the TP group first, at PP > 1 the
    stages' shards over the pipeline group (every rank of the model-parallel group must call it,
    with its own shards); every rank returns the whole HF tensors."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    mine = {(0, stage): dict(zip(param_names, tensors))}
    if tp > 1:
        mine = {(t, stage): {} for t in range(tp)}
        for name, x in zip(param_names, tensors):
            parts = [torch.empty_like(x) for _ in range(tp)]
            dist.all_gather(parts, x.contiguous(), group=ps.get_tensor_model_parallel_group())
            for t in range(tp):
                mine[(t, stage)][name] = parts[t]
    shards = dict(mine)
    if pp > 1:
        stages: list = [None] * pp
        dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
        shards = {key: sd for got in stages for key, sd in got.items()}
    out = megatron_to_hf(shards, hf_config)
    if hf_config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _unit_on_owner(unit, prefix: str, mine: dict[str, torch.Tensor], tp: int, tp_rank: int, hf_config):
    """On the stage holding ``unit``: its tensors gathered over the TP group and converted to HF
    (on TP rank 0; ``None`` on the others)."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    pieces = [{} for _ in range(tp)]
    for name in unit_names(unit, list(mine), prefix):
        parts = [mine[name]] if tp == 1 else [torch.empty_like(mine[name]) for _ in range(tp)]
        if tp > 1:
            dist.all_gather(parts, mine[name].contiguous(), group=ps.get_tensor_model_parallel_group())
        for t in range(tp):
            pieces[t][name[len(prefix):]] = parts[t]
    return megatron_unit_to_hf(unit, pieces, hf_config) if tp_rank == 0 else None


def hf_buckets(param_names: Sequence[str], tensors: Sequence[torch.Tensor], hf_config,
               bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """``tensors`` (this rank's, named ``param_names``) in HF names and layout, in buckets of about
    ``bucket_bytes`` (a unit is never split), on the model-parallel group's first rank (TP rank 0 of
    the first stage); other ranks yield nothing. Each unit is all-gathered over the TP group of the
    stage holding it and, at PP > 1, sent from that stage to the first. Every rank must exhaust it."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    stage, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    mine = dict(zip(param_names, tensors))
    first = stage == 0 and tp_rank == 0
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for unit, owner, prefix in megatron_units(hf_config, pp):
        hf = _unit_on_owner(unit, prefix, mine, tp, tp_rank, hf_config) if stage == owner else None
        if pp > 1 and owner != 0 and tp_rank == 0:  # the stage holding it sends it to the first
            group = ps.get_pipeline_model_parallel_group()
            box = [hf]
            dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[owner], group=group)
            hf = box[0]
        if not first:
            continue
        for name, t in hf.items():
            bucket[name] = t
            size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if first and bucket:
        yield bucket
