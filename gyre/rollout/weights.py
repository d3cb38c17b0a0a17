"""Weight publication: moving a trainer's parameters into rollout engines.

Two transports, both SGLang-native endpoints:

* **tensor** (``/update_weights_from_tensor``): for the embedded CPU engine each payload is
  ``base64(torch.save({name: tensor}))`` (:func:`serialize_named_tensors`; HF state-dict
  names, any float dtype); a large state dict is split into several payloads of one call
  (:func:`bucket_named_tensors`), which the engine swaps at once.
* **disk** (``/update_weights_from_disk``): :func:`save_weights_for_disk_update` writes one
  ``model.safetensors`` (tied tensors stored once) into a directory the engine can read.

:func:`publish_weights` pushes one version to many engines and reports per-engine results;
with ``abort_in_flight`` (SGLang ``abort_all_requests``) running requests are aborted rather
than finished on the old weights.  SGLang GPU servers need their own tensor serializer
(:func:`gyre.rollout.sglang_driver.weights.serialize_named_tensors_for_sglang`) or the disk transport.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    import torch

    from gyre.rollout.client.engine_client import EngineClient


def _items(named: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return list(named.items()) if isinstance(named, Mapping) else list(named)


def serialize_named_tensors(named: Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]) -> str:
    """``base64(torch.save({name: tensor}))`` with contiguous CPU, detached tensors.

    Raises:
        TypeError: a name is not a string or a value not a tensor.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, t in _items(named):
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"expected (str, Tensor) pairs, got ({type(name).__name__}, {type(t).__name__})")
        out[name] = t.detach().to("cpu").contiguous()
    buf = io.BytesIO()
    torch.save(out, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payloads: Sequence[str], load_format: str | None = None) -> dict[str, "torch.Tensor"]:
    """Inverse of :func:`serialize_named_tensors` over a list of payloads (later names win).

    With ``load_format="flattened_bucket"`` the list holds one payload per engine TP rank
    (:mod:`gyre.rollout.tensor_bucket`) and this single-rank engine loads the first.  Otherwise
    each payload may hold a ``{name: tensor}`` dict or a list of ``(name, tensor)`` pairs;
    ``torch.load`` runs with ``weights_only=True``.

    Raises:
        gyre.rollout.api.sglang_api.ProtocolError: bad base64, an unreadable or foreign payload, or a
            ``load_format`` other than ``None``/``"torch"``.
    """
    import torch

    from gyre.rollout.api.sglang_api import ProtocolError

    from gyre.rollout.tensor_bucket import LOAD_FORMAT, load_payload

    if load_format == LOAD_FORMAT:  # one payload per engine TP rank: this engine is rank 0
        try:
            return dict(load_payload(payloads[0]))
        except ValueError as exc:
            raise ProtocolError(f"serialized_named_tensors[0]: {exc}") from None
    if load_format not in (None, "torch"):
        raise ProtocolError(f"load_format {load_format!r} is not supported by the embedded engine "
                            f"(null or 'torch': base64 torch.save payloads; {LOAD_FORMAT!r}: one shared-memory "
                            "bucket per engine TP rank)")
    named: dict[str, torch.Tensor] = {}
    for i, p in enumerate(payloads):
        try:
            obj = torch.load(io.BytesIO(base64.b64decode(p, validate=True)), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ProtocolError(f"serialized_named_tensors[{i}]: not a base64 torch.save payload "
                                f"({type(exc).__name__})") from None
        items = obj.items() if isinstance(obj, dict) else obj
        try:
            for name, t in items:
                if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                    raise TypeError
                named[name] = t
        except (TypeError, ValueError):
            raise ProtocolError(f"serialized_named_tensors[{i}]: expected a dict or list of "
                                "(name, tensor) pairs") from None
    return named


def bucket_named_tensors(named: Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]],
                         bucket_bytes: int = 256 << 20) -> list[list[tuple[str, "torch.Tensor"]]]:
    """Split into consecutive buckets of at most ``bucket_bytes`` (a tensor larger than that
    gets its own bucket)."""
    buckets: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, t in _items(named):
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += n
    return [b for b in buckets if b]


def push_weight_buckets(client, buckets: Iterable[Mapping[str, "torch.Tensor"]], weight_version: str, *,
                        live: bool = True) -> int:
    """Load ``buckets`` (HF-named tensors) into one engine as version ``weight_version``: every
    bucket but the last with ``flush_cache=False`` (the embedded engine admits nothing meanwhile),
    the last flushing the cache and setting the version.  ``buckets`` is consumed to its end even
    when an update fails (a collective may be producing it).  Returns the tensors loaded.

    A client with a ``push_weight_buckets`` method of its own (an SGLang cell's,
    :class:`gyre.rollout.sglang_driver.weights.SGLangTensorClient`) orders the calls itself; ``live`` tells
    it whether the engine is serving (a rollout cell's update) or paused with its KV cache released
    (a role switch).

    Raises:
        ValueError: there was no bucket.
        the client's error of a failed update (after ``buckets`` was exhausted).
    """
    own = getattr(client, "push_weight_buckets", None)
    if own is not None:
        return own(buckets, weight_version, live=live)
    return load_buckets_in_order(client.update_weights_from_tensor, buckets, weight_version)


def load_buckets_in_order(update, buckets: Iterable[Mapping[str, "torch.Tensor"]], weight_version: str, *,
                          flush_last: bool = True) -> int:
    """``update(bucket, weight_version=..., flush_cache=...)`` for each bucket, only the last one
    flushing (none with ``flush_last=False``); ``buckets`` is consumed to its end even when an
    update fails.  Returns the tensors loaded (see :func:`push_weight_buckets`).

    Raises:
        ValueError: there was no bucket.
    """
    it = iter(buckets)
    loaded = 0
    try:
        pending = next(it, None)
        if pending is None:
            raise ValueError("no weights to push")
        for bucket in it:
            update(pending, weight_version=weight_version, flush_cache=False)
            loaded += len(pending)
            pending = bucket
        update(pending, weight_version=weight_version, flush_cache=flush_last)
        return loaded + len(pending)
    finally:
        for _ in it:  # keep the other ranks' collectives matched
            pass


def save_weights_for_disk_update(named: Mapping[str, "torch.Tensor"], directory: str | os.PathLike) -> Path:
    """Write ``model.safetensors`` into ``directory`` (created); tensors sharing storage are
    written once (the first name wins).  Returns the directory."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    unique: dict[str, Any] = {}
    for name, t in named.items():
        key = t.untyped_storage().data_ptr()
        if key in seen and t.numel():
            continue
        seen.add(key)
        unique[name] = t.detach().to("cpu").contiguous()
    tmp = out / "model.safetensors.tmp"
    save_file(unique, str(tmp))
    os.replace(tmp, out / "model.safetensors")
    return out


def publish_weights(clients: Sequence["EngineClient"], *, weight_version: str,
                    named_tensors: Mapping[str, "torch.Tensor"] | None = None, model_path: str | None = None,
                    abort_in_flight: bool = False, bucket_bytes: int = 256 << 20) -> list[dict[str, Any]]:
    """Publish one weight version to every engine (in order); return each engine's answer.

    Give exactly one of ``named_tensors`` (tensor transport; one call per engine whose payload
    list holds buckets of at most ``bucket_bytes``) or ``model_path`` (disk).

    Raises:
        ValueError: both or neither source given.
        gyre.rollout.client.messages.EngineError: an engine rejected the update (later engines untouched).
    """
    if (named_tensors is None) == (model_path is None):
        raise ValueError("give exactly one of named_tensors or model_path")
    results = []
    payloads = None
    if named_tensors is not None:
        payloads = [serialize_named_tensors(b) for b in bucket_named_tensors(named_tensors, bucket_bytes)]
    for c in clients:
        if model_path is not None:
            results.append(c.update_weights_from_disk(model_path, weight_version=weight_version,
                                                      abort_all_requests=abort_in_flight))
            continue
        results.append(c.update_weights_from_tensor(serialized_named_tensors=payloads, weight_version=weight_version,
                                                    abort_all_requests=abort_in_flight))
    return results
