"""What a resumed run takes over from the attempts before it.

``executions.jsonl`` logs every execution's launch and close (with its resume attempt and group)
and every execution a later attempt carried over.  On resume from a checkpoint, executions that
closed with an outcome but were not trained by that checkpoint come back as
:class:`CarriedGroup` values (their records and outcomes are read from the run directory), and
executions launched but never closed (in flight at the crash) are named so they can be closed
as cancelled, once.  The controller gives each carried group a new group of the resumed run,
with the same task: its finished executions fill slots, the others run afresh.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Statuses of closed executions whose outcome a resumed run can train on.
CARRIED_STATUSES = ("completed", "timeout")


@dataclass
class CarriedExecution:
    execution_id: str
    status: str                 # the scheduler's ExecutionStatus value it closed with
    outcome: Any                # gyre.evaluation.ExecutionOutcome
    tree: Any                   # gyre.trajectory.TrajectoryTree read back from records/, or None


@dataclass
class CarriedGroup:
    task_id: str
    executions: list[CarriedExecution] = field(default_factory=list)


@dataclass
class CarryOver:
    groups: list[CarriedGroup]
    interrupted: list[dict[str, Any]]   # "launched" log lines of executions never closed


def read_carry_over(run_dir: Path, trained: set[str]) -> CarryOver:
    """Finished-but-untrained executions (not in ``trained``) of the earlier attempts, grouped as
    they were dispatched, oldest group first; and the executions in flight at the crash."""
    from gyre.evaluation.rewards import ExecutionOutcome, OutcomeStatus, TerminationStatus
    from gyre.trajectory.store import StoreCorruptError, load_tree

    log = Path(run_dir) / "executions.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    launched: dict[str, dict] = {}
    closed: dict[str, dict] = {}
    member: dict[str, tuple] = {}       # execution id -> (attempt, group) it last belonged to
    for e in lines:
        sid = e.get("execution_id")
        if e.get("event") == "launched":
            launched[sid] = e
        elif e.get("event") in ("closed", "carried_over"):
            if e["event"] == "closed":
                closed[sid] = e
            member[sid] = (e.get("attempt"), e.get("group"), e.get("task"))
    groups: dict[tuple, CarriedGroup] = {}
    for sid, e in closed.items():
        if sid in trained or e["status"] not in CARRIED_STATUSES or e.get("outcome") == OutcomeStatus.EXCLUDED.value:
            continue
        tree = None
        try:
            tree = load_tree(Path(run_dir) / "records" / f"{sid}.jsonl")
        except (FileNotFoundError, StoreCorruptError) as exc:
            logger.warning("execution %s: its records cannot be read back (%s); it runs again", sid, exc)
            continue
        outcome = ExecutionOutcome(sid, OutcomeStatus(e["outcome"]), e["reward"], TerminationStatus(e["termination"]))
        attempt, group, task = member[sid]
        groups.setdefault((attempt, group), CarriedGroup(task)).executions.append(
            CarriedExecution(sid, e["status"], outcome, tree))
    interrupted = [e for sid, e in launched.items() if sid not in closed]
    return CarryOver([groups[k] for k in sorted(groups, key=lambda k: (k[0] or 0, k[1] or 0))], interrupted)
