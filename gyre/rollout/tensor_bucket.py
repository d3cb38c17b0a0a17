"""Weight buckets shared by memory handle: the ``flattened_bucket`` payload of
``/update_weights_from_tensor``.

A trainer pushing weights into an engine on the same node does not copy bytes through HTTP: it
packs a bucket of HF-named tensors into one flat ``uint8`` tensor (:class:`FlatBucket`: the flat
tensor plus each tensor's name, shape, dtype and byte range), pickles it with
``multiprocessing``'s ``ForkingPickler`` and torch's reductions, so the payload carries a
*handle* to the flat tensor's memory (a CUDA IPC handle for a CUDA tensor, a shared-memory file
for a CPU one), and sends one such payload per engine TP rank (:func:`engine_rank_payloads`).
The engine opens the handle and copies from it (:func:`load_payload`), so the sender must keep
the flat tensor alive until the engine has replied (:class:`FlatBucket` is what it keeps).
The embedded engine accepts these payloads under ``load_format="flattened_bucket"``.  SGLang
uses the same name for a different layout (its own metadata class inside the pickle), so these
payloads are for the embedded engine only: an SGLang server gets SGLang's default payload, a list
of ``(name, tensor)`` pairs per TP rank (:func:`gyre.rollout.sglang_driver.weights.serialize_named_tensors_for_sglang`).

Opening a payload unpickles it, so :func:`load_payload` only resolves the few torch globals a
tensor handle needs (anything else is refused); an engine endpoint taking payloads must still only
listen where its trainers are.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

#: The payload format's name on ``/update_weights_from_tensor`` (``load_format``).
LOAD_FORMAT = "flattened_bucket"

#: Every tensor in a flat bucket starts at a multiple of this many bytes.
ALIGN_BYTES = 16

#: Globals a payload may reference: torch's tensor/storage rebuilders and types.
_ALLOWED_GLOBALS = {
    "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
                                         "rebuild_storage_fd", "rebuild_storage_empty", "rebuild_cuda_tensor",
                                         "rebuild_typed_storage_child", "rebuild_event"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", "uint8"},
    "multiprocessing.resource_sharer": {"DupFd"},
}


@dataclass
class FlatBucket:
    """Named tensors packed into one flat byte tensor (on the tensors' device), each starting at a
    multiple of :data:`ALIGN_BYTES`.

    ``meta`` holds ``(name, shape, dtype name, start byte, end byte)`` per tensor, in order."""

    flat: torch.Tensor
    meta: list[tuple[str, tuple[int, ...], str, int, int]]

    @classmethod
    def pack(cls, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> "FlatBucket":
        """Copy ``named`` into one flat ``uint8`` tensor (every tensor on one device).

        Raises:
            ValueError: no tensors, or tensors on more than one device.
            TypeError: a name is not a string or a value not a tensor.
        """
        items = list(named.items()) if isinstance(named, Mapping) else list(named)
        if not items:
            raise ValueError("an empty bucket")
        parts, meta, start = [], [], 0
        devices = set()
        for name, t in items:
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError(f"expected (str, Tensor) pairs, got ({type(name).__name__}, {type(t).__name__})")
            devices.add(t.device)
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            pad = -start % ALIGN_BYTES  # every tensor starts aligned, so it can be viewed in its dtype
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
                start += pad
            parts.append(raw)
            meta.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch."), start, start + raw.numel()))
            start += raw.numel()
        if len(devices) > 1:
            raise ValueError(f"a bucket's tensors must share one device, got {sorted(map(str, devices))}")
        return cls(torch.cat(parts), meta)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """The named tensors, as views of :attr:`flat` (copy them before ``flat`` goes away).

        Raises:
            ValueError: ``meta`` does not describe ``flat`` (ranges, sizes or dtype names).
        """
        out = []
        for entry in self.meta:
            try:
                name, shape, dtype_name, start, end = entry
                dtype = getattr(torch, dtype_name)
                if not isinstance(dtype, torch.dtype) or not 0 <= start <= end <= self.flat.numel():
                    raise ValueError
                t = self.flat[start:end].view(dtype).reshape(tuple(shape))
            except (TypeError, ValueError, AttributeError, RuntimeError):
                raise ValueError(f"bad bucket entry {entry!r} for a flat tensor of {self.flat.numel()} bytes") from None
            out.append((str(name), t))
        return out

    def serialize(self) -> str:
        """The payload: base64 of ``ForkingPickler`` bytes holding a handle to :attr:`flat`'s memory.

        A CPU tensor is moved to shared memory under the ``file_system`` sharing strategy (so a
        process that is not this one's child can open it); a CUDA tensor travels as a CUDA IPC
        handle.  Keep this bucket alive until the engine has loaded the payload."""
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing as tmp

        if self.flat.device.type == "cpu" and tmp.get_sharing_strategy() != "file_system":
            tmp.set_sharing_strategy("file_system")
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump({"flat": self.flat, "meta": self.meta})
        return base64.b64encode(buf.getvalue()).decode("ascii")


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get(module, ())
        if name in allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            import torch.multiprocessing as _reductions  # noqa: F401  (registers the reductions)

            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a weight payload may not reference {module}.{name}")


def load_payload(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Open one payload of :meth:`FlatBucket.serialize`: the named tensors, copied out of the
    shared memory (so the sender may free it once this returns).

    Raises:
        ValueError: not base64, not such a payload, a foreign global, or a handle that cannot be opened.
    """
    try:
        raw = base64.b64decode(payload, validate=True)
        obj = _HandleUnpickler(io.BytesIO(raw)).load()
        flat, meta = obj["flat"], obj["meta"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or not isinstance(meta, list):
            raise ValueError("not a flat uint8 tensor with a list of entries")
    except Exception as exc:
        raise ValueError(f"not a {LOAD_FORMAT} payload ({type(exc).__name__}: {exc})") from None
    return [(name, t.clone()) for name, t in FlatBucket(flat, meta).unpack()]


def engine_rank_payloads(by_shard: Sequence[str | None], engine_tp_size: int) -> list[str]:
    """``serialized_named_tensors`` for one engine: one payload per engine TP rank.  Engine rank
    ``i`` shares a GPU with the cell's shard ``i`` when a cell's ranks and the engine's ranks are
    laid out alike, so it gets the handle serialized by shard ``i`` if that shard made one
    (``by_shard[i]``, ``None`` where it holds no copy), else the leader's (shard 0).

    Raises:
        ValueError: the leader made no payload, or ``engine_tp_size < 1``.
    """
    if engine_tp_size < 1:
        raise ValueError(f"engine_tp_size must be >= 1, got {engine_tp_size}")
    if not by_shard or by_shard[0] is None:
        raise ValueError("the cell's leader (shard 0) must hold the bucket")
    return [by_shard[i] if i < len(by_shard) and by_shard[i] is not None else by_shard[0]
            for i in range(engine_tp_size)]
