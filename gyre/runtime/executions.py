"""Rank 0's table of executions: keys, tasks, what is running, surplus and trained, what a
resumed run carried over (:mod:`gyre.runtime.carry_over`), and the ``executions.jsonl`` log (one
line when an execution is launched, closes, is carried over by a resumed run, is trained)."""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gyre.runtime.carry_over import CarriedExecution, CarriedGroup, CarryOver
from gyre.runtime.pipeline import ExecutionKey, FinishedExecution
from gyre.scheduler import events as ev

logger = logging.getLogger(__name__)
_STATUS = {"completed": ev.ExecutionStatus.COMPLETED, "timeout": ev.ExecutionStatus.TIMEOUT,
           "cancelled": ev.ExecutionStatus.CANCELLED}


def task_for_group(tasks: Sequence[Any], group_id: int, *, seed: int, attempt: int) -> Any:
    """Seeded round-robin over a shuffled task list: every task once per epoch of groups."""
    epoch, pos = divmod(group_id, len(tasks))
    return tasks[int(np.random.default_rng([seed, attempt, epoch]).permutation(len(tasks))[pos])]


class ExecutionTable:
    """Bookkeeping of the run's executions (module docstring)."""

    def __init__(self, log_path: Path, attempt: int, trained: Sequence[str] = (), carry: CarryOver | None = None):
        self.attempt = attempt
        self.carried = collections.deque(carry.groups if carry else ())
        self.adopted: dict[int, CarriedExecution] = {}   # execution index -> carried execution in its slot
        self._adopted_ids: dict[str, CarriedExecution] = {}
        self.keys: dict[int, ExecutionKey] = {}   # scheduler execution index -> key
        self.group_task: dict[int, Any] = {}
        self.running: dict[str, Any] = {}         # execution id -> RunningExecution (cancel)
        self.surplus: set[str] = set()
        self.in_flight: set[str] = set()
        self.trained: set[str] = set(trained)
        self.launched = 0
        self.closed_by_status: dict[str, int] = {}
        self._log = open(log_path, "a", encoding="utf-8")
        for e in carry.interrupted if carry else ():  # in flight when the earlier attempt stopped
            self._write({**e, "event": "closed", "termination": "crashed", "status": "cancelled", "outcome": None,
                         "reward": None, "error": "in flight when the run stopped", "t": 0.0})

    def next_carried(self, task_ids: set[str]) -> CarriedGroup | None:
        """The oldest carried-over group whose task the run still has (others are dropped)."""
        while self.carried:
            group = self.carried.popleft()
            if group.task_id in task_ids:
                return group
            logger.warning("task %s is gone: %d finished executions of it are not trained", group.task_id,
                           len(group.executions))
        return None

    def add_group(self, group_id: int, indices: Sequence[int], task: Any,
                  carried: CarriedGroup | None = None) -> list[str]:
        """Key the group's executions (the first slots taken by ``carried``'s executions);
        returns their execution ids."""
        self.group_task[group_id] = task
        for index in indices:
            self.keys[index] = ExecutionKey(self.attempt, group_id, index)
        for index, ce in zip(indices, carried.executions if carried else ()):
            self.adopted[index] = self._adopted_ids[ce.execution_id] = ce
        return [self.sid(i) for i in indices]

    def sid(self, index: int) -> str:
        """The execution id in scheduler slot ``index`` (a carried execution keeps its own)."""
        return self.adopted[index].execution_id if index in self.adopted else str(self.keys[index])

    def launching(self, sid: str, key: ExecutionKey, task_id: str, now: float | None = None) -> None:
        self.in_flight.add(sid)
        self.launched += 1
        self._write({"event": "launched", "execution_id": sid, "attempt": key.attempt, "group": key.group,
                     "task": task_id, **({"t": now} if now is not None else {})})

    def cancel(self, sids: Sequence[str]) -> None:
        """Mark executions surplus and end the running ones."""
        for sid in sids:
            self.surplus.add(sid)
            if (running := self.running.get(sid)) is not None:
                running.cancel()

    def closed(self, fin: FinishedExecution, task_id: str | None, now: float) -> ev.ExecutionStatus:
        """Record a finished execution; returns its status for the scheduler."""
        sid, result, outcome = fin.execution_id, fin.result, fin.outcome
        self.in_flight.discard(sid)
        if (ce := self._adopted_ids.get(sid)) is not None:  # closed in an earlier attempt: counted there
            self._write({"event": "carried_over", "execution_id": sid, "attempt": self.attempt,
                         "group": fin.key.group, "task": task_id, "t": now})
            return ev.ExecutionStatus(ce.status)
        term = result.termination.value if result is not None else "crashed"
        status = ev.ExecutionStatus.SURPLUS if sid in self.surplus else _STATUS.get(term, ev.ExecutionStatus.FAILED)
        self.closed_by_status[status.value] = self.closed_by_status.get(status.value, 0) + 1
        self._write({"event": "closed", "execution_id": sid, "attempt": fin.key.attempt, "group": fin.key.group,
                     "task": task_id,
                     "termination": term, "status": status.value, "outcome": outcome.status.value,
                     "reward": outcome.reward, "duration_s": getattr(result, "duration_s", None),
                     "calls": len(fin.tree.records) if fin.tree is not None else 0,
                     "error": fin.error or getattr(result, "error", ""), "t": now})
        return status

    def mark_trained(self, sids: Sequence[str], step: int) -> None:
        """``sids`` are trained in step ``step`` (numbered from 1, as in ``metrics.jsonl``)."""
        for sid in sids:
            self.trained.add(sid)
            self._write({"event": "trained", "execution_id": sid, "step": step})

    def _write(self, record: dict[str, Any]) -> None:
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def close(self) -> None:
        self._log.close()
