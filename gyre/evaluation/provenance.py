"""Assessment provenance: an append-only log of every assessment attempt.

Each attempt of each evaluator on each execution becomes one :class:`AssessmentRecord`
(execution, evaluator, whether it is the designated task assessment, artifact version =
``assessed_ref``, branch, attempt number, status, score, details, duration). Records are
only ever appended: a retry or a later assessment adds a record, never replaces one. The
reward of an execution comes from its *designated* assessment: the first valid record
with ``designated=True`` (the retry loop stops there, so there is at most one).

With a ``path`` the log is also a JSONL file, one line per record, flushed on append, so a
crash loses no finished assessment; :meth:`AssessmentLog.load` reads it back.
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre.evaluation.assessment import Assessment, AssessmentStatus

__all__ = ["AssessmentRecord", "AssessmentLog"]


@dataclass(slots=True, frozen=True)
class AssessmentRecord:
    """One assessment attempt, as recorded (module docstring). ``score`` is NaN when unresolved;
    ``started_at`` is on the recording shell's clock (seconds)."""

    execution_id: str
    evaluator: str
    designated: bool
    attempt: int
    assessed_ref: str
    branch: str
    status: AssessmentStatus
    score: float
    duration_s: float
    started_at: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.status is AssessmentStatus.VALID

    @classmethod
    def from_assessment(cls, a: Assessment, *, execution_id: str, evaluator: str, designated: bool,
                        attempt: int, branch: str = "", started_at: float = 0.0) -> "AssessmentRecord":
        return cls(execution_id, evaluator, designated, int(attempt), a.assessed_ref, branch, a.status,
                   a.score, float(a.duration_s), float(started_at), copy.deepcopy(a.details))

    def to_json(self) -> str:
        d = asdict(self)
        d["status"] = self.status.value
        d["score"] = None if math.isnan(self.score) else self.score
        return json.dumps(d, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, line: str) -> "AssessmentRecord":
        d = json.loads(line)
        d["status"] = AssessmentStatus(d["status"])
        d["score"] = math.nan if d["score"] is None else float(d["score"])
        return cls(**d)


class AssessmentLog:
    """Append-only, thread-safe log of :class:`AssessmentRecord` s, indexed by execution."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._records: list[AssessmentRecord] = []
        self._by_execution: dict[str, list[int]] = {}
        self.path = None if path is None else Path(path)
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "AssessmentLog":
        """Read a JSONL log (records in file order); later appends go to the same file."""
        records = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    records.append(AssessmentRecord.from_json(line))
        log = cls(path)
        with log._lock:
            for r in records:
                log._index(r)
        return log

    def _index(self, record: AssessmentRecord) -> None:
        self._by_execution.setdefault(record.execution_id, []).append(len(self._records))
        self._records.append(record)

    def append(self, record: AssessmentRecord) -> AssessmentRecord:
        """Add ``record`` (its details are deep-copied); returns the stored record."""
        stored = AssessmentRecord(**{**{f: getattr(record, f) for f in record.__dataclass_fields__},
                                     "details": copy.deepcopy(record.details)})
        with self._lock:
            self._index(stored)
            if self._file is not None:
                self._file.write(stored.to_json() + "\n")
                self._file.flush()
        return stored

    def records(self, execution_id: str | None = None) -> tuple[AssessmentRecord, ...]:
        """All records (of one execution), in append order."""
        with self._lock:
            if execution_id is None:
                return tuple(self._records)
            return tuple(self._records[i] for i in self._by_execution.get(execution_id, ()))

    def designated(self, execution_id: str) -> AssessmentRecord | None:
        """The designated task assessment that supplies the reward: the first valid designated
        record of the execution, or ``None``."""
        for r in self.records(execution_id):
            if r.designated and r.valid:
                return r
        return None

    def attempts(self, execution_id: str, evaluator: str | None = None) -> int:
        """Number of recorded attempts (of one evaluator) for an execution."""
        return sum(1 for r in self.records(execution_id) if evaluator is None or r.evaluator == evaluator)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def __iter__(self) -> Iterator[AssessmentRecord]:
        return iter(self.records())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
