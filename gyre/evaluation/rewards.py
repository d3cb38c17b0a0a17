"""From a closed execution to its reward: partial scoring, retries, exclusion, placeholders.

Paper §5.2. :class:`RewardManager` is the thin shell around the pure retry policy
(:class:`~gyre.evaluation.RetryState`): it calls the task's designated evaluator on the
execution's preserved workspace, records every attempt in the
:class:`~gyre.evaluation.AssessmentLog`, sleeps the backoff (injected ``sleep``/``clock``), and
returns an :class:`ExecutionOutcome` -- ``VALID`` with a score, ``EXCLUDED`` when every allowed
attempt was unresolved (no reward, *not* 0; also :meth:`RewardManager.exclude` when nothing
could be assessed at all), or ``PLACEHOLDER`` (reward 0.0, empty tree: :func:`placeholder_tree`)
when the harness closed without assessable work.
"""

from __future__ import annotations

import argparse
import enum
import logging
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre.evaluation.assessment import Assessment, AssessmentStatus, EvaluationTarget, Evaluator
from gyre.evaluation.provenance import AssessmentLog, AssessmentRecord
from gyre.evaluation.validity import ActionKind, RetryPolicy, RetryState
from gyre.evaluation.workspace import PreservedWorkspace
from gyre.trajectory.tree import TrajectoryTree

__all__ = [
    "TerminationStatus",
    "OutcomeStatus",
    "ExecutionClosure",
    "ExecutionOutcome",
    "RewardManager",
    "placeholder_tree",
    "PLACEHOLDER_EVALUATOR",
]

logger = logging.getLogger(__name__)

#: Evaluator name of the record that documents a placeholder reward.
PLACEHOLDER_EVALUATOR = "placeholder"


class TerminationStatus(str, enum.Enum):
    """Why an execution closed (recorded beside the reward; never an input of it).

    ``SETUP_FAILED`` means there is no assessable work (workspace creation or image pull
    failed). The scheduler's coarser ``ExecutionStatus`` maps: ``COMPLETED``/``HARNESS_EXIT``
    -> completed, ``TIMEOUT`` -> timeout, ``CANCELLED`` -> cancelled/surplus,
    ``CRASHED``/``SETUP_FAILED`` -> failed.
    """

    COMPLETED = "completed"
    HARNESS_EXIT = "harness_exit"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    CRASHED = "crashed"
    SETUP_FAILED = "setup_failed"


class OutcomeStatus(str, enum.Enum):
    """Validity of an execution's reward."""

    VALID = "valid"              # designated assessment valid: reward is its score
    EXCLUDED = "excluded"        # unresolved within the budget: no reward, not trained on
    PLACEHOLDER = "placeholder"  # no assessable work: reward 0.0, empty trajectory tree


@dataclass(slots=True, frozen=True)
class ExecutionClosure:
    """A closed execution handed to evaluation by the harness launcher.

    * ``workspace`` -- the preserved workspace, ``None`` when there is no assessable work;
    * ``instruction`` / ``execution_key`` / ``metadata`` -- passed to the evaluator target;
    * ``termination`` -- recorded in the outcome only.
    """

    execution_id: str
    termination: TerminationStatus
    workspace: PreservedWorkspace | None
    instruction: str = ""
    execution_key: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "termination", TerminationStatus(self.termination))


@dataclass(slots=True, frozen=True)
class ExecutionOutcome:
    """The reward of one execution and how it was obtained.

    * ``reward`` -- finite for ``VALID`` and ``PLACEHOLDER`` (0.0), ``None`` for ``EXCLUDED``;
    * ``termination`` -- why the execution closed (beside the reward, never in it);
    * ``assessed_ref`` / ``branch`` -- artifact the reward was assessed on (``None``/``""`` for
      placeholders);
    * ``attempts`` -- designated-evaluator attempts made (0 for placeholders);
    * ``reason`` -- why excluded / why a placeholder.

    Raises:
        ValueError: reward inconsistent with the status.
    """

    execution_id: str
    status: OutcomeStatus
    reward: float | None
    termination: TerminationStatus
    assessed_ref: str | None = None
    branch: str = ""
    attempts: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", OutcomeStatus(self.status))
        object.__setattr__(self, "termination", TerminationStatus(self.termination))
        if self.status is OutcomeStatus.EXCLUDED:
            if self.reward is not None:
                raise ValueError("an excluded execution has no reward (unresolved is never a zero)")
        else:
            if self.reward is None or not math.isfinite(float(self.reward)):
                raise ValueError(f"a {self.status.value} outcome needs a finite reward, got {self.reward!r}")
            object.__setattr__(self, "reward", float(self.reward))
            if self.status is OutcomeStatus.PLACEHOLDER and self.reward != 0.0:
                raise ValueError("a placeholder's reward is 0")

    @property
    def has_reward(self) -> bool:
        """Valid or placeholder: the reward enters the group's baseline."""
        return self.status is not OutcomeStatus.EXCLUDED

    @classmethod
    def placeholder(cls, execution_id: str, termination: TerminationStatus = TerminationStatus.SETUP_FAILED,
                    reason: str = "no assessable work") -> "ExecutionOutcome":
        return cls(execution_id, OutcomeStatus.PLACEHOLDER, 0.0, termination, reason=reason)


def placeholder_tree(execution_id: str) -> TrajectoryTree:
    """The "dummy trajectory" of a placeholder: an empty tree. Admission
    samples no trajectory from it, so it adds no tokens; its reward 0 still counts in the
    group's baseline."""
    return TrajectoryTree(execution_id)


class RewardManager:
    """Assess closed executions with retries and record every attempt.

    * **partial scoring** -- every closed execution with a preserved workspace is assessed the
      same way, whatever its :class:`TerminationStatus` (completed, harness exit, timeout,
      cancelled, crashed). The evaluator never sees the termination status, the elapsed time
      or the trajectory length (:class:`~gyre.evaluation.EvaluationTarget` has no such
      fields); the status is recorded *beside* the reward in the outcome;
    * **validity** -- ``VALID`` with the designated assessment's score, or ``EXCLUDED`` when
      every attempt the budget allowed was unresolved; the execution's records stay stored, it
      just never enters training or a baseline;
    * **placeholder** -- a closure without an assessable workspace (workspace creation or
      image pull failed) gets ``PLACEHOLDER`` with reward 0.0: a valid zero in its group's
      baseline whose trajectory tree is empty, so it contributes no tokens.

    Args:
        policy: retry/backoff/budget (:meth:`RetryPolicy.from_args` for a run).
        log: where assessments are recorded (a fresh in-memory log by default).
        clock: monotonic seconds; ``sleep``: waits that many seconds (inject both in tests).

    Thread-safe: one :meth:`assess` per execution may run in each evaluator worker thread.
    """

    def __init__(self, policy: RetryPolicy | None = None, log: AssessmentLog | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.policy = policy or RetryPolicy()
        self.log = log if log is not None else AssessmentLog()
        self.clock = clock
        self.sleep = sleep

    @classmethod
    def from_args(cls, args: argparse.Namespace, log: AssessmentLog | None = None, **kwargs: Any) -> "RewardManager":
        return cls(RetryPolicy.from_args(args), log, **kwargs)

    def _attempt(self, evaluator: Evaluator, target: EvaluationTarget, timeout_s: float | None) -> Assessment:
        try:
            a = evaluator.evaluate(target, timeout_s=timeout_s)
            if not isinstance(a, Assessment):
                raise TypeError(f"evaluate() returned {type(a).__name__}, not Assessment")
            return a
        except Exception as exc:  # an evaluator crash is an unresolved attempt
            logger.warning("evaluator %s crashed on %s (attempt %d): %s", evaluator.name,
                           target.execution_id, target.attempt, exc)
            return Assessment.unresolved(f"evaluator crashed: {type(exc).__name__}: {exc}", target.assessed_ref,
                                         {"traceback": traceback.format_exc(limit=8)})

    def _target(self, closure: ExecutionClosure, attempt: int) -> EvaluationTarget:
        ws = closure.workspace
        assert ws is not None
        return EvaluationTarget(closure.execution_id, ws.path, ws.ref, ws.branch, attempt, closure.instruction,
                                closure.execution_key, dict(closure.metadata))

    def _record(self, closure: ExecutionClosure, evaluator: Evaluator, designated: bool, attempt: int,
                a: Assessment, started: float) -> AssessmentRecord:
        ws = closure.workspace
        return self.log.append(AssessmentRecord.from_assessment(
            a, execution_id=closure.execution_id, evaluator=evaluator.name, designated=designated,
            attempt=attempt, branch=ws.branch if ws else "", started_at=started))

    def assess(self, closure: ExecutionClosure, evaluator: Evaluator, *,
               auxiliary: Sequence[Evaluator] = (), retry_until: float | None = None) -> ExecutionOutcome:
        """Score one closed execution with the task's designated ``evaluator``.

        Retries unresolved attempts against the same preserved workspace under the policy;
        each attempt is recorded. ``retry_until`` (on :attr:`clock`): the execution's overall
        deadline -- no retry starts at or past it (the first attempt always runs).
        ``auxiliary`` evaluators then run once each (recorded with ``designated=False``; they
        never supply the reward).
        """
        if closure.workspace is None:
            out = ExecutionOutcome.placeholder(closure.execution_id, closure.termination)
            self.log.append(AssessmentRecord(closure.execution_id, PLACEHOLDER_EVALUATOR, True, 0, "", "",
                                             AssessmentStatus.VALID, 0.0, 0.0, self.clock(),
                                             {"reason": out.reason, "termination": closure.termination.value}))
            return out
        state = RetryState(self.policy, retry_until=math.inf if retry_until is None else float(retry_until))
        valid: Assessment | None = None
        while True:
            act = state.next_action(self.clock())
            if act.kind is ActionKind.WAIT:
                self.sleep(max(0.0, act.not_before - self.clock()))
                continue
            if act.kind is not ActionKind.EVALUATE:
                break
            started = self.clock()
            attempt = state.begin(started)
            a = self._attempt(evaluator, self._target(closure, attempt), act.timeout_s)
            state.finish(a.status, self.clock())
            self._record(closure, evaluator, True, attempt, a, started)
            if a.valid:
                valid = a
        for aux in auxiliary:
            started = self.clock()
            self._record(closure, aux, False, 1, self._attempt(aux, self._target(closure, 1), None), started)
        ws = closure.workspace
        if valid is not None:
            return ExecutionOutcome(closure.execution_id, OutcomeStatus.VALID, valid.score, closure.termination,
                                    ws.ref, ws.branch, len(state.attempts))
        logger.warning("execution %s excluded from training: %s", closure.execution_id, act.reason)
        return ExecutionOutcome(closure.execution_id, OutcomeStatus.EXCLUDED, None, closure.termination,
                                ws.ref, ws.branch, len(state.attempts), act.reason)

    def exclude(self, execution_id: str, termination: TerminationStatus | str, reason: str, *,
                evaluator: str = "unassessed", details: dict[str, Any] | None = None) -> ExecutionOutcome:
        """``EXCLUDED`` without an assessment attempt: the execution could not be assessed at all
        (the launcher raised, the evaluator could not be built, the assessment itself crashed).
        One unresolved record names ``reason``; no reward, so it never enters a group's baseline."""
        out = ExecutionOutcome(execution_id, OutcomeStatus.EXCLUDED, None, termination, reason=reason)
        self.log.append(AssessmentRecord(execution_id, evaluator, True, 0, "", "", AssessmentStatus.UNRESOLVED,
                                         math.nan, 0.0, self.clock(),
                                         {"reason": reason, "termination": out.termination.value, **(details or {})}))
        logger.warning("execution %s excluded from training: %s", execution_id, reason)
        return out
