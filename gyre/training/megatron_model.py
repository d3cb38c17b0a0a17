"""Megatron ``GPTModel`` for a Qwen3- or Llama-architecture HF config (local spec; CPU/gloo or GPU).

Qwen3/Llama -> Megatron mapping: RMSNorm (``normalization="RMSNorm"``), SwiGLU
(``gated_linear_unit=True``, ``activation_func=F.silu``), RoPE (``rotary_base=rope_theta``),
GQA (``num_query_groups=num_key_value_heads``, ``kv_channels=head_dim``), per-head qk RMSNorm
for Qwen3 only (``qk_layernorm``, from :func:`~gyre.training.checkpoint_conversion.has_qk_norm`),
no linear biases, tied or untied input/output embeddings (``share_embeddings_and_output_weights``).
Upstream references: ``megatron/core/models/gpt/gpt_model.py`` and ``gpt_layer_specs.get_gpt_layer_local_spec``.

On CPU, call :func:`initialize_megatron_cpu` first: it applies ``megatron_patches`` and
initialises model parallelism over an existing gloo process group.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from gyre.training.megatron_import import import_megatron_core


def init_process_group_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """``torch.distributed.init_process_group`` from torchrun's env vars, or a 1-rank group.

    Without ``RANK``/``WORLD_SIZE`` (a plain ``python`` run) a single-process group on a free
    loopback port is created, so Megatron code runs unchanged.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=timedelta(seconds=timeout_s))
        return
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def initialize_megatron_cpu(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                            seed: int = 1234, order: str = "tp-cp-ep-dp-pp", *, cpu: bool = True) -> None:
    """Apply the CPU patches, init gloo (if needed), Megatron parallel state and RNG tracker.

    With ``cpu=False`` (``--backend gpu``) no patch is applied and the process group must already
    be initialised (NCCL for CUDA tensors); the rest is the same.

    ``order`` is Megatron's rank order of the parallel dimensions (fastest first); the main job
    passes ``"tp-cp-ep-pp-dp"`` so that a cell's TP x PP ranks are contiguous (with Megatron's
    default a pipeline runs across data-parallel replicas, i.e. across cells).

    Raises:
        RuntimeError: world size not divisible by ``TP * PP``.
    """
    import torch.distributed as dist
    import_megatron_core()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_patches import apply_cpu_patches

    if cpu:
        apply_cpu_patches()
        init_process_group_from_env("gloo")
    elif not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed (NCCL) before Megatron on GPU")
    world = dist.get_world_size()
    if world % (tensor_model_parallel_size * pipeline_model_parallel_size):
        raise RuntimeError(f"world size {world} not divisible by TP*PP="
                           f"{tensor_model_parallel_size * pipeline_model_parallel_size}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        order=order,
    )
    model_parallel_cuda_manual_seed(seed)


def transformer_config_from_hf(hf_config: Any, **overrides):
    """``TransformerConfig`` equivalent to a HF ``Qwen3Config`` or ``LlamaConfig`` (fp32, all fusions off, CPU init).

    ``overrides`` set further TransformerConfig fields (e.g. ``tensor_model_parallel_size``,
    ``pipeline_model_parallel_size``, ``bf16``).
    """
    import_megatron_core()
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gyre.training.checkpoint_conversion import has_qk_norm

    if parallel_state.model_parallel_is_initialized():
        overrides.setdefault("tensor_model_parallel_size",
                             parallel_state.get_tensor_model_parallel_world_size())
        overrides.setdefault("pipeline_model_parallel_size",
                             parallel_state.get_pipeline_model_parallel_world_size())
    cpu = not torch.cuda.is_available()
    kw = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=cpu,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
    )
    kw.update(overrides)
    if kw.get("bf16"):
        kw["params_dtype"] = kw["pipeline_dtype"] = torch.bfloat16
    return TransformerConfig(**kw)


def rope_theta(hf_config: Any) -> float:
    """RoPE base of a HF config (``rope_theta`` or ``rope_parameters['rope_theta']`` in transformers 5)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


#: Optional kernel packages Megatron imports when present, catching only ImportError.
OPTIONAL_KERNEL_PACKAGES = ("flash_mla",)


def hide_unloadable_kernel_packages() -> list[str]:
    """Mark as absent each of :data:`OPTIONAL_KERNEL_PACKAGES` that is installed but whose CUDA
    library cannot load (an SGLang environment on a machine without libcuda: ``flash_mla`` raises
    OSError on import, which Megatron's ``except ImportError`` does not catch).  Returns their names."""
    import importlib
    import sys

    hidden = []
    for name in OPTIONAL_KERNEL_PACKAGES:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        except OSError:
            sys.modules[name] = None  # `import name` now raises ImportError
            hidden.append(name)
    return hidden


def build_gpt_model(hf_config: Any, config=None, pre_process: bool | None = None,
                    post_process: bool | None = None, attention: str = "dense"):
    """Build the Megatron ``GPTModel`` for this pipeline stage.

    ``attention``: ``dense`` (Megatron's ``DotProductAttention`` with a mask) or ``fused``
    (:class:`gyre.training.attention.FusedCoreAttention`: no dense mask; trains on GPU only).

    Returns:
        ``GPTModel`` whose forward ``(input_ids [b, s] int64, position_ids [b, s], attention_mask,
        labels=None)`` returns logits ``[b, s, vocab/TP]`` fp32 (or per-token loss with labels).
    """
    hide_unloadable_kernel_packages()
    import_megatron_core()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = config or transformer_config_from_hf(hf_config)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if attention == "fused":
        from gyre.training.attention import fused_layer_spec

        spec = fused_layer_spec(spec)
    elif attention != "dense":
        raise ValueError(f"attention must be dense or fused, not {attention!r}")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf_config)),
    )
    if config.bf16:  # every parameter in bf16, the norms too, as Megatron-LM's Float16Module makes them
        model = model.to(dtype=torch.bfloat16)
    if not config.use_cpu_initialization:
        # Megatron makes its parallel layers on the current GPU, but the local spec's norms are plain
        # torch modules made on the CPU (Megatron-LM's own set-up moves the whole model likewise)
        model = model.to(torch.cuda.current_device())
    return model


def wrap_ddp(model, config, overlap_grad_reduce: bool = False):
    """Wrap in Megatron DDP and set the two config hooks whose absence silently skips DP all-reduce.

    ``config.finalize_model_grads_func = finalize_model_grads`` and ``config.no_sync_func =
    model.no_sync`` (``megatron/core/pipeline_parallel/schedules.py`` reads both).
    """
    import_megatron_core()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce, use_distributed_optimizer=False),
        module=model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean mask ``[1, 1, s, s]``: ``True`` where attention is *not* allowed."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def build_optimizer(ddp_model, lr: float = 1e-6, weight_decay: float = 0.01, adam_beta1: float = 0.9,
                    adam_beta2: float = 0.95, adam_eps: float = 1e-15, clip_grad: float = 1.0,
                    bf16: bool = False):
    """Megatron Adam (``get_megatron_optimizer``), fp32 main params; defaults as
    :class:`~gyre.training.step.AdamConfig`.

    Norms and biases get no weight decay (:func:`apply_wd_mult`), as in Megatron-LM.
    """
    import_megatron_core()
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1,
                          adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=clip_grad, bf16=bf16,
                          params_dtype=torch.bfloat16 if bf16 else torch.float32,
                          use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(cfg, [ddp_model])
    apply_wd_mult(optimizer)
    return optimizer


def apply_wd_mult(optimizer) -> None:
    """Give each Megatron parameter group ``weight_decay * wd_mult`` (once).

    megatron-core puts 1-D parameters (norms, biases) in groups with ``wd_mult = 0`` but leaves
    ``weight_decay`` at the global value; Megatron-LM's ``OptimizerParamScheduler.step`` is what
    multiplies them in (``megatron/core/optimizer_param_scheduler.py``). Without that scheduler
    (constant lr here) norms would be decayed, unlike the HF path and Megatron-LM.
    """
    for group in optimizer.param_groups:
        if "wd_mult" in group and not group.get("_gyre_wd_mult_applied"):
            group["weight_decay"] = group["weight_decay"] * group["wd_mult"]
            group["_gyre_wd_mult_applied"] = True

