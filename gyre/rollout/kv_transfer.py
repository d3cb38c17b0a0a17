"""KV payloads: the KV cache of a token prefix, as bytes that another engine can import.

A payload is a `safetensors <https://huggingface.co/docs/safetensors>`_ file in memory: one tensor
``kv`` (``[layers, 2, kv_heads, tokens, head_dim]``, the embedded engine's layout) and metadata
naming what it is valid for: the ``weight_version`` that computed it, the ``token_ids`` it
covers and the ``layout`` (layers, KV heads, head dimension, dtype).  An engine imports a
payload only when both match its own (:class:`KVPayloadError` otherwise): KV computed under
other weights is never used.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch


class KVPayloadError(ValueError):
    """A KV payload that is malformed, or does not fit the engine (other weights or layout)."""


@dataclass(frozen=True)
class KVPayload:
    """A decoded payload; ``kv`` covers ``token_ids`` (``kv.shape[3] == len(token_ids)``)."""

    token_ids: list[int]
    weight_version: str
    layout: dict
    kv: torch.Tensor


def kv_layout(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """The layout fields a payload must match."""
    return {"num_layers": int(num_layers), "num_kv_heads": int(num_kv_heads), "head_dim": int(head_dim),
            "dtype": str(dtype).removeprefix("torch.")}


def encode_kv_payload(kv: torch.Tensor, token_ids: list[int], weight_version: str, layout: dict) -> bytes:
    """Payload bytes of ``kv`` for ``token_ids`` computed under ``weight_version``."""
    from safetensors.torch import save

    if kv.shape[3] != len(token_ids):
        raise KVPayloadError(f"KV covers {kv.shape[3]} tokens, not {len(token_ids)}")
    meta = {"format": "gyre-kv-1", "weight_version": str(weight_version), "token_ids": json.dumps(token_ids),
            "layout": json.dumps(layout, sort_keys=True)}
    return save({"kv": kv.contiguous()}, metadata=meta)


def decode_kv_payload(data: bytes) -> KVPayload:
    """Parse payload bytes.

    Raises:
        KVPayloadError: not a Gyre KV payload, or its fields disagree with each other.
    """
    from safetensors.torch import load

    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + n])["__metadata__"]
        if meta.get("format") != "gyre-kv-1":
            raise KVPayloadError(f"unknown KV payload format {meta.get('format')!r}")
        token_ids = [int(t) for t in json.loads(meta["token_ids"])]
        layout = json.loads(meta["layout"])
        kv = load(data)["kv"]
    except KVPayloadError:
        raise
    except Exception as exc:  # truncated bytes, bad JSON, missing fields, safetensors errors
        raise KVPayloadError(f"not a KV payload: {type(exc).__name__}: {exc}") from None
    expect = (layout.get("num_layers"), 2, layout.get("num_kv_heads"), len(token_ids), layout.get("head_dim"))
    if tuple(kv.shape) != expect or str(kv.dtype).removeprefix("torch.") != layout.get("dtype"):
        raise KVPayloadError(f"KV tensor {tuple(kv.shape)} {kv.dtype} does not match its layout {layout} "
                             f"for {len(token_ids)} tokens")
    return KVPayload(token_ids, str(meta["weight_version"]), layout, kv)


def check_fits(payload: KVPayload, weight_version: str, layout: dict) -> None:
    """Raise :class:`KVPayloadError` unless ``payload`` was computed under ``weight_version`` for
    ``layout``."""
    if payload.weight_version != weight_version:
        raise KVPayloadError(f"KV payload of weight version {payload.weight_version!r}; this engine serves "
                             f"{weight_version!r}")
    if payload.layout != layout:
        raise KVPayloadError(f"KV payload layout {payload.layout} does not match this engine's {layout}")
