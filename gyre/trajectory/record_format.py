"""The ``gyre-tito/1`` line format of record files (:mod:`gyre.trajectory.store`).

A record is one CRC-checked JSON line whose token arrays are base64 bytes and whose input is
delta-encoded against a recent earlier record of the same file (:func:`encode_record`); a
*delivery mark* line (:func:`encode_delivery_mark`) marks an earlier record delivered.
:class:`DeltaRing` is the set of recent records a line may reference, evolved identically by the
writer and the reader; :func:`parse_line` and :func:`decode_record` read a line back.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections import OrderedDict
from typing import Any

import numpy as np

from gyre.common_prefix import common_prefix_len
from gyre.trajectory.records import RequestRecord

__all__ = ["FORMAT_VERSION", "DeltaRing", "RingEntry", "DeliveryMark", "encode_record", "encode_delivery_mark",
           "parse_line", "decode_record"]

FORMAT_VERSION = 1
_CRC_KEY = b',"crc":'


def _b64(arr: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=dtype).tobytes()).decode("ascii")


def _unb64(s: str, dtype: str, native: type) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s, validate=True), dtype=dtype).astype(native)


class RingEntry:
    """One record of a :class:`DeltaRing`: its token arrays, provenance and lengths."""

    __slots__ = ("seq", "input_ids", "output_ids", "input_provenance", "out_prov", "n_in", "length")

    def __init__(self, seq: int, rec: RequestRecord) -> None:
        self.seq = seq
        self.input_ids = rec.input_ids
        self.output_ids = rec.output_ids
        self.input_provenance = rec.input_provenance
        self.out_prov = rec.output_provenance_value()
        self.n_in = rec.num_input_tokens
        self.length = rec.num_input_tokens + rec.num_output_tokens

    def common_prefix(self, ids: np.ndarray, prov: np.ndarray) -> int:
        """Common prefix of (ids, prov) with (input ++ output, in_prov ++ out_prov)."""
        p = common_prefix_len(ids, self.input_ids)
        q = common_prefix_len(prov[:p], self.input_provenance[:p])
        if q < p:
            return q
        if p == self.n_in and p < ids.shape[0]:
            t = common_prefix_len(ids[p:], self.output_ids)
            run = prov[p:p + t]
            t = min(t, common_prefix_len(run, np.broadcast_to(self.out_prov, run.shape)))
            p += t
        return p

    def prefix(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` tokens of ``input ++ output`` and their provenance."""
        if n <= self.n_in:
            return self.input_ids[:n], self.input_provenance[:n]
        k = n - self.n_in
        return (
            np.concatenate([self.input_ids, self.output_ids[:k]]),
            np.concatenate([self.input_provenance, np.full(k, self.out_prov, np.int8)]),
        )


class DeltaRing:
    """The delta-encoding reference set, evolved identically by writer and reader.

    Holds up to ``size`` recent records. A record whose base covers a ring entry's whole
    input (it continues that entry's thread) replaces the entry; otherwise the oldest entry
    is evicted when full. So one long thread (the main agent) keeps its slot while
    sub-agents run.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[int, RingEntry] = OrderedDict()

    def best_base(self, rec: RequestRecord) -> tuple[int, int]:
        """``(seq, n)`` of the entry sharing the longest (ids, provenance) prefix; ``n`` may be 0."""
        best_seq, best_n = -1, 0
        ids, prov = rec.input_ids, rec.input_provenance
        for e in sorted(self.entries.values(), key=lambda e: (e.length, e.seq), reverse=True):
            if e.length <= best_n:
                break
            p = e.common_prefix(ids, prov)
            if p > best_n:
                best_seq, best_n = e.seq, p
        return best_seq, best_n

    def prefix(self, seq: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` tokens (and provenance) of the entry of line ``seq``; ``ValueError`` if
        that is not a recent record or ``n`` is out of its range."""
        e = self.entries.get(seq)
        if e is None or n <= 0 or n > e.length:
            raise ValueError(f"base {[seq, n]} does not reference a recent record")
        return e.prefix(n)

    def add(self, seq: int, rec: RequestRecord, base: tuple[int, int] | None) -> None:
        """Enter the record of line ``seq`` (delta-encoded against ``base``)."""
        if base is not None:
            e = self.entries.get(base[0])
            if e is not None and base[1] >= e.n_in:
                del self.entries[base[0]]
        self.entries[seq] = RingEntry(seq, rec)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


def encode_record(rec: RequestRecord, seq: int, base: tuple[int, int] | None) -> bytes:
    """One line (with trailing newline) of the ``gyre-tito/1`` format for ``rec``.

    The line is a JSON object (ASCII, no spaces) ending in ``,"crc":<crc32>}``, the CRC-32
    covering the line's bytes with that suffix replaced by ``}``.  Token arrays are base64 of
    little-endian ``int32``/``int8``/``float32`` bytes.  ``base`` is ``(seq, n)`` or ``None``:
    the first ``n`` input tokens *and* their provenance equal the first ``n`` entries of
    ``input ++ output`` (provenance ``input_provenance ++ output provenance``) of the record
    on line ``seq``, so only the remaining input (``"input_tail"``, ``"prov_tail"``) is stored.
    Fields: ``v, seq, execution_id, call_index, role, policy_version, engine_id, delivered,
    finish_reason, timings, metadata, n_in, base, input_tail, prov_tail, output_ids,
    output_logprobs, crc``.
    """
    n = base[1] if base else 0
    payload: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "seq": seq,
        "execution_id": rec.execution_id,
        "call_index": rec.call_index,
        "role": rec.role,
        "policy_version": rec.policy_version,
        "engine_id": rec.engine_id,
        "delivered": rec.delivered,
        "finish_reason": rec.finish_reason,
        "timings": rec.timings,
        "metadata": rec.metadata,
        "n_in": rec.num_input_tokens,
        "base": list(base) if base else None,
        "input_tail": _b64(rec.input_ids[n:], "<i4"),
        "prov_tail": _b64(rec.input_provenance[n:], "i1"),
        "output_ids": _b64(rec.output_ids, "<i4"),
        "output_logprobs": _b64(rec.output_logprobs, "<f4"),
    }
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    crc = zlib.crc32(body)
    return body[:-1] + _CRC_KEY + str(crc).encode("ascii") + b"}\n"


def encode_delivery_mark(execution_id: str, call_index: int) -> bytes:
    """One delivery-mark line (with trailing newline): ``{"v", "mark": "delivered",
    "execution_id", "call_index", "crc"}``, CRC-checked like a record line. It takes no ``seq``:
    records keep their numbering (and their delta bases) whatever marks lie between them."""
    payload = {"v": FORMAT_VERSION, "mark": "delivered", "execution_id": execution_id, "call_index": int(call_index)}
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return body[:-1] + _CRC_KEY + str(zlib.crc32(body)).encode("ascii") + b"}\n"


class DeliveryMark(int):
    """What :func:`~gyre.trajectory.store.scan_file` yields for a delivery-mark line: the marked record's call index."""


def parse_line(line: bytes) -> dict[str, Any]:
    """Validate CRC and parse one line (without newline). Raises ``ValueError``."""
    idx = line.rfind(_CRC_KEY)
    if idx < 0 or not line.endswith(b"}"):
        raise ValueError("no crc field")
    body = line[:idx] + b"}"
    try:
        crc = int(line[idx + len(_CRC_KEY):-1])
    except ValueError as e:
        raise ValueError("bad crc field") from e
    if zlib.crc32(body) != crc:
        raise ValueError("crc mismatch")
    obj = json.loads(body)
    if not isinstance(obj, dict) or obj.get("v") != FORMAT_VERSION:
        raise ValueError(f"unsupported format version {obj.get('v') if isinstance(obj, dict) else None!r}")
    return obj


def decode_record(obj: dict[str, Any], ring: DeltaRing,
                  expected_seq: int) -> tuple[RequestRecord, tuple[int, int] | None]:
    """The record of a parsed record line (:func:`parse_line`) and its base; ``ring`` holds the
    records it may be delta-encoded against. Raises ``KeyError``, ``TypeError`` or ``ValueError``."""
    if obj["seq"] != expected_seq:
        raise ValueError(f"seq {obj['seq']} where {expected_seq} expected")
    tail = _unb64(obj["input_tail"], "<i4", np.int32)
    ptail = _unb64(obj["prov_tail"], "i1", np.int8)
    base = obj["base"]
    if base:
        bseq, n = int(base[0]), int(base[1])
        head_ids, head_prov = ring.prefix(bseq, n)
        ids = np.concatenate([head_ids, tail])
        prov = np.concatenate([head_prov, ptail])
        base = (bseq, n)
    else:
        ids, prov, base = tail, ptail, None
    if ids.shape[0] != obj["n_in"]:
        raise ValueError(f"decoded {ids.shape[0]} input tokens, header says {obj['n_in']}")
    rec = RequestRecord(
        execution_id=obj["execution_id"],
        call_index=obj["call_index"],
        role=obj["role"],
        input_ids=ids,
        output_ids=_unb64(obj["output_ids"], "<i4", np.int32),
        output_logprobs=_unb64(obj["output_logprobs"], "<f4", np.float32),
        input_provenance=prov,
        policy_version=obj["policy_version"],
        engine_id=obj["engine_id"],
        delivered=obj["delivered"],
        timings=obj["timings"],
        finish_reason=obj["finish_reason"],
        metadata=obj["metadata"],
    )
    return rec, base
