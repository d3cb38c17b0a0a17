"""Durable, append-only storage of request records; trees rebuilt bit-identically.

One file per execution, ``<root>/<execution_id>.jsonl``, one record per line in insertion
order, in the ``gyre-tito/1`` format (:func:`encode_record`): a CRC-checked JSON line whose
token arrays are base64 bytes and whose input is delta-encoded against a recent earlier record,
so a file grows with the new tokens of each call, not with its context length.

:class:`RecordWriter` appends (flushed to the OS before returning, ``fsync`` per its policy);
:func:`read_records` and :func:`load_tree` read a file back and rebuild the execution's
:class:`~gyre.trajectory.tree.TrajectoryTree`; :class:`TrajectoryStore` manages one writer per
execution under a root directory.  A crash can leave a torn final line (partial write, or
garbage after the last newline): readers detect it (missing newline, bad JSON or CRC) *only
at the end of the file*, skip it and emit a :class:`TornTailWarning`; a writer reopening the
file truncates it first.  A bad line followed by good ones is corruption and raises
:class:`StoreCorruptError`.

A record stored as undelivered whose answer later reached the harness (a client retry got it)
is marked by a *delivery mark* line (:func:`encode_delivery_mark`, :meth:`RecordWriter.mark_delivered`)
appended after it: the file stays append-only.  :func:`read_records` returns such a record with
``delivered=True``; :func:`load_tree` applies the mark to the tree where it stands in the file
(:meth:`~gyre.trajectory.tree.TrajectoryTree.mark_delivered`), as the live tree did, so the
rebuilt tree stays bit-identical.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import warnings
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gyre.common_prefix import common_prefix_len
from gyre.trajectory.records import EXECUTION_ID_RE, RequestRecord
from gyre.trajectory.tree import TrajectoryTree

__all__ = [
    "FORMAT_VERSION",
    "TornTailWarning",
    "StoreCorruptError",
    "RecordWriter",
    "TrajectoryStore",
    "read_records",
    "load_tree",
    "encode_record",
    "encode_delivery_mark",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_CRC_KEY = b',"crc":'


class TornTailWarning(RuntimeWarning):
    """A torn final line was found in a record file and skipped."""


class StoreCorruptError(ValueError):
    """A record file is corrupt beyond a torn final line (bad line in the middle, bad base)."""


def _b64(arr: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=dtype).tobytes()).decode("ascii")


def _unb64(s: str, dtype: str, native: type) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s, validate=True), dtype=dtype).astype(native)


class _RingEntry:
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
        if n <= self.n_in:
            return self.input_ids[:n], self.input_provenance[:n]
        k = n - self.n_in
        return (
            np.concatenate([self.input_ids, self.output_ids[:k]]),
            np.concatenate([self.input_provenance, np.full(k, self.out_prov, np.int8)]),
        )


class _Ring:
    """The delta-encoding reference set, evolved identically by writer and reader.

    Holds up to ``size`` recent records. A record whose base covers a ring entry's whole
    input (it continues that entry's thread) replaces the entry; otherwise the oldest entry
    is evicted when full. So one long thread (the main agent) keeps its slot while
    sub-agents run.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[int, _RingEntry] = OrderedDict()

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
        e = self.entries.get(seq)
        if e is None or n <= 0 or n > e.length:
            raise ValueError(f"base {[seq, n]} does not reference a recent record")
        return e.prefix(n)

    def add(self, seq: int, rec: RequestRecord, base: tuple[int, int] | None) -> None:
        if base is not None:
            e = self.entries.get(base[0])
            if e is not None and base[1] >= e.n_in:
                del self.entries[base[0]]
        self.entries[seq] = _RingEntry(seq, rec)
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
    """What :func:`_scan` yields for a delivery-mark line: the marked record's call index."""


def _parse_line(line: bytes) -> dict[str, Any]:
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


class _ScanState:
    """What :func:`_scan` learnt: records decoded, lines read (records and marks), end of the last
    good line, torn tail, ring."""

    __slots__ = ("count", "lines", "good_end", "torn", "ring")

    def __init__(self, ring_size: int) -> None:
        self.count = 0
        self.lines = 0
        self.good_end = 0
        self.torn = False
        self.ring = _Ring(ring_size)


def _scan(path: Path, state: _ScanState, calls: set[int] | None = None) -> Iterator[RequestRecord | DeliveryMark]:
    """Decode a record file lazily, one line at a time, filling ``state``: each record, and a
    :class:`DeliveryMark` for each delivery-mark line.

    Raises:
        StoreCorruptError: a bad line before the end, a bad base reference, a seq gap, or a mark
            of a call index no earlier line recorded.
    """
    calls = set() if calls is None else calls
    data = path.read_bytes()
    ring = state.ring
    pos = 0
    lineno = 0
    size = len(data)
    while pos < size:
        nl = data.find(b"\n", pos)
        line_end = size if nl < 0 else nl
        line = data[pos:line_end]
        lineno += 1
        try:
            if nl < 0:
                raise ValueError("missing newline")
            obj = _parse_line(line)
        except ValueError as e:
            rest = data[line_end + 1:] if nl >= 0 else b""
            if _has_valid_line(rest):
                raise StoreCorruptError(f"{path}:{lineno}: corrupt record line ({e})") from e
            state.torn = True
            msg = f"{path}:{lineno}: torn final record ({e}); skipped {size - pos} bytes"
            logger.warning(msg)
            warnings.warn(msg, TornTailWarning, stacklevel=2)
            break
        if "mark" in obj:
            ci = obj.get("call_index")
            if obj["mark"] != "delivered" or ci not in calls:
                raise StoreCorruptError(f"{path}:{lineno}: bad delivery mark {obj['mark']!r} of call {ci!r}")
            item: RequestRecord | DeliveryMark = DeliveryMark(ci)
        else:
            try:
                rec, base = _decode(obj, ring, state.count)
            except (KeyError, TypeError, ValueError) as e:
                raise StoreCorruptError(f"{path}:{lineno}: bad record ({e})") from e
            ring.add(state.count, rec, base)
            state.count += 1
            calls.add(rec.call_index)
            item = rec
        state.lines += 1
        pos = line_end + 1
        state.good_end = pos
        yield item


def _has_valid_line(data: bytes) -> bool:
    for line in data.split(b"\n")[:-1]:
        try:
            _parse_line(line)
            return True
        except ValueError:
            continue
    return False


def _decode(obj: dict[str, Any], ring: _Ring, expected_seq: int) -> tuple[RequestRecord, tuple[int, int] | None]:
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


def read_records(path: str | os.PathLike[str], *, ring_size: int = 8) -> list[RequestRecord]:
    """All records of one record file, in append order; a record that a later delivery mark
    names has ``delivered=True``.

    A torn final line is skipped with a :class:`TornTailWarning` (and a log warning).

    Raises:
        FileNotFoundError: no such file.
        StoreCorruptError: corruption other than a torn final line.
    """
    out: list[RequestRecord] = []
    by_call: dict[int, RequestRecord] = {}
    for item in _scan(Path(path), _ScanState(ring_size)):
        if isinstance(item, DeliveryMark):
            by_call[int(item)].delivered = True
        else:
            out.append(item)
            by_call[item.call_index] = item
    return out


def load_tree(path: str | os.PathLike[str], *, anchor_slots: int = 8, ring_size: int = 8,
              lines: int | None = None) -> TrajectoryTree:
    """Rebuild the trajectory tree of one record file by inserting its records in order and
    applying each delivery mark where it stands.

    The result is bit-identical (:meth:`TrajectoryTree.digest`) to the tree built live from
    the same records and marks with the same ``anchor_slots``. ``lines``: read only the first
    that many lines (records and marks; :attr:`TrajectoryTree.num_entries` of a live tree says
    how many it has applied). Raises as :func:`read_records`.
    """
    tree = TrajectoryTree(anchor_slots=anchor_slots)
    state = _ScanState(ring_size)
    for item in _scan(Path(path), state):  # streamed: O(ring) records in memory
        if lines is not None and state.lines > lines:
            break
        if isinstance(item, DeliveryMark):
            tree.mark_delivered(int(item))
        else:
            tree.insert(item)
    return tree


class RecordWriter:
    """Append-only writer of one execution's record file.

    :meth:`append` writes the whole line with one ``write`` and flushes it to the OS before
    returning, so a crash of the process loses no appended record.  It calls ``os.fsync``
    every ``fsync_every`` records (default 1: every record, so a machine crash loses nothing
    appended either; ``0``: only on :meth:`close`) and always on close.

    Args:
        path: the file; created if missing. An existing file is scanned (its records
            seed the delta-encoding ring) and a torn final line is truncated away.
        fsync_every: ``os.fsync`` after every this many appended records (0 = only on close).
        ring_size: how many recent records a new record may be delta-encoded against.

    Raises:
        ValueError: ``fsync_every < 0`` or ``ring_size < 1``.
        StoreCorruptError: the existing file is corrupt (see :func:`read_records`).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync_every: int = 1, ring_size: int = 8) -> None:
        if fsync_every < 0 or ring_size < 1:
            raise ValueError("fsync_every must be >= 0 and ring_size >= 1")
        self.path = Path(path)
        self.fsync_every = int(fsync_every)
        self.ring_size = int(ring_size)
        self._ring = _Ring(ring_size)
        self._seq = 0
        self._since_sync = 0
        self._calls: set[int] = set()
        self.execution_id: str | None = None
        if self.path.exists():
            state = _ScanState(ring_size)
            for item in _scan(self.path, state):
                if isinstance(item, RequestRecord):
                    self.execution_id = item.execution_id
                    self._calls.add(item.call_index)
            if state.torn:
                with open(self.path, "r+b") as f:
                    f.truncate(state.good_end)
                    f.flush()
                    os.fsync(f.fileno())
            self._ring = state.ring  # evolved exactly as the reader evolves it
            self._seq = state.count
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: Any = open(self.path, "ab")
        self._closed = False


    @property
    def num_records(self) -> int:
        """Records in the file."""
        return self._seq

    def append(self, record: RequestRecord) -> int:
        """Append ``record`` durably (per the fsync policy); return its line number (seq).

        Raises:
            ValueError: closed writer, a record of another execution, or a duplicate
                ``call_index``.
        """
        if self._closed:
            raise ValueError(f"writer for {self.path} is closed")
        if self._f is None:
            self._f = open(self.path, "ab")
        if self.execution_id is not None and record.execution_id != self.execution_id:
            raise ValueError(f"record of {record.execution_id!r} appended to file of {self.execution_id!r}")
        if record.call_index in self._calls:
            raise ValueError(f"duplicate call_index {record.call_index} for {record.execution_id!r}")
        bseq, n = self._ring.best_base(record)
        base = (bseq, n) if n > 0 else None
        line = encode_record(record, self._seq, base)
        self._f.write(line)
        self._f.flush()
        self._since_sync += 1
        if self.fsync_every and self._since_sync >= self.fsync_every:
            os.fsync(self._f.fileno())
            self._since_sync = 0
        seq = self._seq
        self._ring.add(seq, record, base)
        self.execution_id = record.execution_id
        self._calls.add(record.call_index)
        self._seq += 1
        return seq

    def mark_delivered(self, call_index: int) -> None:
        """Append a delivery mark of record ``call_index`` (flushed; fsynced per the policy).

        Raises:
            ValueError: closed writer, or no record ``call_index`` in the file.
        """
        if self._closed:
            raise ValueError(f"writer for {self.path} is closed")
        if call_index not in self._calls or self.execution_id is None:
            raise ValueError(f"no record {call_index} in {self.path}")
        if self._f is None:
            self._f = open(self.path, "ab")
        self._f.write(encode_delivery_mark(self.execution_id, call_index))
        self._f.flush()
        self._since_sync += 1
        if self.fsync_every and self._since_sync >= self.fsync_every:
            os.fsync(self._f.fileno())
            self._since_sync = 0

    def sync(self) -> None:
        """Flush and ``os.fsync`` now."""
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._since_sync = 0

    @property
    def is_open(self) -> bool:
        """Whether the file descriptor is currently open."""
        return self._f is not None

    def suspend(self) -> None:
        """Flush, fsync and close the file descriptor, keeping the writer usable (the next
        :meth:`append` reopens it without rescanning the file)."""
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None

    def close(self) -> None:
        """Flush, fsync and close (idempotent); later appends raise ``ValueError``."""
        self.suspend()
        self._closed = True

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrajectoryStore:
    """A directory of per-execution record files (``<root>/<execution_id>.jsonl``).

    Args:
        root: directory (created if missing).
        fsync_every: passed to each :class:`RecordWriter`.
        max_open: open file descriptors kept at most; the least recently used writer is
            suspended (fsync'd and its descriptor closed; its in-memory state kept) when
            exceeded and reopens on its next append.
    """

    SUFFIX = ".jsonl"

    def __init__(self, root: str | os.PathLike[str], *, fsync_every: int = 1, max_open: int = 128) -> None:
        if max_open < 1:
            raise ValueError("max_open must be >= 1")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsync_every = fsync_every
        self.max_open = max_open
        self._writers: dict[str, RecordWriter] = {}
        self._open: OrderedDict[str, None] = OrderedDict()

    def path(self, execution_id: str) -> Path:
        """File of ``execution_id``. Raises ``ValueError`` for an unsafe id."""
        if not EXECUTION_ID_RE.match(execution_id):
            raise ValueError(f"bad execution_id {execution_id!r}")
        return self.root / f"{execution_id}{self.SUFFIX}"

    def append(self, record: RequestRecord) -> int:
        """Append ``record`` to its execution's file; return its seq. Raises as :meth:`RecordWriter.append`."""
        eid = record.execution_id
        w = self._writers.get(eid)
        if w is None:
            w = RecordWriter(self.path(eid), fsync_every=self.fsync_every)
            self._writers[eid] = w
        seq = w.append(record)
        self._open[eid] = None
        self._open.move_to_end(eid)
        while len(self._open) > self.max_open:
            old, _ = self._open.popitem(last=False)
            self._writers[old].suspend()
        return seq

    def mark_delivered(self, execution_id: str, call_index: int) -> None:
        """Append a delivery mark of record ``call_index`` to its execution's file. Raises as
        :meth:`RecordWriter.mark_delivered`."""
        w = self._writers.get(execution_id)
        if w is None:
            w = RecordWriter(self.path(execution_id), fsync_every=self.fsync_every)
            self._writers[execution_id] = w
        w.mark_delivered(call_index)
        self._open[execution_id] = None
        self._open.move_to_end(execution_id)
        while len(self._open) > self.max_open:
            old, _ = self._open.popitem(last=False)
            self._writers[old].suspend()

    def close_execution(self, execution_id: str) -> None:
        """Close (fsync) the writer of one execution, e.g. at execution closure."""
        w = self._writers.pop(execution_id, None)
        self._open.pop(execution_id, None)
        if w is not None:
            w.close()

    def close(self) -> None:
        """Close every writer."""
        for eid in list(self._writers):
            self.close_execution(eid)

    def execution_ids(self) -> list[str]:
        """Executions with a file in the store, sorted."""
        return sorted(p.name[: -len(self.SUFFIX)] for p in self.root.glob(f"*{self.SUFFIX}"))

    def read_records(self, execution_id: str) -> list[RequestRecord]:
        """Records of one execution (see :func:`read_records`)."""
        w = self._writers.get(execution_id)
        if w is not None and w.is_open:
            w._f.flush()
        return read_records(self.path(execution_id))

    def load_tree(self, execution_id: str, *, anchor_slots: int = 8) -> TrajectoryTree:
        """Tree of one execution (see :func:`load_tree`)."""
        w = self._writers.get(execution_id)
        if w is not None and w.is_open:
            w._f.flush()
        return load_tree(self.path(execution_id), anchor_slots=anchor_slots)

    def __enter__(self) -> "TrajectoryStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
