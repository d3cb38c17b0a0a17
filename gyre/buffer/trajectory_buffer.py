"""Trajectory buffer: rollout groups, reward validity, group readiness and advantages.

A group is registered with its ``N + oversample`` execution ids.  Each closed execution
reports one :class:`~gyre.evaluation.ExecutionOutcome` (valid reward, placeholder 0, or
excluded) and optionally its trajectory tree; the group becomes ready once ``N`` executions
have a reward, with advantages over those ``N`` (:func:`gyre.rl.compute_advantages`), or is
dropped once that can no longer happen (:class:`TrajectoryBuffer` gives the rules).

Each call returns the events it produced, in order: :class:`ReadyGroup` or
:class:`GroupDropped`.  A ready group stays in the buffer until :meth:`TrajectoryBuffer.take`;
:meth:`ReadyGroup.to_scheduler_event` makes the scheduler's
:class:`gyre.scheduler.GroupReady` once the stream packer knows the micro-step count.
A pure core: time is an injected clock callable, and an internal lock only serialises
callers from several evaluator threads.
"""

from __future__ import annotations

import argparse
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre.evaluation.rewards import ExecutionOutcome, OutcomeStatus
from gyre.rl.advantages import AdvantageConfig, compute_advantages
from gyre.trajectory.materialize import TrajectoryRow, materialize
from gyre.trajectory.admission import AdmissionConfig, sample_trajectories
from gyre.trajectory.tree import TrajectoryTree

__all__ = [
    "BufferCounters",
    "DropReason",
    "GroupDropped",
    "ReadyGroup",
    "TrajectoryBuffer",
    "materialize_group",
]

logger = logging.getLogger(__name__)


class DropReason(str, enum.Enum):
    INSUFFICIENT_VALID = "insufficient_valid"  # N valid rewards can no longer be reached
    ZERO_STD = "zero_std"                      # all-equal rewards, --filter-zero-std-groups


@dataclass(slots=True, frozen=True)
class ReadyGroup:
    """A group whose ``N`` designated executions have rewards.

    * ``execution_ids`` / ``outcomes`` / ``rewards`` / ``advantages`` / ``trajectories`` --
      aligned tuples over the ``N`` designated executions, in arrival order
      (``trajectories[i]`` is what was passed with the outcome, e.g. a
      :class:`~gyre.trajectory.TrajectoryTree`, or ``None``);
    * ``mean`` / ``std`` -- of the designated rewards; ``zero_std`` -- all equal (advantages 0);
    * ``surplus_execution_ids`` -- executions of the group still open at readiness: the shell
      closes them as surplus;
    * ``excluded_execution_ids`` -- executions excluded before readiness (not in the baseline);
    * ``policy_version`` -- as registered with the group (staleness accounting);
    * ``now`` -- readiness time on the buffer's clock (seconds).
    """

    group_id: Hashable
    execution_ids: tuple[str, ...]
    outcomes: tuple[ExecutionOutcome, ...]
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    trajectories: tuple[Any, ...]
    mean: float
    std: float
    zero_std: bool
    surplus_execution_ids: tuple[str, ...]
    excluded_execution_ids: tuple[str, ...]
    policy_version: int | None
    now: float

    def advantage_of(self, execution_id: str) -> float:
        """``A_i`` of a designated execution. Raises ``KeyError`` for any other id."""
        try:
            return self.advantages[self.execution_ids.index(execution_id)]
        except ValueError:
            raise KeyError(f"{execution_id!r} is not a designated execution of group {self.group_id!r}") from None

    def to_scheduler_event(self, num_micro_steps: int = 1) -> Any:
        """The scheduler's :class:`gyre.scheduler.GroupReady` for this group (int group ids)."""
        from gyre.scheduler.events import GroupReady  # the scheduler is a consumer; no import at load

        return GroupReady(group_id=int(self.group_id), num_micro_steps=int(num_micro_steps), now=self.now)


@dataclass(slots=True, frozen=True)
class GroupDropped:
    """A group that will never train (see :class:`TrajectoryBuffer`).

    ``open_execution_ids``: executions still open, for the shell to close as surplus.
    """

    group_id: Hashable
    reason: DropReason
    num_valid: int
    excluded_execution_ids: tuple[str, ...]
    open_execution_ids: tuple[str, ...]
    zero_std: bool
    now: float


@dataclass(slots=True)
class BufferCounters:
    """Cumulative counts (groups and executions)."""

    groups_added: int = 0
    groups_ready: int = 0
    groups_taken: int = 0
    groups_dropped_insufficient: int = 0
    groups_dropped_zero_std: int = 0
    groups_zero_std: int = 0          # all-equal groups seen (reported; filtered or not)
    executions_valid: int = 0         # outcomes with a valid assessed reward
    executions_placeholder: int = 0   # zero-reward placeholders
    executions_excluded: int = 0      # unresolved within the budget
    executions_lost: int = 0          # closed without any outcome (see execution_lost)
    executions_surplus: int = 0       # open when their group was finalised
    late_outcomes: int = 0            # outcomes that arrived after their group was finalised

    def as_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(slots=True)
class _Group:
    group_id: Hashable
    execution_ids: tuple[str, ...]
    policy_version: int | None
    rewarded: list[str] = field(default_factory=list)         # arrival order
    no_reward: list[str] = field(default_factory=list)        # excluded or lost
    outcomes: dict[str, ExecutionOutcome] = field(default_factory=dict)
    trajectories: dict[str, Any] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)
    status: str = "pending"  # pending | ready | taken | dropped

    @property
    def final(self) -> bool:
        return self.status != "pending"

    def open_ids(self) -> tuple[str, ...]:
        return tuple(e for e in self.execution_ids if e not in self.closed)


BufferEvent = ReadyGroup | GroupDropped


class TrajectoryBuffer:
    """Holds rollout groups until they are ready.

    * **ready** -- as soon as ``N`` executions have a reward (valid or placeholder), taking the
      first ``N`` in arrival order: these are the group's *designated* executions; the others
      are surplus (those still open are listed for the shell to close; later outcomes are
      counted and ignored).  Advantages are computed over the ``N`` designated rewards;
      excluded executions never enter the baseline;
    * **dropped** -- as soon as ``N`` rewards can no longer be reached (too many exclusions or
      lost executions), or, with ``filter_zero_std_groups``, when the designated rewards are
      all equal.  All-equal groups are reported (:attr:`ReadyGroup.zero_std`, a counter and a
      log line) either way.

    Args:
        n_per_group: ``N``, designated executions per group (``--n-samples-per-prompt``).
        advantage: advantage settings (``AdvantageConfig.from_args``); its
            ``filter_zero_std_groups`` drops all-equal groups.
        clock: seconds for event timestamps.

    Raises:
        ValueError: ``n_per_group < 1``.
    """

    def __init__(self, n_per_group: int, advantage: AdvantageConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if int(n_per_group) != n_per_group or n_per_group < 1:
            raise ValueError(f"n_per_group must be a positive int, got {n_per_group!r}")
        self.n = int(n_per_group)
        self.advantage = advantage or AdvantageConfig()
        self.clock = clock
        self.counters = BufferCounters()
        self._groups: dict[Hashable, _Group] = {}
        self._group_of: dict[str, Hashable] = {}
        self._ready: OrderedDict[Hashable, ReadyGroup] = OrderedDict()
        self._lock = threading.RLock()

    @classmethod
    def from_args(cls, args: argparse.Namespace, **kwargs: Any) -> "TrajectoryBuffer":
        """``N = --n-samples-per-prompt``, advantages from the admission flags."""
        return cls(int(args.n_samples_per_prompt), AdvantageConfig.from_args(args), **kwargs)

    # ------------------------------------------------------------------ input

    def add_group(self, group_id: Hashable, execution_ids: Sequence[str], policy_version: int | None = None) -> None:
        """Register a group with its ``N + oversample`` execution ids (at dispatch).

        Raises:
            ValueError: duplicate group or execution id, or fewer than ``N`` executions.
        """
        ids = tuple(execution_ids)
        with self._lock:
            if group_id in self._groups:
                raise ValueError(f"group {group_id!r} already registered")
            if len(ids) < self.n:
                raise ValueError(f"group {group_id!r} has {len(ids)} executions, needs at least N = {self.n}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"group {group_id!r} lists an execution twice")
            for e in ids:
                if e in self._group_of:
                    raise ValueError(f"execution {e!r} already belongs to group {self._group_of[e]!r}")
            self._groups[group_id] = _Group(group_id, ids, policy_version)
            for e in ids:
                self._group_of[e] = group_id
            self.counters.groups_added += 1

    def _group_for(self, execution_id: str) -> _Group:
        try:
            return self._groups[self._group_of[execution_id]]
        except KeyError:
            raise KeyError(f"unknown execution {execution_id!r}: register its group with add_group") from None

    def record_outcome(self, outcome: ExecutionOutcome, trajectory: Any = None) -> list[BufferEvent]:
        """An execution closed and was assessed; returns the events this caused.

        ``trajectory``: the execution's trajectory tree (or any payload), handed out with
        the ready group.

        Raises:
            KeyError: unknown execution. ValueError: a second outcome for one execution.
        """
        with self._lock:
            g = self._group_for(outcome.execution_id)
            eid = outcome.execution_id
            if eid in g.closed:
                raise ValueError(f"execution {eid!r} already has an outcome")
            g.closed.add(eid)
            g.outcomes[eid] = outcome
            if outcome.status is OutcomeStatus.VALID:
                self.counters.executions_valid += 1
            elif outcome.status is OutcomeStatus.PLACEHOLDER:
                self.counters.executions_placeholder += 1
            else:
                self.counters.executions_excluded += 1
            if g.final:
                self.counters.late_outcomes += 1
                return []
            if outcome.has_reward:
                g.rewarded.append(eid)
                g.trajectories[eid] = trajectory
            else:
                g.no_reward.append(eid)
            return self._update(g)

    def execution_lost(self, execution_id: str, reason: str = "") -> list[BufferEvent]:
        """An execution closed without any outcome (e.g. cancelled at the queue before launch);
        it counts like an excluded one for readiness."""
        with self._lock:
            g = self._group_for(execution_id)
            if execution_id in g.closed:
                return []
            g.closed.add(execution_id)
            self.counters.executions_lost += 1
            if g.final:
                return []
            logger.info("execution %s of group %r lost without an outcome: %s", execution_id, g.group_id, reason)
            g.no_reward.append(execution_id)
            return self._update(g)

    # ------------------------------------------------------------------ readiness

    def _finalise(self, g: _Group, status: str) -> tuple[str, ...]:
        g.status = status
        open_ids = g.open_ids()
        self.counters.executions_surplus += len(open_ids)
        return open_ids

    def _update(self, g: _Group) -> list[BufferEvent]:
        now = self.clock()
        if len(g.rewarded) >= self.n:
            designated = tuple(g.rewarded[: self.n])
            adv = compute_advantages({e: g.outcomes[e].reward for e in designated}, self.advantage)
            if adv.zero_std:
                self.counters.groups_zero_std += 1
                logger.info("group %r: all %d rewards equal (%.6g); advantages are 0%s", g.group_id, self.n,
                            adv.mean, ", dropped" if self.advantage.filter_zero_std_groups else "")
            # valid outcomes beyond the first N cannot exist yet (one arrives at a time)
            dropped = adv.zero_std and self.advantage.filter_zero_std_groups
            open_ids = self._finalise(g, "dropped" if dropped else "ready")
            if dropped:
                self.counters.groups_dropped_zero_std += 1
                return [GroupDropped(g.group_id, DropReason.ZERO_STD, len(g.rewarded), tuple(g.no_reward),
                                     open_ids, True, now)]
            ready = ReadyGroup(
                group_id=g.group_id,
                execution_ids=designated,
                outcomes=tuple(g.outcomes[e] for e in designated),
                rewards=tuple(float(g.outcomes[e].reward) for e in designated),
                advantages=tuple(adv.advantages[e] for e in designated),
                trajectories=tuple(g.trajectories.get(e) for e in designated),
                mean=adv.mean,
                std=adv.std,
                zero_std=adv.zero_std,
                surplus_execution_ids=open_ids,
                excluded_execution_ids=tuple(g.no_reward),
                policy_version=g.policy_version,
                now=now,
            )
            self._ready[g.group_id] = ready
            self.counters.groups_ready += 1
            return [ready]
        reachable = len(g.rewarded) + len(g.open_ids())
        if reachable < self.n:
            open_ids = self._finalise(g, "dropped")
            self.counters.groups_dropped_insufficient += 1
            logger.warning("group %r dropped: %d valid rewards, %d excluded/lost, N = %d", g.group_id,
                           len(g.rewarded), len(g.no_reward), self.n)
            return [GroupDropped(g.group_id, DropReason.INSUFFICIENT_VALID, len(g.rewarded), tuple(g.no_reward),
                                 open_ids, False, now)]
        return []

    # ------------------------------------------------------------------ output

    @property
    def num_ready(self) -> int:
        """Ready groups not yet taken (the scheduler's supply check)."""
        with self._lock:
            return len(self._ready)

    def ready_groups(self) -> tuple[ReadyGroup, ...]:
        """Ready groups not yet taken, in readiness order (not removed)."""
        with self._lock:
            return tuple(self._ready.values())

    def take(self, group_id: Hashable) -> ReadyGroup:
        """Remove and return a ready group (the stream packer, on ``EnqueueGroup``).

        Raises:
            KeyError: the group is not ready, or was already taken.
        """
        with self._lock:
            try:
                ready = self._ready.pop(group_id)
            except KeyError:
                raise KeyError(f"group {group_id!r} is not ready (or already taken)") from None
            self.counters.groups_taken += 1
            self._groups[group_id].status = "taken"
            return ready

    def group_status(self, group_id: Hashable) -> str:
        """``"pending"``, ``"ready"``, ``"taken"`` or ``"dropped"``. Raises ``KeyError`` if unknown."""
        with self._lock:
            return self._groups[group_id].status


def materialize_group(ready: ReadyGroup, rng: np.random.Generator,
                      config: AdmissionConfig | None = None) -> list[TrajectoryRow]:
    """Admission for a ready group: sample each designated execution's tree and materialise
    its rows with the execution's advantage.

    Executions whose payload is not a :class:`~gyre.trajectory.TrajectoryTree` (``None``)
    yield no rows; a placeholder's empty tree yields none either.
    """
    rows: list[TrajectoryRow] = []
    for eid, tree, adv in zip(ready.execution_ids, ready.trajectories, ready.advantages):
        if isinstance(tree, TrajectoryTree):
            rows.extend(materialize(tree, sample_trajectories(tree, rng, config), advantage=adv))
    return rows
