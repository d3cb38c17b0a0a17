"""SGLang-native control bodies as the embedded engine parses them: ``/abort_request``,
``/pause_generation``, memory occupation tags, weight updates (disk, tensor, distributed, version
only) and weight-update groups.  Names and defaults follow SGLang's ``managers/io_struct.py``; bad
input raises :class:`~gyre.rollout.api.request_validators.ProtocolError` (HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyre.rollout.api.request_validators import (
    ProtocolError,
    check_keys as _check_keys,
    is_int as _is_int,
    opt_bool as _opt_bool,
    want_bool as _want_bool,
    want_int as _want_int,
    want_object as _want_object,
)
from gyre.rollout.api.sglang_api import MEMORY_TAGS, PAUSE_MODES


def parse_abort(body: Any) -> tuple[str | None, bool]:
    """``/abort_request`` body ``{"rid": str, "abort_all": bool}`` -> ``(rid, abort_all)``.

    Raises:
        ProtocolError: neither a non-empty ``rid`` nor ``abort_all: true``; wrong types.
    """
    body = _want_object("body", body if body is not None else {})
    _check_keys("abort_request", body, {"rid", "abort_all", "finished_reason", "aborted_message"})
    rid = body.get("rid")
    abort_all = _opt_bool(body, "abort_all")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("rid must be a string")
    if not abort_all and not rid:
        raise ProtocolError("give a rid or abort_all: true")
    return (rid or None), abort_all


def parse_pause(body: Any) -> str:
    """``/pause_generation`` body ``{"mode": "abort" | "in_place" | "retract"}`` (default ``abort``)."""
    body = _want_object("body", body if body is not None else {})
    _check_keys("pause_generation", body, {"mode"})
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise ProtocolError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}"[:300])
    return mode


def parse_tags(body: Any, name: str) -> tuple[str, ...]:
    """``{"tags": ["weights", "kv_cache"]}`` (null or absent = all of :data:`MEMORY_TAGS`) -> the tag tuple."""
    body = _want_object("body", body if body is not None else {})
    _check_keys(name, body, {"tags", "cpu_backup_tags"})
    tags = body.get("tags")
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, list) or not tags or not all(t in MEMORY_TAGS for t in tags):
        raise ProtocolError(f"tags must be a non-empty list drawn from {', '.join(MEMORY_TAGS)}")
    return tuple(t for t in MEMORY_TAGS if t in tags)


@dataclass(slots=True)
class WeightUpdate:
    """A parsed weight-update body (``/update_weights_from_disk`` or ``_from_tensor``).

    ``source`` is the model path (disk) or the list of serialized payloads (tensor).
    ``weight_version`` ``None`` keeps the current version string (SGLang behaviour).
    """

    source: Any
    load_format: str | None
    weight_version: str | None
    abort_all_requests: bool
    flush_cache: bool


def _parse_update_common(body: dict) -> tuple[str | None, bool, bool, str | None]:
    wv = body.get("weight_version")
    if wv is not None and not isinstance(wv, str):
        raise ProtocolError("weight_version must be a string")
    lf = body.get("load_format")
    if lf is not None and not isinstance(lf, str):
        raise ProtocolError("load_format must be a string")
    flush = body.get("flush_cache")
    return (wv, _opt_bool(body, "abort_all_requests"),
            True if flush is None else _want_bool("flush_cache", flush), lf)


def parse_update_from_disk(body: Any) -> WeightUpdate:
    """``/update_weights_from_disk`` body: ``model_path`` (dir or ``.safetensors`` file), ..."""
    body = _want_object("body", body)
    _check_keys("update_weights_from_disk", body, {"model_path", "load_format", "abort_all_requests",
                                                   "weight_version", "flush_cache", "torch_empty_cache",
                                                   "keep_pause", "recapture_cuda_graph", "token_step",
                                                   "is_async"})
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise ProtocolError("model_path must be a non-empty string")
    wv, abort, flush, lf = _parse_update_common(body)
    return WeightUpdate(path, lf, wv, abort, flush)


def parse_update_from_tensor(body: Any) -> WeightUpdate:
    """``/update_weights_from_tensor`` body: ``serialized_named_tensors`` (list of base64 strings)."""
    body = _want_object("body", body)
    _check_keys("update_weights_from_tensor", body, {"serialized_named_tensors", "load_format",
                                                     "flush_cache", "abort_all_requests", "weight_version",
                                                     "disable_draft_model", "torch_empty_cache"})
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) and p for p in payloads):
        raise ProtocolError("serialized_named_tensors must be a non-empty list of base64 strings")
    wv, abort, flush, lf = _parse_update_common(body)
    return WeightUpdate(payloads, lf, wv, abort, flush)


def parse_update_weight_version(body: Any) -> tuple[str, bool]:
    """``/update_weight_version`` body ``{"new_version": str, "abort_all_requests": bool}``."""
    body = _want_object("body", body)
    _check_keys("update_weight_version", body, {"new_version", "abort_all_requests"})
    v = body.get("new_version")
    if not isinstance(v, str) or not v:
        raise ProtocolError("new_version must be a non-empty string")
    return v, _opt_bool(body, "abort_all_requests")


@dataclass(frozen=True)
class WeightGroupSpec:
    """A parsed ``/init_weights_update_group`` body: the trainer (rank 0) and the engines' ranks
    meet at ``master_address:master_port``; this engine's rank is ``rank_offset``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


def parse_init_weights_update_group(body: Any) -> WeightGroupSpec:
    """``/init_weights_update_group`` body (SGLang's fields)."""
    body = _want_object("body", body)
    _check_keys("init_weights_update_group", body, {"master_address", "master_port", "rank_offset", "world_size",
                                                    "group_name", "backend"})
    addr = body.get("master_address")
    if not isinstance(addr, str) or not addr:
        raise ProtocolError("master_address must be a non-empty string")
    world = _want_int("world_size", body.get("world_size"), 2)
    rank = _want_int("rank_offset", body.get("rank_offset"), 1, world - 1)
    name = body.get("group_name", "weight_update_group")
    if not isinstance(name, str) or not name:
        raise ProtocolError("group_name must be a non-empty string")
    backend = body.get("backend", "nccl")
    if backend not in ("nccl", "gloo"):
        raise ProtocolError(f"backend must be 'nccl' or 'gloo', not {backend!r}")
    port = _want_int("master_port", body.get("master_port"), 1, 65535)
    return WeightGroupSpec(addr, port, rank, world, name, backend)


@dataclass(frozen=True)
class DistributedUpdate:
    """A parsed ``/update_weights_from_distributed`` body: the tensors rank 0 of ``group_name`` is
    about to broadcast, in order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    group_name: str
    update: WeightUpdate


def parse_update_from_distributed(body: Any) -> DistributedUpdate:
    """``/update_weights_from_distributed`` body: ``names``, ``dtypes`` (torch dtype names),
    ``shapes`` (lists of non-negative ints), all of one length, and ``group_name``."""
    import torch

    body = _want_object("body", body)
    _check_keys("update_weights_from_distributed", body, {"names", "dtypes", "shapes", "group_name", "load_format",
                                                          "flush_cache", "abort_all_requests", "weight_version"})
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ProtocolError("names must be a non-empty list of strings")
    if not isinstance(dtypes, list) or len(dtypes) != len(names):
        raise ProtocolError(f"dtypes must be a list of {len(names)} dtype names (one per name)")
    for d in dtypes:
        if not isinstance(d, str) or not isinstance(getattr(torch, d.removeprefix("torch."), None), torch.dtype):
            raise ProtocolError(f"dtypes: {d!r} is not a torch dtype name")
    if not isinstance(shapes, list) or len(shapes) != len(names) or not all(
            isinstance(s, list) and all(_is_int(x) and x >= 0 for x in s) for s in shapes):
        raise ProtocolError(f"shapes must be a list of {len(names)} lists of non-negative integers")
    group = body.get("group_name", "weight_update_group")
    if not isinstance(group, str) or not group:
        raise ProtocolError("group_name must be a non-empty string")
    wv, abort, flush, lf = _parse_update_common(body)
    return DistributedUpdate(list(names), [d.removeprefix("torch.") for d in dtypes], [tuple(s) for s in shapes],
                             group, WeightUpdate(None, lf, wv, abort, flush))


def parse_destroy_weights_update_group(body: Any) -> str:
    """``/destroy_weights_update_group`` body ``{"group_name"}``."""
    body = _want_object("body", body)
    _check_keys("destroy_weights_update_group", body, {"group_name"})
    group = body.get("group_name", "weight_update_group")
    if not isinstance(group, str) or not group:
        raise ProtocolError("group_name must be a non-empty string")
    return group
