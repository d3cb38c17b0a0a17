"""The scheduler: a deterministic state machine from events to commands (paper §4).

One object drives a real run (rank 0's scheduler thread) and the simulator (:mod:`gyre.sim`)
through the same API::

    sched = Scheduler(SchedulerConfig(...))
    commands = sched.handle(Start(now=0.0))
    ...  # carry out the commands in order; report what happened as events
    commands = sched.handle(ExecutionFinished(execution_id=7, now=3600.0))

It holds no thread, socket, clock or random generator: time arrives in events (``now``), ids
are assigned by counting, and the same event sequence always yields the same commands. The
order in which it settles after each event is in :class:`Scheduler`.
"""

from __future__ import annotations

import logging
from typing import Iterable

from .config import SchedulerConfig
from .dispatch import BoundaryDispatch, Counters
from .events import (STANDALONE, CellRoleChanged, CellState, CloseJoinWindow, Command, Event,
                     ExecutionFinished, ExecutionLaunched, GroupReady, Launch, MicroStepDone,
                     Publish, Reroute, Role, Start, SwitchFailed, Tick, ToRollout, ToTrain, WeightsPublished)
from .placement import PlacementPolicy, make_placement
from .routing import RouteTable

log = logging.getLogger(__name__)

_TARGET = {CellState.TO_TRAINING: Role.TRAINING, CellState.TO_ROLLOUT: Role.ROLLOUT}


class Scheduler:
    """Boundary dispatch + placement policy + route table, driven by :meth:`handle`.

    After every event the scheduler *settles*, in this order:

    1. ready groups enter the current step's stream (:class:`EnqueueGroup`);
    2. a drained stream closes its join window (:class:`CloseJoinWindow`); at a burst end the
       placement's satellites return (:class:`ToRollout`) and the core publishes (:class:`Publish`);
    3. the placement may move cells into training, each preceded by the :class:`Reroute`
       commands that move its executions (standalone first, then rollout cells in descending
       order);
    4. queued executions launch into free slots, in the same destination order (:class:`Launch`).

    :class:`WeightsPublished` triggers the next boundary dispatch (``mu * B`` groups) and the
    core retention decision.

    Args:
        config: queue and pool shape (:class:`SchedulerConfig`).
        placement: a policy object; default: the one named by ``config.placement``.

    Attributes (read-only for shells and metrics):
        cell_states: :class:`CellState` per cell.
        counters: the ``d, p, f`` counters (:class:`~gyre.scheduler.dispatch.Counters`).
        steps_done: optimizer steps whose join window closed.
        published_version: last published policy version.
        done: ``max_steps`` reached and the final weights published.
        role_log: ``(now, cell, CellState)`` for every state change, starting at ``Start``.
        switch_latencies: ``(cell, Role, seconds)`` per finished switch, from the role command
            to its :class:`CellRoleChanged`.
        switches: role commands issued (ToTrain + ToRollout).
        switch_failures: role commands answered by :class:`SwitchFailed`.
        training_cell_limit: cells ``>=`` this one never move into training (``num_cells`` until
            a cell fails ``max_switch_failures`` switches into training in a row; 0: none can).
        stalled: why the run cannot go on after failed switches (``None``: it can): the core
            cannot enter training, or a cell cannot return to rollout.
    """

    def __init__(self, config: SchedulerConfig, placement: PlacementPolicy | None = None) -> None:
        self.config = config
        self.policy = placement if placement is not None else make_placement(config)
        self.queue = BoundaryDispatch(config)
        self.routes = RouteTable(config.num_cells, config.rollout_concurrency_per_cell,
                                 config.standalone_concurrency)
        self.cell_states: list[CellState] = [CellState.ROLLOUT] * config.num_cells
        for cell in self.policy.initial_training_cells(config):
            self.cell_states[cell] = CellState.TRAINING
        self.now = 0.0
        self.started = False
        self.done = False
        self.steps_done = 0
        self.awaiting_publish: int | None = None
        self.role_log: list[tuple[float, int, CellState]] = []
        self.switch_latencies: list[tuple[int, Role, float]] = []
        self.switches = 0
        self._switch_started: dict[int, float] = {}
        self._release_pending: set[int] = set()
        self.switch_failures = 0
        self.training_cell_limit = config.num_cells
        self._failures_in_a_row: dict[tuple[int, Role], int] = {}
        self.stalled: str | None = None

    # ------------------------------------------------------------------ views for policies

    @property
    def counters(self) -> Counters:
        """Cumulative ``d, p, f`` counters."""
        return self.queue.counters

    @property
    def published_version(self) -> int:
        """Last published policy version (``v_d`` of the next dispatch)."""
        return self.queue.published_version

    @property
    def mean_staleness(self) -> float:
        """Mean staleness ``d`` over consumed groups (paper App. A)."""
        return self.queue.mean_staleness

    @property
    def training_may_grow(self) -> bool:
        """Cells may enter training: started, steps remain, and no publication is pending."""
        return self.started and not self.done and self.awaiting_publish is None and not self._steps_exhausted

    @property
    def _steps_exhausted(self) -> bool:
        return self.config.max_steps is not None and self.steps_done >= self.config.max_steps

    def cells_in(self, states: Iterable[CellState]) -> int:
        """Number of cells whose state is one of ``states``."""
        wanted = set(states)
        return sum(1 for s in self.cell_states if s in wanted)

    def rollout_capacity(self, excluding: int | None = None, include_returning: bool = False) -> int:
        """Concurrent executions the rollout side holds: ``c_s`` + ``c`` per rollout cell.

        ``excluding``: leave this cell out; ``include_returning``: count cells switching back to
        rollout (they will take work after their switch) as rollout cells.
        """
        ok = (CellState.ROLLOUT, CellState.TO_ROLLOUT) if include_returning else (CellState.ROLLOUT,)
        cells = sum(1 for c, s in enumerate(self.cell_states) if s in ok and c != excluding)
        return self.config.standalone_concurrency + cells * self.config.rollout_concurrency_per_cell

    def joining_cells(self) -> list[int]:
        """Cells that take part in the current step now: the training cells from the core upwards
        up to the first one that is not training; none once the run is done, while a publication
        is pending, or when the step is past ``max_steps``."""
        if self.done or self.awaiting_publish is not None or (
                self.config.max_steps is not None and self.queue.stream.step >= self.config.max_steps):
            return []
        cells = []
        for c, state in enumerate(self.cell_states):
            if state is not CellState.TRAINING:
                break
            cells.append(c)
        return cells

    def supply_ok(self, busy_cells: int) -> bool:
        """Ready work for one more training cell: the stream is open, or it holds more
        unfinished micro-steps than the ``busy_cells`` already training."""
        q = self.queue
        return q.stream_open or q.pending_micro_steps > busy_cells

    @property
    def burst_groups_missing(self) -> int:
        """Groups the rest of the current burst still needs beyond those ready or already in the
        current step's stream (0: the burst's data is complete)."""
        cfg = self.config
        steps_left = cfg.mu - self.steps_done % cfg.mu
        if cfg.max_steps is not None:
            steps_left = min(steps_left, cfg.max_steps - self.steps_done)
        have = len(self.queue.stream.group_ids) + self.queue.ready_unconsumed
        return max(0, steps_left * cfg.B - have)

    def resume_at(self, step: int) -> None:
        """Before :class:`Start`: continue a run whose steps ``0..step-1`` are done and whose
        published policy version is ``step`` (checkpoint resume).  Group and execution ids count
        from 0 again; the shell keeps them apart from the first run's.

        Raises:
            ValueError: after Start, or ``step`` outside ``[0, max_steps)``.
        """
        if self.started:
            raise ValueError("resume_at() after Start")
        if step < 0 or (self.config.max_steps is not None and step >= self.config.max_steps):
            raise ValueError(f"cannot resume at step {step} of {self.config.max_steps}")
        self.steps_done = step
        self.queue.stream = type(self.queue.stream)(step=step)
        self.queue.published_version = step

    # ------------------------------------------------------------------ the API

    def handle(self, event: Event) -> list[Command]:
        """Consume one event, return the commands to carry out in order.

        Raises:
            ValueError: an event that contradicts the state (unknown id, time going backwards,
                an acknowledgement of a switch that was never commanded, ...).
        """
        now = getattr(event, "now", None)
        if now is not None:
            if now < self.now:
                raise ValueError(f"time went backwards: {now} < {self.now}")
            self.now = float(now)
        if not self.started and not isinstance(event, Start):
            raise ValueError(f"{type(event).__name__} before Start")
        cmds: list[Command] = []
        if isinstance(event, Start):
            self._on_start(cmds)
        elif isinstance(event, ExecutionFinished):
            rec = self.queue.finish(event.execution_id, event.status)
            if rec is not None and rec.route is not None:
                self.routes.release(rec.execution_id, rec.route)
        elif isinstance(event, ExecutionLaunched):
            self.queue.acknowledge(event.execution_id)
        elif isinstance(event, GroupReady):
            self.queue.group_ready(event.group_id, event.num_micro_steps)
        elif isinstance(event, MicroStepDone):
            self._on_micro_step_done(event)
        elif isinstance(event, CellRoleChanged):
            self._on_role_changed(event, cmds)
        elif isinstance(event, SwitchFailed):
            self._on_switch_failed(event, cmds)
        elif isinstance(event, WeightsPublished):
            self._on_published(event, cmds)
        elif isinstance(event, Tick):
            pass  # no decision depends on time alone today; a Tick only re-settles
        else:
            raise ValueError(f"unknown event {event!r}")
        self._settle(cmds)
        return cmds

    # ------------------------------------------------------------------ event handlers

    def _on_start(self, cmds: list[Command]) -> None:
        if self.started:
            raise ValueError("Start received twice")
        self.started = True
        for cell, state in enumerate(self.cell_states):
            self.role_log.append((self.now, cell, state))
        cmds.extend(self.queue.dispatch(self.config.queue_depth_groups))

    def _on_micro_step_done(self, event: MicroStepDone) -> None:
        self._check_cell(event.cell)
        if self.cell_states[event.cell] is not CellState.TRAINING:
            raise ValueError(f"micro-step done by cell {event.cell} in state {self.cell_states[event.cell].value}")
        self.queue.micro_step_done(event.step)

    def _on_role_changed(self, event: CellRoleChanged, cmds: list[Command]) -> None:
        cell = event.cell
        self._check_cell(cell)
        state = self.cell_states[cell]
        if _TARGET.get(state) is not Role(event.role):
            raise ValueError(f"cell {cell} reported role {Role(event.role).value} while {state.value}")
        started = self._switch_started.pop(cell, self.now)
        self.switch_latencies.append((cell, Role(event.role), self.now - started))
        new = CellState.TRAINING if Role(event.role) is Role.TRAINING else CellState.ROLLOUT
        self._failures_in_a_row.pop((cell, Role(event.role)), None)
        self._set_state(cell, new)
        if new is CellState.TRAINING and cell in self._release_pending:
            self._release_pending.discard(cell)
            self._to_rollout(cell, cmds)

    def _on_switch_failed(self, event: SwitchFailed, cmds: list[Command]) -> None:
        """The cell is back in its previous role.  Into training: cells above it that train or
        switch into training return to rollout (they follow it in ascending order and cannot join a
        step without it), the placement may command it again, and the ``max_switch_failures``-th
        failure in a row caps :attr:`training_cell_limit`.
        Back to rollout: commanded again at once (the release stands) until the cap, where
        :attr:`stalled` says why the run cannot go on."""
        cell, role = event.cell, Role(event.role)
        self._check_cell(cell)
        state = self.cell_states[cell]
        if _TARGET.get(state) is not role:
            raise ValueError(f"cell {cell} failed to switch to {role.value} while {state.value}")
        self._switch_started.pop(cell, None)
        self._release_pending.discard(cell)
        self.switch_failures += 1
        n = self._failures_in_a_row[(cell, role)] = self._failures_in_a_row.get((cell, role), 0) + 1
        self._set_state(cell, CellState.ROLLOUT if role is Role.TRAINING else CellState.TRAINING)
        capped = n >= self.config.max_switch_failures
        if role is Role.TRAINING:  # cells above it went in after it (ascending order): they return
            for c in range(cell + 1, self.config.num_cells):
                if self.cell_states[c] is CellState.TRAINING:
                    self._to_rollout(c, cmds)
                elif self.cell_states[c] is CellState.TO_TRAINING:
                    self._release_pending.add(c)
        if role is Role.TRAINING and capped:
            self.training_cell_limit = min(self.training_cell_limit, cell)
            log.warning("cells %d and above stay in rollout for the rest of the run", self.training_cell_limit)
            if cell == 0:
                self.stalled = (f"cell 0 (the core) could not switch into training {n} times in a row, "
                                "so no cell can train")
        elif role is Role.ROLLOUT and capped:
            self.stalled = f"cell {cell} could not return to rollout {n} times in a row"
        elif role is Role.ROLLOUT:
            self._to_rollout(cell, cmds)

    def _on_published(self, event: WeightsPublished, cmds: list[Command]) -> None:
        if self.awaiting_publish is None or event.version != self.awaiting_publish:
            raise ValueError(f"weights version {event.version} published, expected {self.awaiting_publish}")
        self.awaiting_publish = None
        self.queue.published_version = event.version
        if self._steps_exhausted:
            self.done = True
            return
        cmds.extend(self.queue.dispatch(self.config.mu * self.config.B))
        cmds.extend(self.queue.fill_stream())
        core = self.cell_states[0]
        if core in (CellState.TRAINING, CellState.TO_TRAINING) and not self.policy.retain_core(self):
            if core is CellState.TRAINING:
                self._to_rollout(0, cmds)
            else:
                self._release_pending.add(0)

    # ------------------------------------------------------------------ settling

    def _settle(self, cmds: list[Command]) -> None:
        q = self.queue
        while self.config.max_steps is None or q.stream.step < self.config.max_steps:
            cmds.extend(q.fill_stream())
            if not (q.stream_drained and self.awaiting_publish is None):
                break
            step = q.advance_step()
            self.steps_done = step + 1
            cmds.append(CloseJoinWindow(step))
            if self.steps_done % self.config.mu == 0 or self._steps_exhausted:
                for cell in self.policy.release_at_burst_end(self):
                    if self.cell_states[cell] is CellState.TRAINING:
                        self._to_rollout(cell, cmds)
                    else:
                        self._release_pending.add(cell)
                self.awaiting_publish = self.steps_done
                cmds.append(Publish(self.steps_done))
        while (cell := self.policy.next_to_train(self)) is not None:
            self._to_training(cell, cmds)
        self._launch(cmds)

    def _rollout_routes(self) -> list[int]:
        cells = [c for c, s in enumerate(self.cell_states) if s is CellState.ROLLOUT]
        return self.routes.destination_order(cells, self.config.standalone_concurrency > 0)

    def _launch(self, cmds: list[Command]) -> None:
        q = self.queue
        if q.counters.queued == 0:
            return
        for route in self._rollout_routes():
            free = self.routes.free(route)
            while free > 0:
                rec = q.pop_queued()
                if rec is None:
                    return
                q.mark_launched(rec, route)
                self.routes.assign(rec.execution_id, route)
                cmds.append(Launch(rec.execution_id, rec.group_id, route))
                free -= 1

    def _to_training(self, cell: int, cmds: list[Command]) -> None:
        dests = [r for r in self._rollout_routes() if r != cell]
        for dest, eids in self.routes.plan_evacuation(cell, dests):
            self.routes.move(eids, cell, dest)
            for eid in eids:
                self.queue.executions[eid].route = dest
            cmds.append(Reroute(tuple(eids), cell, dest))
        self._set_state(cell, CellState.TO_TRAINING)
        self._switch_started[cell] = self.now
        self.switches += 1
        cmds.append(ToTrain(cell))

    def _to_rollout(self, cell: int, cmds: list[Command]) -> None:
        self._set_state(cell, CellState.TO_ROLLOUT)
        self._switch_started[cell] = self.now
        self.switches += 1
        cmds.append(ToRollout(cell))

    def _set_state(self, cell: int, state: CellState) -> None:
        log.debug("t=%.1f cell %d -> %s", self.now, cell, state.value)
        self.cell_states[cell] = state
        self.role_log.append((self.now, cell, state))

    def _check_cell(self, cell: int) -> None:
        if not 0 <= cell < self.config.num_cells:
            raise ValueError(f"unknown cell {cell}")

    # ------------------------------------------------------------------ reporting

    def role_timeline(self, end: float) -> list[list[tuple[float, float, CellState]]]:
        """Per cell, ``(start, stop, state)`` intervals from ``Start`` up to time ``end``."""
        out: list[list[tuple[float, float, CellState]]] = [[] for _ in range(self.config.num_cells)]
        last: dict[int, tuple[float, CellState]] = {}
        for t, cell, state in self.role_log:
            if cell in last:
                t0, s0 = last[cell]
                if t > t0:
                    out[cell].append((t0, t, s0))
            last[cell] = (t, state)
        for cell, (t0, s0) in last.items():
            if end > t0:
                out[cell].append((t0, end, s0))
        return out

    def check_invariants(self) -> None:
        """Assert the counter and routing invariants; for tests.

        Raises:
            AssertionError: ``0 <= f <= p <= d`` broken, a route over capacity, or a running
                execution whose route does not serve rollouts.
        """
        c = self.counters
        assert 0 <= c.f <= c.p <= c.d, (c.d, c.p, c.f)
        running = 0
        for route, cap in self.routes.capacity.items():
            occ = self.routes.occupancy(route)
            assert occ <= cap, (route, occ, cap)
            if occ and route != STANDALONE:
                assert self.cell_states[route] is CellState.ROLLOUT, (route, self.cell_states[route])
            running += occ
        assert running == c.running, (running, c.running)
