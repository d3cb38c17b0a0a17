"""Placement policies over one machinery: ``elastic``, ``async``, ``colocate`` (paper §4.2, §6).

A policy only *decides*; the :class:`~gyre.scheduler.scheduler.Scheduler` carries the decision
out (reroutes, role commands, bookkeeping). It answers the four questions of
:class:`PlacementPolicy`: which cells start in training, which cell moves into training next,
which cells return at a burst's end, and whether the core stays in training.

* :class:`ElasticPlacement` -- our reading of the paper's waterlevel policy: cells enter
  training in ascending order when the remaining rollout capacity covers the waterlevel and
  there is work for them; satellites return at burst end.
* :class:`AsyncPlacement` -- a fixed split; no role command is ever issued.
* :class:`ColocatePlacement` (``phi = 0``) -- the whole pool trains once the admitted
  executions have all finished, and returns after the burst.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .config import SchedulerConfig
from .events import CellState

if TYPE_CHECKING:  # pragma: no cover
    from .scheduler import Scheduler

_TRAINING_SIDE = (CellState.TRAINING, CellState.TO_TRAINING)


class PlacementPolicy(Protocol):
    """What a placement decides.

    * :meth:`initial_training_cells` -- cells that start in training;
    * :meth:`next_to_train` -- after every event: the next cell to move into training now, or
      ``None`` (asked again after each move, so several cells may move at once);
    * :meth:`release_at_burst_end` -- training cells other than the core that return to rollout
      after a burst's final optimizer update;
    * :meth:`retain_core` -- after the burst's weight publication and the next dispatch: does
      the core stay in training for the next burst?
    """

    name: str

    def initial_training_cells(self, config: SchedulerConfig) -> tuple[int, ...]: ...

    def next_to_train(self, s: "Scheduler") -> int | None: ...

    def release_at_burst_end(self, s: "Scheduler") -> list[int]: ...

    def retain_core(self, s: "Scheduler") -> bool: ...


def next_in_ascending_order(s: "Scheduler") -> int | None:
    """The lowest cell in rollout whose lower cells are all training (or switching to it).

    ``None`` when every cell trains, when a lower cell is still switching back to rollout, or
    when the cell is at or above the scheduler's ``training_cell_limit``.
    """
    for j, state in enumerate(s.cell_states):
        if state in _TRAINING_SIDE:
            continue
        return j if state is CellState.ROLLOUT and j < s.training_cell_limit else None
    return None


class ElasticPlacement:
    """Waterlevel policy: capacity and supply checks, ascending order, core retention (paper §4.2).

    * cells enter training in ascending order (core first); the next cell ``j`` moves when
      **capacity** -- the rollout capacity that stays (standalone + cells in rollout other than
      ``j``) covers the waterlevel ``d - f`` (running + queued executions) -- and **supply** --
      the current step's stream is open (more of its groups will arrive) or it holds more
      unfinished micro-steps than cells already training (one each), i.e. the joining cell has
      work;
    * satellites return at burst end; the core stays only if the supply check passes and the
      capacity check passes without it (cells already switching back to rollout count as
      rollout capacity here, since the core has no execution to reroute).
    """

    name = "elastic"

    def initial_training_cells(self, config: SchedulerConfig) -> tuple[int, ...]:
        return ()

    def next_to_train(self, s: "Scheduler") -> int | None:
        if not s.training_may_grow:
            return None
        j = next_in_ascending_order(s)
        if j is None:
            return None
        if s.rollout_capacity(excluding=j) < s.counters.waterlevel:
            return None
        if not s.supply_ok(busy_cells=s.cells_in(_TRAINING_SIDE)):
            return None
        return j

    def release_at_burst_end(self, s: "Scheduler") -> list[int]:
        return [c for c in range(1, s.config.num_cells) if s.cell_states[c] in _TRAINING_SIDE]

    def retain_core(self, s: "Scheduler") -> bool:
        return (s.supply_ok(busy_cells=0)
                and s.rollout_capacity(excluding=0, include_returning=True) >= s.counters.waterlevel)


class AsyncPlacement:
    """Fixed split: cells ``0..train_cells-1`` always train, the others always serve rollouts."""

    name = "async"

    def initial_training_cells(self, config: SchedulerConfig) -> tuple[int, ...]:
        return tuple(range(config.train_cells))

    def next_to_train(self, s: "Scheduler") -> int | None:
        return None

    def release_at_burst_end(self, s: "Scheduler") -> list[int]:
        return []

    def retain_core(self, s: "Scheduler") -> bool:
        return True


class ColocatePlacement:
    """Whole pool trains once every admitted execution finished; returns after each burst.

    With ``standalone_handoff`` the pool switches once the unfinished executions (running and
    queued) fit in the standalone pool and the current step's stream is open or holds
    unfinished micro-steps; without ``streaming`` it also waits until the burst's ``mu * B``
    groups are ready (the trainer takes whole batches, so training earlier would only idle);
    once the first cell moved, the others follow.
    """

    name = "colocate"

    def initial_training_cells(self, config: SchedulerConfig) -> tuple[int, ...]:
        return ()

    def next_to_train(self, s: "Scheduler") -> int | None:
        if not s.training_may_grow:
            return None
        if s.config.standalone_handoff:
            if s.counters.waterlevel > s.config.standalone_concurrency:
                return None
            if s.cells_in(_TRAINING_SIDE) == 0 and not s.supply_ok(busy_cells=0):
                return None
            if s.cells_in(_TRAINING_SIDE) == 0 and not s.config.streaming and s.burst_groups_missing > 0:
                return None
        elif s.counters.waterlevel > 0:
            return None
        return next_in_ascending_order(s)

    def release_at_burst_end(self, s: "Scheduler") -> list[int]:
        return [c for c in range(1, s.config.num_cells) if s.cell_states[c] in _TRAINING_SIDE]

    def retain_core(self, s: "Scheduler") -> bool:
        return False


def make_placement(config: SchedulerConfig) -> PlacementPolicy:
    """The policy named by ``config.placement``."""
    return {"elastic": ElasticPlacement, "async": AsyncPlacement,
            "colocate": ColocatePlacement}[config.placement]()
