"""megatron-core imported with the ``torch.compile`` it applies at import time deferred to first use,
and without Weights & Biases.

Importing ``megatron.core`` binds ``megatron.core.jit.jit_fuser`` to ``torch.compile`` and decorates
the fused activations of ``megatron.core.fusions`` with it; each such decoration imports TorchDynamo
and Inductor, about half of the package's import time, whether or not a decorated function ever
runs (on CPU none does: :func:`gyre.training.megatron_model.transformer_config_from_hf` turns the
fusions off).  :func:`import_megatron_core` imports the package with ``torch.compile`` replaced, for
the duration of the import, by :func:`compile_on_first_call`, which applies the real
``torch.compile`` when a decorated function is first called: a function that runs is compiled with
the same arguments as before, one that never runs costs nothing.  ``jit_fuser`` keeps the deferring
decorator, so modules of the package imported later defer too.

The package also imports ``wandb`` where it is installed (for its timers and its inference
context's logging, neither of which Gyre uses), a large part of each rank's start.  While the
package is imported, ``wandb`` reads as not installed (``sys.modules["wandb"] = None``) unless
something imported it before; Gyre's own W&B scalars (:mod:`gyre.metrics`) import it afterwards
as usual.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

import torch

__all__ = ["compile_on_first_call", "import_megatron_core"]

_compile_lock = threading.Lock()
_import_lock = threading.Lock()


def compile_on_first_call(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``compile_fn`` (``torch.compile``) with its signature, decorator form included:
    it returns a wrapper of the model that calls ``compile_fn(model, **options)`` on its first call,
    once, and calls the compiled function from then on."""

    def deferred(model: Callable[..., Any] | None = None, **options: Any):
        if model is None:  # decorator form: @torch.compile(mode=...)
            return lambda fn: deferred(fn, **options)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any):
            if not compiled:
                with _compile_lock:
                    if not compiled:
                        compiled.append(compile_fn(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    return deferred


def import_megatron_core():
    """``megatron.core``, imported (the first time) with its import-time ``torch.compile`` deferred."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    with _import_lock:
        if "megatron.core" in sys.modules:  # imported by another thread meanwhile
            return sys.modules["megatron.core"]
        real = torch.compile
        torch.compile = compile_on_first_call(real)
        hide_wandb = "wandb" not in sys.modules
        if hide_wandb:
            sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError
        try:
            import megatron.core
        finally:
            torch.compile = real
            if hide_wandb:  # (nothing can have imported it meanwhile: the None entry refuses it)
                del sys.modules["wandb"]
    return megatron.core
