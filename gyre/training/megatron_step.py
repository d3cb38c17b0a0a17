"""Training step on a megatron-core ``GPTModel`` in Megatron DDP with Megatron's optimizer.

:class:`~gyre.training.megatron_policy.MegatronPolicy` (imported here) runs the model (logits
``[b, s, V]``, RoPE at the micro-step's position ids, the packed/tree attention mask) and gathers
the targets' log-probs chunk by chunk.
:class:`MegatronTrainStep` runs micro-steps through ``get_forward_backward_func``: the loss
function returns ``(loss_sum, normaliser, stats)`` with ``calculate_per_token_loss = True``, so
``finalize_model_grads`` divides the (data-parallel all-reduced) gradients by the total
normaliser ``|E|`` once (``megatron/core/pipeline_parallel/schedules.py``,
``megatron/core/distributed/finalize_model_grads.py``); a streaming cell skips that step and sums
the ``main_grad`` buffers over its prefix group itself.

Tensor parallelism inside the cell: the logits are vocabulary shards and the target log-probs and
entropy are all-reduced over the TP group (:func:`gyre.training.logprobs.target_logprobs_from_logits`);
:meth:`MegatronTrainStep.accumulate` sums, over the TP group, the gradients of the parameters that
every TP rank holds whole but that see only its own heads (``q_layernorm``/``k_layernorm``) or
sequence shard (``sequence_parallel`` parameters) -- the non-tensor-parallel reduction
``finalize_model_grads`` does -- so ``main_grad`` holds the full gradients after each call;
:meth:`MegatronTrainStep.hf_named` all-gathers the shards (:mod:`gyre.training.megatron_export`).

Pipeline parallelism inside the cell: Megatron's schedule runs the stages (``variable_seq_lengths``,
since micro-steps differ in shape); the loss function runs on the last stage, whose statistics and
log-ratio sums are broadcast to the other stages; :meth:`MegatronTrainStep.accumulate` also sums
the tied embedding's gradient between the first and the last stage, and
:meth:`MegatronTrainStep.hf_named` gathers the stages.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from gyre.buffer.packing import MicroStep
from gyre.rl.objective import ObjectiveConfig, ObjectiveStats, execution_objective
from gyre.training.checkpoint_conversion import hf_to_megatron, load_into_megatron
from gyre.training.logprobs import DEFAULT_CHUNK_SIZE
from gyre.training.megatron_export import gather_hf_named, hf_buckets
from gyre.training.megatron_model import (apply_wd_mult, build_gpt_model, build_optimizer, transformer_config_from_hf,
                                          wrap_ddp)
from gyre.training.megatron_policy import MegatronPolicy
from gyre.training.step import AdamConfig, MicroStepBatch, TrainStep, add_split_log_ratios

__all__ = ["MegatronPolicy", "MegatronTrainStep", "build_megatron_train_step"]


class MegatronTrainStep(TrainStep):
    """Training step through megatron-core's ``get_forward_backward_func`` (single cell).

    Args:
        model: the DDP-wrapped ``GPTModel`` (:func:`gyre.training.megatron_model.wrap_ddp`);
            its ``TransformerConfig`` must have ``calculate_per_token_loss=True`` *before* the DDP
            wrap (DDP then skips its ``1/dp`` scaling and ``finalize_model_grads`` divides by the
            all-reduced normaliser).
        optimizer: Megatron optimizer (:func:`gyre.training.megatron_model.build_optimizer`).
        objective: :class:`~gyre.rl.objective.ObjectiveConfig`.
        chunk_size: targets per log-prob chunk.
        adam: :class:`~gyre.training.step.AdamConfig` whose ``lr`` / ``lr_warmup_iters`` set each
            update's learning rate (default: leave the optimizer's learning rate alone).
        hf_config: the HF config the model was converted from (needed by :meth:`hf_named` and
            :meth:`save_hf`, i.e. for serving and saving the weights).
        temperature: the rollout sampling temperature (:class:`MegatronPolicy`).

    Raises:
        ValueError: ``calculate_per_token_loss`` is off or ``finalize_model_grads_func`` is unset.
        NotImplementedError: a parameter is marked ``average_gradients_across_tp_domain`` (none is
            in the Qwen3 ``GPTModel``).
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
        self.tp_partial = [p for n, p in named if _tp_partial_grad(n, p, config)]
        if any(getattr(p, "average_gradients_across_tp_domain", False) for p in self.params):
            raise NotImplementedError("parameters averaged across the TP domain are not reduced by accumulate")
        apply_wd_mult(optimizer)  # idempotent; build_optimizer already applied it

    def zero_grad(self) -> None:
        """Zero DDP's gradient buffers (``main_grad``) and drop the optimizer's ``.grad`` aliases."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def grad_buffers(self) -> list[torch.Tensor]:
        """DDP's contiguous gradient buffers (every ``main_grad`` is a view of one)."""
        return [b.grad_data for b in (*self.model.buffers, *self.model.expert_parallel_buffers)]

    def grad_tensors(self) -> list[torch.Tensor]:
        """Each parameter's accumulated gradient: DDP's ``main_grad`` (a view of its fp32 buffer)."""
        return [p.main_grad for p in self.params]

    def reduce_tensor_parallel_grads(self) -> None:
        """Sum ``main_grad`` of the TP-partial parameters over the TP group, in place (no-op at TP = 1).

        These parameters (``q_layernorm``/``k_layernorm`` weights, applied to this rank's heads
        only, and ``sequence_parallel`` ones) are whole on every TP rank but each rank's backward
        gives only its share of their gradient; this is the TP all-reduce of Megatron's
        ``finalize_model_grads``. Collective over the TP group. :meth:`accumulate` calls it."""
        from megatron.core import parallel_state as ps
        import torch.distributed as dist

        if not self.tp_partial or ps.get_tensor_model_parallel_world_size() == 1:
            return
        grads = [p.main_grad for p in self.tp_partial]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
        offset = 0
        with torch.no_grad():
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def hf_named(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (shaped like :attr:`params`) converted to HF names and layout
        (:func:`gyre.training.megatron_export.gather_hf_named`; a tied ``lm_head`` is left out).
        Collective over the model-parallel group; every rank returns the whole HF tensors.

        Raises:
            ValueError: the step was built without ``hf_config``.
        """
        if self.hf_config is None:
            raise ValueError("MegatronTrainStep needs hf_config to name weights in HF layout")
        return gather_hf_named(self.param_names, tensors, self.hf_config)

    def hf_named_buckets(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """``tensors`` (shaped like :attr:`params`) in HF names and layout, in buckets of about
        ``bucket_bytes``, on the model-parallel group's first rank
        (:func:`gyre.training.megatron_export.hf_buckets`). Collective over the model-parallel
        group: every rank must exhaust it.

        Raises:
            ValueError: the step was built without ``hf_config``.
        """
        if self.hf_config is None:
            raise ValueError("MegatronTrainStep needs hf_config to name weights in HF layout")
        yield from hf_buckets(self.param_names, tensors, self.hf_config, bucket_bytes)

    def save_hf(self, directory) -> None:
        """Write the weights as a servable HF checkpoint (``config.json`` + ``model.safetensors``).

        At TP or PP > 1 every rank of the model-parallel group must call it (the shards are
        gathered); its first rank writes."""
        from megatron.core import parallel_state as ps
        from safetensors.torch import save_file

        named = self.hf_named([p.detach() for p in self.params])
        if ps.get_tensor_model_parallel_rank() != 0 or ps.get_pipeline_model_parallel_rank() != 0:
            return
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.hf_config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in named.items()}, str(Path(directory) / "model.safetensors"),
                  metadata={"format": "pt"})

    def forward_step(self, data_iterator, model):
        """Megatron ``forward_step_func`` for one micro-step (the separable per-micro-step part).

        Takes the next :class:`~gyre.training.step.MicroStepBatch` from ``data_iterator``, returns
        ``(logits, loss_func)``; ``loss_func(logits)`` returns the 3-tuple ``(loss_sum, normaliser
        (int tensor), {"stats": ObjectiveStats})`` that ``calculate_per_token_loss`` expects.
        """
        batch = next(data_iterator)
        logits = self.policy.logits(model, batch)

        def loss_func(output):
            lp, ent = self.policy.target_logprobs(output, batch)
            out = execution_objective(lp, batch.objective_inputs, self.objective, ent)
            return out.loss_sum, torch.tensor(out.normaliser, dtype=torch.int, device=lp.device), {"stats": out.stats}

        return logits, loss_func

    def _forward_only_step(self, data_iterator, model):
        batch = next(data_iterator)
        logits = self.policy.logits(model, batch)

        def loss_func(output):
            lp, _ = self.policy.target_logprobs(output, batch)
            return (torch.zeros((), device=lp.device), torch.tensor(0, dtype=torch.int, device=lp.device),
                    {"lp": lp.detach(), "batch": batch})

        return logits, loss_func

    def _run(self, step_func, micro_steps, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = [MicroStepBatch.from_micro_step(ms, self.params[0].device, tree_intervals=self.policy.fused)
                   for ms in micro_steps]
        shapes = [b.input_ids.shape for b in batches]
        return get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=iter(batches), model=[self.model],
            num_microbatches=len(batches), seq_length=max(s for _, s in shapes),
            micro_batch_size=max(b for b, _ in shapes), forward_only=forward_only)

    def precompute_log_ratio_sums(self, micro_steps: Sequence[MicroStep]) -> tuple[dict[str, float], int]:
        """:func:`~gyre.training.step.precompute_log_ratio_sums` through the schedule
        (``forward_only=True``)."""
        todo = [ms for ms in micro_steps if ms.split.any()]
        if not todo:
            return {}, 0
        sums: dict[str, float] = {}
        for rec in self._run(self._forward_only_step, todo, forward_only=True):
            add_split_log_ratios(sums, rec["batch"], rec["lp"])
        return _from_last_stage(sums), sum(ms.forward_tokens for ms in todo)

    def forward_backward(self, micro_steps: Sequence[MicroStep], finalize: bool = True) -> tuple[int, ObjectiveStats]:
        """Forward/backward of ``micro_steps`` through the schedule; ``finalize_model_grads`` then
        all-reduces the gradients and the normaliser over data parallelism and divides the gradients
        by it (``1/|E|`` once). No optimizer update. Returns ``(normaliser, stats)`` of these
        micro-steps (this rank's share). Split executions need ``log_ratio_sum`` first.

        ``finalize=False`` skips ``finalize_model_grads``: the un-normalised per-token-weighted
        gradients stay in ``main_grad`` and nothing is reduced -- at TP > 1 not even over the TP
        group (see :meth:`accumulate`)."""
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
            stats = _from_last_stage(stats)
        return stats.normaliser, stats

    def accumulate(self, micro_steps: Sequence[MicroStep]) -> tuple[int, ObjectiveStats]:
        """The streaming cell's micro-step: :meth:`forward_backward` with ``finalize=False``, then
        the reductions ``finalize_model_grads`` would do inside the cell, on the increment these
        micro-steps added (so repeated calls never sum a gradient twice): the TP-partial gradients
        over the TP group (:meth:`reduce_tensor_parallel_grads`) and, at PP > 1 with tied
        embeddings, the word-embedding gradient of the first stage and the output-layer gradient
        of the last over the embedding group.  Afterwards ``main_grad`` holds the un-normalised
        full gradients of everything accumulated, as a single process would, ready for a cross-cell
        sum; nothing is reduced over data parallelism or divided by ``|E|``."""
        tied = self._tied_embedding_params()
        watched = (self.tp_partial if self._tp_size() > 1 else []) + tied
        before = [p.main_grad.clone() for p in watched]
        out = self.forward_backward(micro_steps, finalize=False)
        if before:
            with torch.no_grad():
                for p, b in zip(watched, before):
                    p.main_grad.sub_(b)
                if self._tp_size() > 1:
                    self.reduce_tensor_parallel_grads()
                if tied:
                    self._reduce_tied_embedding_grads(tied)
                for p, b in zip(watched, before):
                    p.main_grad.add_(b)
        return out

    def _tied_embedding_params(self) -> list[torch.nn.Parameter]:
        """The copies of the tied word embedding this stage holds, at PP > 1 (first stage: the
        input embedding; last: the output layer); none otherwise."""
        from megatron.core import parallel_state as ps

        module = getattr(self.model, "module", self.model)
        tied = getattr(module, "share_embeddings_and_output_weights", False)
        if ps.get_pipeline_model_parallel_world_size() == 1 or not tied:
            return []
        return [p for p in (getattr(module, "shared_embedding_or_output_weight", lambda: None)(),) if p is not None]

    @staticmethod
    def _reduce_tied_embedding_grads(params) -> None:
        from megatron.core import parallel_state as ps
        import torch.distributed as dist

        if not ps.is_rank_in_embedding_group():
            return
        for p in params:
            dist.all_reduce(p.main_grad, group=ps.get_embedding_group())

    @staticmethod
    def _tp_size() -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_world_size()

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

    def _accumulate_and_update(self, micro_steps: Sequence[MicroStep]) -> tuple[float, ObjectiveStats]:
        # the gradients are divided by |E| in finalize_model_grads
        _, stats = self.forward_backward(micro_steps)
        return self.optimizer_step(), stats


def _from_last_stage(obj):
    """``obj`` of the last pipeline stage on every stage (the loss function runs on the last one
    only); itself at PP = 1.  Collective over the pipeline group."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]


def _tp_partial_grad(name: str, param: torch.nn.Parameter, config) -> bool:
    """Whether ``param`` is whole on every TP rank while each rank's backward gives only part of its
    gradient: the per-head ``q_layernorm``/``k_layernorm`` weights (applied to this rank's heads)
    and, with sequence parallelism, parameters Megatron marks ``sequence_parallel``."""
    if getattr(param, "tensor_model_parallel", False):
        return False
    if config.sequence_parallel and getattr(param, "sequence_parallel", False):
        return True
    return "q_layernorm" in name or "k_layernorm" in name


def build_megatron_train_step(hf_model: torch.nn.Module, objective: ObjectiveConfig | None = None,
                              adam: AdamConfig | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                              bf16: bool = False, temperature: float = 1.0, attention: str = "dense"
                              ) -> MegatronTrainStep:
    """Megatron ``GPTModel`` holding ``hf_model``'s weights, DDP, optimizer -> :class:`MegatronTrainStep`.

    Call :func:`gyre.training.megatron_model.initialize_megatron_cpu` (or the GPU equivalent)
    first. Sets ``calculate_per_token_loss=True`` before the DDP wrap.  ``attention``: see
    :func:`gyre.training.megatron_model.build_gpt_model`.
    """
    from megatron.core import parallel_state as ps

    adam = adam or AdamConfig()
    cfg = hf_model.config
    tcfg = transformer_config_from_hf(cfg, calculate_per_token_loss=True, bf16=bf16)
    # micro-steps differ in shape: stages exchange shapes first (set after __post_init__, whose
    # MoE checks refuse it for a dense model's default token dispatcher)
    tcfg.variable_seq_lengths = ps.get_pipeline_model_parallel_world_size() > 1
    model = build_gpt_model(cfg, tcfg, attention=attention)
    load_into_megatron(model, hf_to_megatron(
        hf_model.state_dict(), cfg, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()))
    ddp = wrap_ddp(model, tcfg)
    opt = build_optimizer(ddp, lr=adam.lr, weight_decay=adam.weight_decay, adam_beta1=adam.adam_beta1,
                          adam_beta2=adam.adam_beta2, adam_eps=adam.adam_eps, clip_grad=adam.clip_grad, bf16=bf16)
    return MegatronTrainStep(ddp, opt, objective, chunk_size, adam, hf_config=cfg, temperature=temperature)
