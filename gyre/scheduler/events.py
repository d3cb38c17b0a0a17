"""Typed events the scheduler consumes and typed commands it returns.

The shell -- rank 0's scheduler thread in a real run, :mod:`gyre.sim` in the simulator -- feeds
:data:`Event` objects through :meth:`gyre.scheduler.Scheduler.handle` and carries out the
:data:`Command` objects it returns, *in the order returned*. Records are frozen dataclasses;
times are seconds on the shell's clock (``now``); ids are ints the scheduler assigns.

Lifecycle of one rollout group (paper §4.1; each record's docstring says what it means)::

    Dispatch -> Launch -> ExecutionLaunched -> ExecutionFinished   (Reroute moves running ones)
    GroupReady -> EnqueueGroup -> MicroStepDone ... -> CloseJoinWindow
    Publish -> WeightsPublished                                      (burst end; next dispatch)

Cell roles (paper §4.2): ``ToTrain`` / ``ToRollout`` -> ``CellRoleChanged`` (or ``SwitchFailed``:
the cell is back in its previous role).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, Union

#: Route id of the standalone pool (engines that only ever serve rollouts).
#: Cells are routes ``0..K-1``; cell 0 is the core cell.
STANDALONE: Final[int] = -1


class Role(str, enum.Enum):
    """What a cell does: serve rollouts or host one training replica."""

    ROLLOUT = "rollout"
    TRAINING = "training"


class CellState(str, enum.Enum):
    """A cell's state in the scheduler: a role, or a switch towards one."""

    ROLLOUT = "rollout"
    TO_TRAINING = "to_training"
    TRAINING = "training"
    TO_ROLLOUT = "to_rollout"


class ExecutionStatus(str, enum.Enum):
    """Why an execution closed; every status increments ``f`` exactly once."""

    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    SURPLUS = "surplus"


# --------------------------------------------------------------------------- events


@dataclass(slots=True, frozen=True)
class Start:
    """First event of a run: fill the queue to ``(phi + mu) * B`` groups and launch (paper §4.1)."""

    now: float = 0.0


@dataclass(slots=True, frozen=True)
class Tick:
    """Time passes; the scheduler re-evaluates its policy (no other effect)."""

    now: float


@dataclass(slots=True, frozen=True)
class ExecutionLaunched:
    """Acknowledgement that the harness of a :class:`Launch` is running (duplicates ignored)."""

    execution_id: int
    now: float | None = None


@dataclass(slots=True, frozen=True)
class ExecutionFinished:
    """A launched execution closed (completion, failure, timeout, cancellation, surplus).

    Counted once: a repeat for the same execution (a retried notification) is ignored.
    """

    execution_id: int
    status: ExecutionStatus = ExecutionStatus.COMPLETED
    now: float | None = None


@dataclass(slots=True, frozen=True)
class GroupReady:
    """The trajectory buffer holds the group's admitted outcomes.

    ``num_micro_steps``: how many micro-steps the stream packing buffer will emit for it (>= 0).
    Executions of the group still queued are closed as surplus at the queue; those still
    running are the shell's to close (it reports them with ``ExecutionStatus.SURPLUS``).
    """

    group_id: int
    num_micro_steps: int = 1
    now: float | None = None


@dataclass(slots=True, frozen=True)
class MicroStepDone:
    """Training cell ``cell`` finished one micro-step of step ``step``."""

    cell: int
    step: int
    now: float | None = None


@dataclass(slots=True, frozen=True)
class CellRoleChanged:
    """Cell ``cell`` finished switching into ``role`` (acknowledges ToTrain / ToRollout)."""

    cell: int
    role: Role
    now: float | None = None


@dataclass(slots=True, frozen=True)
class SwitchFailed:
    """Cell ``cell`` could not switch into ``role`` and is back in the other role (answers
    ToTrain / ToRollout instead of :class:`CellRoleChanged`)."""

    cell: int
    role: Role
    now: float | None = None


@dataclass(slots=True, frozen=True)
class WeightsPublished:
    """The core cell published policy version ``version`` to every engine (acknowledges Publish)."""

    version: int
    now: float | None = None


Event = Union[Start, Tick, ExecutionLaunched, ExecutionFinished, GroupReady, MicroStepDone,
              CellRoleChanged, SwitchFailed, WeightsPublished]


# --------------------------------------------------------------------------- commands


@dataclass(slots=True, frozen=True)
class Dispatch:
    """Queue group ``group_id`` (one query) with its execution ids, at published ``policy_version``.

    Boundary dispatch (paper §4.1): only at startup and after a burst's weight publication.
    The shell picks the query and prepares the executions; harnesses start at :class:`Launch`.
    """

    group_id: int
    policy_version: int
    execution_ids: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class Launch:
    """Start execution ``execution_id`` now, pinned to route ``dest`` (a cell or ``STANDALONE``)."""

    execution_id: int
    group_id: int
    dest: int


@dataclass(slots=True, frozen=True)
class Reroute:
    """Move running executions' routes from ``source`` to ``dest``.

    The destination capacity is already reserved; outstanding model requests on ``source`` are
    cancelled by the shell and retried at ``dest`` (the harness sees one normal response).
    """

    execution_ids: tuple[int, ...]
    source: int
    dest: int


@dataclass(slots=True, frozen=True)
class ToTrain:
    """Switch ``cell`` from rollout to training (it no longer accepts requests)."""

    cell: int


@dataclass(slots=True, frozen=True)
class ToRollout:
    """Switch ``cell`` from training back to rollout (restore its engine, newest weights)."""

    cell: int


@dataclass(slots=True, frozen=True)
class EnqueueGroup:
    """Admit ready group ``group_id`` into the stream of optimizer step ``step`` (0-based).

    ``staleness`` is ``d = v_t - v_d``: the policy version before the step
    (``v_t = step``) minus the published version at the group's dispatch.
    """

    group_id: int
    step: int
    staleness: int


@dataclass(slots=True, frozen=True)
class CloseJoinWindow:
    """Step ``step``'s stream is drained: no satellite joins it any more; the core aggregates
    gradients and performs the step's one optimizer update."""

    step: int


@dataclass(slots=True, frozen=True)
class Publish:
    """Burst end: after its update the core publishes policy ``version`` to every engine."""

    version: int


Command = Union[Dispatch, Launch, Reroute, ToTrain, ToRollout, EnqueueGroup, CloseJoinWindow, Publish]
