"""Boundary dispatch, execution counters and staleness accounting (paper §4.1, App. A).

:class:`Counters` holds the cumulative execution counters ``d`` (dispatched), ``p`` (launched)
and ``f`` (finished), with ``0 <= f <= p <= d`` at every instant; the *waterlevel* ``d - f`` is
the unfinished work. :class:`BoundaryDispatch` queues ``(phi + mu) * B`` groups at startup and
``mu * B`` more after each burst's weight publication, each tagged with the published policy
version ``v_d``; ready groups fill the streams of the steps (:class:`StepStream`), and a step
``t`` runs on policy version ``t``, so the recorded staleness is ``t - v_d``. In steady state
the mean staleness is ``phi + (mu - 1)/2`` (paper App. A; derivation in
:class:`BoundaryDispatch`).
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field

from .config import SchedulerConfig
from .events import Dispatch, EnqueueGroup, ExecutionStatus


class ExecutionState(str, enum.Enum):
    """Where an execution is in its life: queued (dispatched), running (launched), finished."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class ExecutionRecord:
    """One dispatched execution: its group, state, current route and closing status."""

    execution_id: int
    group_id: int
    state: ExecutionState = ExecutionState.QUEUED
    route: int | None = None
    status: ExecutionStatus | None = None
    acknowledged: bool = False


@dataclass(slots=True)
class GroupRecord:
    """One dispatched rollout group (one query, ``N + oversample`` executions)."""

    group_id: int
    policy_version: int
    execution_ids: tuple[int, ...]
    ready: bool = False
    num_micro_steps: int = 0
    step: int | None = None
    staleness: int | None = None


@dataclass(slots=True)
class Counters:
    """Cumulative execution counters ``d`` (dispatched), ``p`` (in progress), ``f`` (finished) plus group and
    anomaly counts.

    * ``d`` -- ``N + oversample`` per dispatched group;
    * ``p`` -- incremented when the scheduler issues :class:`~gyre.scheduler.events.Launch` (the
      execution leaves the queue and holds a slot);
    * ``f`` -- incremented exactly once per launched execution, whatever the reason (completion,
      failure, timeout, cancellation, surplus). A repeated
      :class:`~gyre.scheduler.events.ExecutionFinished` is ignored, and model-request retries
      are not events at all, so they change no counter.

    Hence ``0 <= f <= p <= d``, ``d - p`` executions are queued, ``p - f`` are running and the
    waterlevel is ``d - f``. An execution still queued when its group becomes ready
    (oversampling: the first ``N`` valid outcomes arrived) is closed *at the queue* as surplus:
    it passes through ``p`` and ``f`` at the same instant without a ``Launch``, so that ``d - f``
    stays the unfinished work.
    """

    d: int = 0
    p: int = 0
    f: int = 0
    groups_dispatched: int = 0
    groups_ready: int = 0
    groups_consumed: int = 0
    surplus: int = 0
    surplus_at_queue: int = 0
    duplicate_finishes: int = 0
    duplicate_acks: int = 0
    duplicate_ready: int = 0

    @property
    def queued(self) -> int:
        """Dispatched executions not launched yet: ``d - p``."""
        return self.d - self.p

    @property
    def running(self) -> int:
        """Launched executions not finished yet: ``p - f``."""
        return self.p - self.f

    @property
    def waterlevel(self) -> int:
        """Unfinished rollout work ``d - f`` = queued + running."""
        return self.d - self.f


@dataclass(slots=True)
class StepStream:
    """The stream of one optimizer step: its groups and micro-step progress."""

    step: int
    group_ids: list[int] = field(default_factory=list)
    micro_total: int = 0
    micro_done: int = 0


class BoundaryDispatch:
    """Queue, counters, group readiness and step streams; no placement logic.

    Ready groups enter the stream of the step being filled, oldest version first (ties:
    readiness order); the stream closes when it holds ``B`` groups.

    Why the mean staleness is ``phi + (mu - 1)/2``: in steady state the ``mu * B`` groups
    dispatched at version ``k * mu`` are consumed, after the ``phi * B`` older ones ahead of
    them, by steps ``k * mu + phi + i`` for ``i = 0..mu-1`` (``B`` groups each), i.e. staleness
    ``phi + i``. Out-of-order readiness permutes which group gets which step but not the sum of
    ``v_t - v_d`` over a long run, so the identity holds on average. The startup dispatch is
    consumed with staleness equal to the step index, which lowers the mean over ``S`` steps by
    a warm-up term of order ``phi * (phi + mu) / S`` (``phi * mu / S`` when ``phi <= 1``).

    Args:
        config: the scheduler shape (``N``, ``B``, ``phi``, ``mu``, ``oversample``).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.executions: dict[int, ExecutionRecord] = {}
        self.groups: dict[int, GroupRecord] = {}
        self.published_version = 0
        self._queue: deque[int] = deque()
        self._ready: list[tuple[int, int, int]] = []  # heap of (v_d, ready_seq, group_id)
        self._ready_seq = 0
        self.stream = StepStream(step=0)
        #: ``(group_id, step, staleness)`` per consumed group, in consumption order.
        self.staleness_log: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ dispatch / queue

    def dispatch(self, n_groups: int) -> list[Dispatch]:
        """Queue ``n_groups`` new groups at the published version; return their Dispatch commands."""
        out: list[Dispatch] = []
        per = self.config.executions_per_group
        for _ in range(n_groups):
            gid = self.counters.groups_dispatched
            first = self.counters.d
            eids = tuple(range(first, first + per))
            self.groups[gid] = GroupRecord(gid, self.published_version, eids)
            for eid in eids:
                self.executions[eid] = ExecutionRecord(eid, gid)
                self._queue.append(eid)
            self.counters.d += per
            self.counters.groups_dispatched += 1
            out.append(Dispatch(gid, self.published_version, eids))
        return out

    def pop_queued(self) -> ExecutionRecord | None:
        """Oldest queued execution (FIFO), or ``None``; skips those closed at the queue."""
        while self._queue:
            rec = self.executions[self._queue.popleft()]
            if rec.state is ExecutionState.QUEUED:
                return rec
        return None

    def mark_launched(self, rec: ExecutionRecord, route: int) -> None:
        """Count ``p`` for ``rec`` now running on ``route``."""
        rec.state = ExecutionState.RUNNING
        rec.route = route
        self.counters.p += 1

    def acknowledge(self, execution_id: int) -> None:
        """Record an ExecutionLaunched acknowledgement; raise ``ValueError`` if never launched."""
        rec = self._get(execution_id)
        if rec.state is ExecutionState.QUEUED:
            raise ValueError(f"execution {execution_id} acknowledged but never launched")
        if rec.acknowledged:
            self.counters.duplicate_acks += 1
        rec.acknowledged = True

    def finish(self, execution_id: int, status: ExecutionStatus) -> ExecutionRecord | None:
        """Count ``f`` once for a running execution and return it; ``None`` for a repeat.

        Raises:
            ValueError: unknown execution, or one that was never launched.
        """
        rec = self._get(execution_id)
        if rec.state is ExecutionState.FINISHED:
            self.counters.duplicate_finishes += 1
            return None
        if rec.state is ExecutionState.QUEUED:
            raise ValueError(f"execution {execution_id} finished but was never launched")
        rec.state = ExecutionState.FINISHED
        rec.status = ExecutionStatus(status)
        self.counters.f += 1
        if rec.status is ExecutionStatus.SURPLUS:
            self.counters.surplus += 1
        return rec

    def _get(self, execution_id: int) -> ExecutionRecord:
        try:
            return self.executions[execution_id]
        except KeyError:
            raise ValueError(f"unknown execution {execution_id}") from None

    # ------------------------------------------------------------------ readiness / streams

    def group_ready(self, group_id: int, num_micro_steps: int) -> bool:
        """Mark a group ready with its micro-step count; close its queued executions as surplus.

        Returns ``False`` for a repeated notification (ignored).

        Raises:
            ValueError: unknown group or a negative micro-step count.
        """
        if num_micro_steps < 0:
            raise ValueError(f"num_micro_steps must be >= 0, got {num_micro_steps}")
        grp = self.groups.get(group_id)
        if grp is None:
            raise ValueError(f"unknown group {group_id}")
        if grp.ready:
            self.counters.duplicate_ready += 1
            return False
        grp.ready = True
        grp.num_micro_steps = num_micro_steps
        self.counters.groups_ready += 1
        for eid in grp.execution_ids:
            rec = self.executions[eid]
            if rec.state is ExecutionState.QUEUED:  # never launched: closed at the queue
                rec.state = ExecutionState.FINISHED
                rec.status = ExecutionStatus.SURPLUS
                self.counters.p += 1
                self.counters.f += 1
                self.counters.surplus += 1
                self.counters.surplus_at_queue += 1
        heapq.heappush(self._ready, (grp.policy_version, self._ready_seq, group_id))
        self._ready_seq += 1
        return True

    @property
    def ready_unconsumed(self) -> int:
        """Ready groups not yet enqueued into any step's stream."""
        return len(self._ready)

    @property
    def stream_closed(self) -> bool:
        """The current step's stream holds its ``B`` groups."""
        return len(self.stream.group_ids) >= self.config.B

    @property
    def stream_open(self) -> bool:
        """The current step's stream has started and more of its groups will come."""
        return 0 < len(self.stream.group_ids) < self.config.B

    @property
    def stream_drained(self) -> bool:
        """Closed and every enqueued micro-step done: the join window can close."""
        return self.stream_closed and self.stream.micro_done >= self.stream.micro_total

    @property
    def pending_micro_steps(self) -> int:
        """Micro-steps enqueued for the current step and not done (claimed or not)."""
        return self.stream.micro_total - self.stream.micro_done

    def fill_stream(self) -> list[EnqueueGroup]:
        """Move ready groups (oldest version first) into the current step's stream.

        Without ``config.streaming`` an empty stream takes nothing until ``B`` groups are ready,
        then takes ``B`` at once.
        """
        out: list[EnqueueGroup] = []
        s = self.stream
        if not self.config.streaming and not s.group_ids and len(self._ready) < self.config.B:
            return out
        while self._ready and len(s.group_ids) < self.config.B:
            v_d, _, gid = heapq.heappop(self._ready)
            grp = self.groups[gid]
            grp.step = s.step
            grp.staleness = s.step - v_d
            s.group_ids.append(gid)
            s.micro_total += grp.num_micro_steps
            self.counters.groups_consumed += 1
            self.staleness_log.append((gid, s.step, grp.staleness))
            out.append(EnqueueGroup(gid, s.step, grp.staleness))
        return out

    def micro_step_done(self, step: int) -> None:
        """Count one finished micro-step of ``step``.

        Raises:
            ValueError: ``step`` is not the current step, or more micro-steps than enqueued.
        """
        if step != self.stream.step:
            raise ValueError(f"micro-step of step {step} done, but the current step is {self.stream.step}")
        if self.stream.micro_done >= self.stream.micro_total:
            raise ValueError(f"more micro-steps done than enqueued for step {step}")
        self.stream.micro_done += 1

    def advance_step(self) -> int:
        """Finish the drained current step (join window closed); return its index."""
        done = self.stream.step
        self.stream = StepStream(step=done + 1)
        return done

    # ------------------------------------------------------------------ staleness

    @property
    def mean_staleness(self) -> float:
        """Mean ``d`` over consumed groups (``nan`` before the first)."""
        if not self.staleness_log:
            return float("nan")
        return sum(s for _, _, s in self.staleness_log) / len(self.staleness_log)
