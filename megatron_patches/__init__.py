"""The few runtime patches Gyre applies to megatron-core 0.16.1 to train on CPU under gloo.

Applied only on the CPU backend, by :func:`apply_cpu_patches` (idempotent).  Each patch is one
small function whose docstring names the upstream code it works around.  None of them changes
maths: they redirect CUDA-only calls (RNG, device queries, ``device='cuda'`` tensors, a dtype
assertion) to their CPU equivalents.

A further requirement is *not* a CUDA issue and lives with the model builder
(``gyre/training/megatron_model.py``): ``config.finalize_model_grads_func`` and
``config.no_sync_func`` must be set or the pipeline schedule never all-reduces gradients
and data-parallel replicas drift apart silently.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_APPLIED: list[str] = []


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrite ``device='cuda'`` (or ``torch.device('cuda', i)``) keyword arguments to ``cpu``.

    Used only around the few megatron-core functions that allocate scalars on
    ``device='cuda'`` (see :func:`patch_cuda_device_tensors`), not globally.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _under_cpu_mode(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    wrapper.__gyre_cpu_patch__ = True  # type: ignore[attr-defined]
    return wrapper


def patch_cuda_rng() -> None:
    """RNG state on CPU.

    Upstream: ``megatron/core/tensor_parallel/random.py`` -- ``CudaRNGStatesTracker.add``/``fork``
    call ``torch.cuda.get_rng_state``/``manual_seed`` and ``_get_cuda_rng_state``/
    ``_set_cuda_rng_state``; ``model_parallel_cuda_manual_seed`` calls ``torch.cuda.manual_seed``.
    Attention always forks the tracker.  All of them are pointed at the CPU default generator.
    ``torch.cuda.manual_seed = torch.manual_seed`` would recurse (``torch.manual_seed`` calls
    ``torch.cuda.manual_seed_all``), so seeding goes to ``torch.default_generator`` directly and
    ``manual_seed_all`` becomes a no-op.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def get_rng_state(device: Any = "cuda", *args, **kwargs) -> torch.Tensor:
        return torch.default_generator.get_state()

    def set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
        torch.default_generator.set_state(new_state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = lambda seed: None
    mrandom._get_cuda_rng_state = get_rng_state
    mrandom._set_cuda_rng_state = set_rng_state


def patch_current_device() -> None:
    """``torch.cuda.current_device()`` returns ``"cpu"``.

    Upstream: ~120 call sites, first ``megatron/core/models/common/embeddings/rotary_pos_embedding.py``
    (``inv_freq.to(torch.cuda.current_device())``); all use it as a ``.to()``/``device=`` target.
    """
    torch.cuda.current_device = lambda: "cpu"


def patch_cuda_device_tensors() -> None:
    """Run the optimizer's scalar allocations on CPU.

    Upstream: ``megatron/core/optimizer/clip_grads.py`` ``get_grad_norm_fp32`` and
    ``count_zeros_fp32`` (``torch.tensor/zeros(..., device='cuda')``), and
    ``megatron/core/optimizer/optimizer.py`` ``MixedPrecisionOptimizer.__init__`` /
    ``FP32Optimizer.__init__`` (``found_inf``, ``_scale`` on ``device='cuda'``).  Each is wrapped
    in :class:`CudaToCpuMode` (targeted, so the rest of the step pays no mode overhead).
    ``optimizer.py`` imports the clip_grads names, so both modules are patched.
    """
    from megatron.core.optimizer import clip_grads, optimizer

    for name in ("get_grad_norm_fp32", "count_zeros_fp32"):
        fn = _under_cpu_mode(getattr(clip_grads, name))
        setattr(clip_grads, name, fn)
        setattr(optimizer, name, fn)
    for cls in (optimizer.MixedPrecisionOptimizer, optimizer.FP32Optimizer):
        cls.__init__ = _under_cpu_mode(cls.__init__)


def clip_grad_by_total_norm_fp32(
    parameters: list[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale gradients in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1.

    Same contract as upstream ``megatron/core/optimizer/clip_grads.py::clip_grad_by_total_norm_fp32``,
    without its ``param.grad.type() == 'torch.cuda.FloatTensor'`` assertion and CUDA buffer.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    for g in grads:
        if g.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"clip_grad_by_total_norm_fp32: unexpected grad dtype {g.dtype}")
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


class _CpuTorchNamespace:
    """Stands in for the ``torch`` module inside one megatron-core module.

    Attribute access is delegated to ``torch``; only the tensor factories rewrite a CUDA
    ``device=`` to ``cpu``.  Model compute never passes through it.
    """

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            @functools.wraps(attr)
            def factory(*args, **kwargs):
                if _is_cuda(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)
            return factory
        return attr


def patch_schedules() -> None:
    """Let the pipeline schedules allocate their token counter on CPU; ``cuda.synchronize`` no-op.

    Upstream: ``megatron/core/pipeline_parallel/schedules.py`` ``forward_backward_no_pipelining``,
    ``forward_backward_pipelining_with(out)_interleaving`` allocate ``total_num_tokens`` with
    ``torch.zeros([], dtype=torch.int, device="cuda")``; ``p2p_communication.py`` calls
    ``torch.cuda.synchronize()`` after batched p2p.  The schedules module's ``torch`` global is
    replaced by :class:`_CpuTorchNamespace` (factories only), so the schedule code runs unchanged.
    """
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuTorchNamespace()
    torch.cuda.synchronize = lambda device=None: None


def patch_tied_embedding_sync() -> None:
    """Keep the tied output copy on CPU when pipeline stages sync it at construction.

    Upstream: ``megatron/core/models/common/language_module/language_module.py``
    ``setup_embeddings_and_output_layer`` runs ``weight.data = weight.data.cuda()`` before the
    first/last-stage all-reduce (PP > 1 with tied embeddings).  ``Tensor.cuda`` is the identity
    for the duration of that one method only.
    """
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def patch_clip_grads() -> None:
    """Replace ``clip_grad_by_total_norm_fp32`` in ``clip_grads`` and ``optimizer`` (it imports the name).

    Upstream: ``megatron/core/optimizer/clip_grads.py`` asserts CUDA float grads.
    """
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


PATCHES: tuple[Callable[[], None], ...] = (
    patch_cuda_rng,
    patch_current_device,
    patch_cuda_device_tensors,
    patch_clip_grads,
    patch_schedules,
    patch_tied_embedding_sync,
)


def apply_cpu_patches() -> list[str]:
    """Apply every patch once (later calls do nothing); return the names applied.

    Raises:
        RuntimeError: CUDA is available -- these patches are for the CPU backend only.
    """
    if _APPLIED:
        return list(_APPLIED)
    if torch.cuda.is_available():
        raise RuntimeError("megatron_patches are for the CPU backend; CUDA is available here")
    for patch in PATCHES:
        patch()
        _APPLIED.append(patch.__name__)
    return list(_APPLIED)
