"""Reward validity: the retry policy for unresolved assessments (paper §5.2).

A pure, deterministic core -- time is a number the caller passes in (``now``, seconds on any
monotonic clock); nothing here sleeps. :class:`~gyre.evaluation.RewardManager` is the shell
that sleeps and calls evaluators.

:class:`RetryPolicy` holds the settings (backoff, retries, budget); :class:`RetryState` applies
them to one execution's attempts and tells the shell what to do next (:class:`NextAction`).
When no attempt may start any more the execution is **exhausted**: excluded from training (its
records stay stored). Unresolved is never a zero.
"""

from __future__ import annotations

import argparse
import enum
import math
from dataclasses import dataclass, field

from gyre.evaluation.assessment import AssessmentStatus

__all__ = ["RetryPolicy", "RetryState", "NextAction", "ActionKind", "AttemptInfo"]


@dataclass(slots=True, frozen=True)
class RetryPolicy:
    """Retry/backoff/budget settings; seconds throughout.

    Policy (per execution):

    * attempt 1 starts at once; attempt ``k + 1`` (retry ``k``, ``k >= 1``) may start
      ``backoff(k) = min(backoff_s * backoff_factor ** (k - 1), backoff_max_s)`` seconds after
      attempt ``k`` finished;
    * at most ``1 + max_retries`` attempts;
    * all attempts and waits must fit in ``budget_s`` seconds from the start of the first
      attempt: an attempt never starts at or past the deadline, and its limit is
      ``min(attempt_timeout_s, deadline - start)``; a retry whose backoff would end at or past
      the deadline is not scheduled;
    * the first ``VALID`` attempt resolves the execution (later attempts never happen).

    :class:`RetryState` may also carry the execution's own deadline (``retry_until``): no retry
    starts at or past it and a retry's limit ends there; the first attempt is not bound by it.

    Raises:
        ValueError: negative retries/backoff, factor < 1, non-positive limits.
    """

    max_retries: int = 3
    attempt_timeout_s: float = 300.0
    backoff_s: float = 5.0
    backoff_factor: float = 2.0
    backoff_max_s: float = 300.0
    budget_s: float | None = None

    def __post_init__(self) -> None:
        if int(self.max_retries) != self.max_retries or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if not self.attempt_timeout_s > 0:
            raise ValueError(f"attempt_timeout_s must be > 0, got {self.attempt_timeout_s!r}")
        if not (self.backoff_s >= 0 and self.backoff_max_s >= 0 and self.backoff_factor >= 1):
            raise ValueError("backoff_s and backoff_max_s must be >= 0 and backoff_factor >= 1")
        if self.budget_s is None:
            object.__setattr__(self, "budget_s", self.default_budget_s())
        elif not self.budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s!r}")

    @property
    def max_attempts(self) -> int:
        return 1 + int(self.max_retries)

    def backoff(self, retry: int) -> float:
        """Wait (seconds) before retry ``retry`` (1-based), i.e. before attempt ``retry + 1``."""
        if retry < 1:
            raise ValueError(f"retry index is 1-based, got {retry}")
        return min(self.backoff_s * self.backoff_factor ** (retry - 1), self.backoff_max_s)

    def default_budget_s(self) -> float:
        """Every attempt at its full limit plus every backoff wait."""
        return self.max_attempts * self.attempt_timeout_s + sum(self.backoff(k) for k in range(1, self.max_attempts))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RetryPolicy":
        """From ``--eval-max-retries``, ``--eval-timeout-s``, ``--eval-retry-backoff-s``, ``--eval-budget-s``."""
        return cls(
            max_retries=int(args.eval_max_retries),
            attempt_timeout_s=float(args.eval_timeout_s),
            backoff_s=float(args.eval_retry_backoff_s),
            budget_s=args.eval_budget_s,
        )


class ActionKind(str, enum.Enum):
    EVALUATE = "evaluate"   # start attempt `attempt` now with limit `timeout_s`
    WAIT = "wait"           # sleep until `not_before`, then ask again
    VALID = "valid"         # resolved: the last attempt was valid
    EXHAUSTED = "exhausted" # no attempt may start any more: exclude the execution


@dataclass(slots=True, frozen=True)
class NextAction:
    """What the shell should do next (see :meth:`RetryState.next_action`)."""

    kind: ActionKind
    attempt: int = 0
    not_before: float = 0.0
    timeout_s: float = 0.0
    reason: str = ""


@dataclass(slots=True, frozen=True)
class AttemptInfo:
    """Bookkeeping of one attempt (times on the caller's clock, seconds)."""

    attempt: int
    started_at: float
    finished_at: float
    status: AssessmentStatus


@dataclass(slots=True)
class RetryState:
    """Attempt bookkeeping of one execution under a :class:`RetryPolicy`.

    Usage (the shell)::

        state = RetryState(policy)
        while (act := state.next_action(clock())).kind in (EVALUATE, WAIT):
            if act.kind is WAIT: sleep(act.not_before - clock()); continue
            n = state.begin(clock()); a = evaluator.evaluate(..., timeout_s=act.timeout_s)
            state.finish(a.status, clock())
    """

    policy: RetryPolicy
    attempts: list[AttemptInfo] = field(default_factory=list)
    started_at: float | None = None
    #: The execution's overall deadline (caller's clock): no retry starts at or past it, a retry's
    #: limit ends there. The first attempt is not bound by it (work closed at its time limit is
    #: still scored once). ``inf``: no such deadline.
    retry_until: float = math.inf
    _running: tuple[int, float] | None = field(default=None, init=False, repr=False)

    @property
    def deadline(self) -> float:
        """Absolute end of the budget (``inf`` before the first attempt)."""
        return math.inf if self.started_at is None else self.started_at + float(self.policy.budget_s)

    @property
    def resolved(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].status is AssessmentStatus.VALID

    def next_action(self, now: float) -> NextAction:
        """Decide at time ``now`` (seconds). Raises ``RuntimeError`` while an attempt runs."""
        if self._running is not None:
            raise RuntimeError(f"attempt {self._running[0]} is still running")
        if self.resolved:
            return NextAction(ActionKind.VALID, attempt=self.attempts[-1].attempt)
        n = len(self.attempts)
        if n >= self.policy.max_attempts:
            return NextAction(ActionKind.EXHAUSTED, attempt=n,
                              reason=f"unresolved after {n} attempts (max retries {self.policy.max_retries})")
        if n == 0:
            return NextAction(ActionKind.EVALUATE, attempt=1, not_before=now,
                              timeout_s=min(self.policy.attempt_timeout_s, float(self.policy.budget_s)))
        not_before = self.attempts[-1].finished_at + self.policy.backoff(n)
        start = max(now, not_before)
        if start >= self.retry_until:
            return NextAction(ActionKind.EXHAUSTED, attempt=n,
                              reason=f"unresolved after {n} attempts; the execution's time budget is spent")
        deadline = min(self.deadline, self.retry_until)
        if start >= deadline:
            return NextAction(ActionKind.EXHAUSTED, attempt=n,
                              reason=f"unresolved after {n} attempts; evaluation budget of "
                                     f"{float(self.policy.budget_s):g} s exhausted")
        if now < not_before:
            return NextAction(ActionKind.WAIT, attempt=n + 1, not_before=not_before,
                              timeout_s=min(self.policy.attempt_timeout_s, deadline - not_before))
        return NextAction(ActionKind.EVALUATE, attempt=n + 1, not_before=now,
                          timeout_s=min(self.policy.attempt_timeout_s, deadline - now))

    def begin(self, now: float) -> int:
        """Record the start of the next attempt; returns its 1-based number.

        Raises:
            RuntimeError: :meth:`next_action` would not say ``EVALUATE`` at ``now``.
        """
        act = self.next_action(now)
        if act.kind is not ActionKind.EVALUATE:
            raise RuntimeError(f"no attempt may start now: {act.kind.value} {act.reason}".strip())
        if self.started_at is None:
            self.started_at = now
        self._running = (act.attempt, now)
        return act.attempt

    def finish(self, status: AssessmentStatus | str, now: float) -> AttemptInfo:
        """Record the end of the running attempt with its status."""
        if self._running is None:
            raise RuntimeError("no attempt is running")
        attempt, started = self._running
        self._running = None
        info = AttemptInfo(attempt, started, now, AssessmentStatus(status))
        self.attempts.append(info)
        return info
