"""KV payloads: the KV cache of a token prefix, as bytes that another engine can import.

A payload is a `safetensors <https://huggingface.co/docs/safetensors>`_ file in memory: one tensor
``kv`` (``[layers, 2, kv_heads, tokens, head_dim]``, the embedded engine's layout) and metadata
naming what it is valid for: the ``weight_version`` that computed it, the ``token_ids`` it
covers and the ``layout`` (layers, KV heads, head dimension, dtype).  An engine imports a
payload only when both match its own (:class:`KVPayloadError` otherwise): KV computed under
other weights is never used.

Payload bytes move between engines either through the caller (HTTP: export returns them, import
takes them) or engine to engine over Mooncake (:class:`MooncakeKVStage`): the source stages the
payload in registered memory and pins it, the destination reads it with a one-sided read, and the
source drops the pin when told (``release``) or once ``pin_timeout_s`` has passed.
"""

from __future__ import annotations

import itertools
import json
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

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
    return save({"kv": kv.detach().to("cpu").contiguous()}, metadata=meta)


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


_HANDLE_FIELDS = {"session_id": str, "addr": int, "nbytes": int, "pin": int}
#: The largest payload a destination reads (64 GiB: a 1M-token context of a large model).
MAX_PAYLOAD_BYTES = 64 << 30


def check_handle(handle: object) -> dict:
    """``handle`` as a valid Mooncake staging handle (:meth:`MooncakeKVStage.stage`).

    Raises:
        KVPayloadError: not an object with ``session_id`` (str), ``addr``, ``nbytes`` (> 0) and
            ``pin`` (ints).
    """
    if not isinstance(handle, dict) or any(type(handle.get(k)) is not t for k, t in _HANDLE_FIELDS.items()) \
            or handle["nbytes"] <= 0 or handle["addr"] <= 0:
        raise KVPayloadError("mooncake must be {\"session_id\": str, \"addr\": int > 0, \"nbytes\": int > 0, "
                             "\"pin\": int}")
    if handle["nbytes"] > MAX_PAYLOAD_BYTES:
        raise KVPayloadError(f"a KV payload of {handle['nbytes']} bytes is over the limit of {MAX_PAYLOAD_BYTES}")
    return {k: handle[k] for k in _HANDLE_FIELDS}


class MooncakeKVStage:
    """One engine's side of engine-to-engine KV copies over a Mooncake transfer engine.

    As a source, :meth:`stage` copies payload bytes into registered host memory and pins them
    until :meth:`release` (or ``pin_timeout_s`` later, checked on every call); as a destination,
    :meth:`fetch` reads a staged payload from another engine.  The transfer engine starts on first
    use, bound to ``host``.  Thread-safe.

    Args:
        host: the address the transfer engine binds and peers reach.
        pin_timeout_s: a pin nobody released is dropped after this long.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, host: str = "127.0.0.1", *, pin_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.host = host
        self.pin_timeout_s = float(pin_timeout_s)
        self._clock = clock
        self._engine = None
        self._pins: dict[int, tuple[torch.Tensor, float]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _transfer_engine(self):
        from gyre.transfer_engine import start_transfer_engine

        with self._lock:
            if self._engine is None:
                self._engine = start_transfer_engine(self.host)
            return self._engine

    @property
    def pinned(self) -> list[int]:
        """Pins held now (after dropping expired ones)."""
        self._expire()
        with self._lock:
            return sorted(self._pins)

    def _expire(self) -> None:
        now = self._clock()
        with self._lock:
            old = [p for p, (_, deadline) in self._pins.items() if deadline <= now]
            bufs = [self._pins.pop(p)[0] for p in old]
        for buf in bufs:
            self._engine.unregister_memory(buf.data_ptr())

    def stage(self, data: bytes) -> dict:
        """Pin ``data`` in registered memory; return the handle a destination :meth:`fetch` es.

        Raises:
            TransferEngineError: Mooncake is unavailable or refused the memory.
        """
        from gyre.transfer_engine import register

        self._expire()
        engine = self._transfer_engine()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        register(engine, buf)
        with self._lock:
            pin = next(self._ids)
            self._pins[pin] = (buf, self._clock() + self.pin_timeout_s)
        return {"session_id": f"{self.host}:{engine.get_rpc_port()}", "addr": buf.data_ptr(),
                "nbytes": buf.numel(), "pin": pin}

    def release(self, pin: int) -> bool:
        """Drop pin ``pin``; False when it is unknown (released or expired already)."""
        self._expire()
        with self._lock:
            entry = self._pins.pop(int(pin), None)
        if entry is not None:
            self._engine.unregister_memory(entry[0].data_ptr())
        return entry is not None

    def fetch(self, handle: dict) -> bytes:
        """Read the payload ``handle`` names from its engine.

        Raises:
            KVPayloadError: a malformed handle.
            TransferEngineError: the read failed (peer gone, pin released, bad address).
        """
        from gyre.transfer_engine import TransferEngineError, register

        handle = check_handle(handle)
        engine = self._transfer_engine()
        try:
            buf = torch.empty(handle["nbytes"], dtype=torch.uint8)
        except RuntimeError as exc:  # the host cannot hold it
            raise TransferEngineError(f"cannot allocate {handle['nbytes']} bytes for a KV payload: {exc}") from None
        register(engine, buf)
        try:
            rc = engine.transfer_sync_read(handle["session_id"], buf.data_ptr(), handle["addr"], handle["nbytes"])
        except (TypeError, ValueError, OverflowError) as exc:  # arguments Mooncake's binding refuses
            raise TransferEngineError(f"reading from {handle['session_id']} failed: {exc}") from None
        finally:
            engine.unregister_memory(buf.data_ptr())
        if rc != 0:
            raise TransferEngineError(f"reading {handle['nbytes']} bytes from {handle['session_id']} failed: rc={rc}")
        return buf.numpy().tobytes()
