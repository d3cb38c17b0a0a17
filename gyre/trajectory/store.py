"""Durable, append-only storage of request records; trees rebuilt bit-identically.

One file per execution, ``<root>/<execution_id>.jsonl``, one record per line in insertion
order, in the ``gyre-tito/1`` format (:mod:`gyre.trajectory.record_format`): a CRC-checked JSON line whose
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

import logging
import os
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

from gyre.trajectory.record_format import (FORMAT_VERSION, DeliveryMark, DeltaRing, decode_record,
                                           encode_delivery_mark, encode_record, parse_line)
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
    "ScanState",
    "scan_file",
]

logger = logging.getLogger(__name__)

class TornTailWarning(RuntimeWarning):
    """A torn final line was found in a record file and skipped."""


class StoreCorruptError(ValueError):
    """A record file is corrupt beyond a torn final line (bad line in the middle, bad base)."""


class ScanState:
    """What :func:`scan_file` learnt: records decoded, lines read (records and marks), end of the last
    good line, torn tail, ring."""

    __slots__ = ("count", "lines", "good_end", "torn", "ring")

    def __init__(self, ring_size: int) -> None:
        self.count = 0
        self.lines = 0
        self.good_end = 0
        self.torn = False
        self.ring = DeltaRing(ring_size)


def scan_file(path: Path, state: ScanState, calls: set[int] | None = None) -> Iterator[RequestRecord | DeliveryMark]:
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
            obj = parse_line(line)
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
                rec, base = decode_record(obj, ring, state.count)
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
            parse_line(line)
            return True
        except ValueError:
            continue
    return False


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
    for item in scan_file(Path(path), ScanState(ring_size)):
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
    state = ScanState(ring_size)
    for item in scan_file(Path(path), state):  # streamed: O(ring) records in memory
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
        self._ring = DeltaRing(ring_size)
        self._seq = 0
        self._since_sync = 0
        self._calls: set[int] = set()
        self.execution_id: str | None = None
        if self.path.exists():
            state = ScanState(ring_size)
            for item in scan_file(self.path, state):
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
