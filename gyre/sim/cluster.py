"""Discrete-event simulation of ``K`` cells + a standalone pool driving the real scheduler.

The simulator is the *imperative shell* of :class:`gyre.scheduler.Scheduler`: it feeds the very
same object the very same events a real run does and carries out its commands on simulated
hardware, on a `simpy <https://simpy.readthedocs.io>`_ clock. Events are delivered one at a
time from simpy callbacks (never re-entrantly), so the scheduler sees a strictly ordered stream;
equal-time events keep their scheduling order, so a run is a function of its seed.

:class:`ClusterSim` runs one placement; :class:`SimConfig` holds the simulated costs
(executions, reroutes, groups, training, role switches); :class:`SimResult` is the outcome.
The run ends when the weights of the last step are published.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import simpy

from gyre.scheduler import (STANDALONE, CellRoleChanged, CellState, CloseJoinWindow, Command, Dispatch,
                            EnqueueGroup, Event, ExecutionFinished, ExecutionLaunched, ExecutionStatus,
                            GroupReady, Launch, MicroStepDone, Publish, Reroute, Role, Scheduler,
                            SchedulerConfig, Start, ToRollout, ToTrain, WeightsPublished)
from gyre.scheduler.placement import PlacementPolicy

from .workload import Workload


@dataclass(slots=True, frozen=True)
class SimConfig:
    """Simulated hardware timings (seconds) and effects.

    * **Executions** (:class:`~gyre.scheduler.events.Launch`): a duration and a timeout flag
      from the workload, drawn per group at :class:`~gyre.scheduler.events.Dispatch`. Durations
      are taken at full occupancy; with ``inference_slowdown = a`` an execution progresses at
      rate ``(1 + a) / (1 + a * u)`` where ``u`` is its engine's occupancy fraction when it was
      launched or rerouted (a cheap stand-in for batch-size-dependent decode speed; 0 by
      default, so the workload statistics hold as fitted).
    * **Reroutes** (:class:`~gyre.scheduler.events.Reroute`): an execution whose current model
      call is in flight (its calls are evenly spaced; a call occupies ``model_time_fraction``
      of each interval) has that call cancelled and retried at the destination, losing
      ``reroute_s`` (the retried call starts over there; nothing is transferred); between calls
      a reroute costs nothing.
    * **Groups**: ready ``eval_s`` after their ``N``-th execution closes (with oversampling the
      others are closed as surplus), with ``micro_steps_per_group`` micro-steps each.
    * **Training**: one step is ``B * micro_steps_per_group`` micro-steps; a micro-step takes
      ``train_step_cell_s / (B * micro_steps_per_group)`` seconds on one cell, times
      ``1 + dp_overhead * (k - 1)`` with ``k`` cells participating. Cells claim micro-steps of
      the step whose weights they hold. :class:`~gyre.scheduler.events.CloseJoinWindow` costs
      the core ``optimizer_s``; after a non-final step of a burst the satellites receive the
      parameters in ``broadcast_s``; a satellite joining mid-burst pulls the core's snapshot in
      ``pull_s``; :class:`~gyre.scheduler.events.Publish` costs the core ``publish_s`` more.
    * **Role switches**: rollout -> training ``switch_to_train_s``, training -> rollout
      ``switch_to_rollout_s`` (defaults: the paper reports 8.52 s and 3.46 s).
    """

    switch_to_train_s: float = 8.52
    switch_to_rollout_s: float = 3.46
    micro_steps_per_group: int = 4
    train_step_cell_s: float = 3600.0
    dp_overhead: float = 0.0
    optimizer_s: float = 30.0
    broadcast_s: float = 10.0
    pull_s: float = 10.0
    publish_s: float = 30.0
    eval_s: float = 0.0
    launch_s: float = 0.0
    inference_slowdown: float = 0.0
    model_time_fraction: float = 0.5
    reroute_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("switch_to_train_s", "switch_to_rollout_s", "train_step_cell_s", "dp_overhead",
                     "optimizer_s", "broadcast_s", "pull_s", "publish_s", "eval_s", "launch_s",
                     "inference_slowdown", "reroute_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.micro_steps_per_group < 0:
            raise ValueError(f"micro_steps_per_group must be >= 0, got {self.micro_steps_per_group}")
        if not 0 <= self.model_time_fraction <= 1:
            raise ValueError(f"model_time_fraction must be in [0, 1], got {self.model_time_fraction}")


@dataclass(slots=True)
class SimResult:
    """Outcome of one simulated run (times in seconds unless named ``_h``)."""

    placement: str
    phi: float
    mu: int
    steps: int
    end_time_s: float
    mean_staleness: float
    expected_staleness: float
    switches: int
    train_share: list[float]
    rollout_utilisation: float
    switch_latency_s: dict[str, float]
    counters: dict[str, int]
    rerouted_executions: int
    retried_model_calls: int
    model_calls: int
    step_end_s: list[float]
    timeline: list[list[tuple[float, float, str]]] = field(repr=False)

    @property
    def hours(self) -> float:
        """End-to-end time in hours."""
        return self.end_time_s / 3600.0

    def summary(self) -> dict:
        """The ``--json`` entry of ``tools/simulate.py`` for this placement."""
        return {"hours": round(self.hours, 3), "phi": self.phi, "mu": self.mu,
                "mean_staleness": round(self.mean_staleness, 4), "switches": self.switches,
                "train_share": [round(x, 4) for x in self.train_share]}


@dataclass(slots=True)
class _Exec:
    group_id: int
    work_s: float          # remaining reference work
    total_s: float
    timed_out: bool
    calls: int
    route: int | None = None
    seg_start: float = 0.0
    mult: float = 1.0
    token: int = 0
    launched_at: float = 0.0
    running: bool = False
    closed: bool = False


@dataclass(slots=True)
class _Group:
    execution_ids: tuple[int, ...]
    finished: int = 0
    ready_sent: bool = False


class ClusterSim:
    """One simulated run of one placement.

    Args:
        sched_config: scheduler shape (``max_steps`` is required: the run ends at its publication).
        sim_config: hardware timings.
        workload: execution durations (its ``rng`` draws come from ``seed``).
        seed: seeds the workload draws and the reroute call positions.
        placement: optional policy object (default: ``sched_config.placement``).
        check: after every event, assert the scheduler's invariants and that the simulated
            engines' occupancy equals the scheduler's routes (tests; slower).

    Raises:
        ValueError: ``max_steps`` missing.
    """

    def __init__(self, sched_config: SchedulerConfig, sim_config: SimConfig, workload: Workload,
                 seed: int = 0, placement: PlacementPolicy | None = None, check: bool = False) -> None:
        if sched_config.max_steps is None:
            raise ValueError("the simulator needs SchedulerConfig.max_steps")
        self.cfg = sched_config
        self.sim = sim_config
        self.workload = workload
        self.rng = np.random.default_rng(seed)
        self.env = simpy.Environment()
        self.sched = Scheduler(sched_config, placement)
        self.execs: dict[int, _Exec] = {}
        self.groups: dict[int, _Group] = {}
        self.occupancy: dict[int, int] = {r: 0 for r in range(sched_config.num_cells)}
        self.occupancy[STANDALONE] = 0
        self.version = 0                     # optimizer updates completed
        self.has_version: list[int | None] = [None] * sched_config.num_cells
        self.busy = [False] * sched_config.num_cells
        self.pending: dict[int, int] = {}    # step -> enqueued, unclaimed micro-steps
        self.group_micro: dict[int, int] = {}
        self.core_free_at = 0.0
        self.publish_pending: int | None = None
        self.micro_s = sim_config.train_step_cell_s / max(1, sched_config.B * sim_config.micro_steps_per_group)
        self.end = self.env.event()
        self.step_end_s: list[float] = []
        self.busy_slot_s = 0.0
        self.rerouted = 0
        self.retried_calls = 0
        self.model_calls = 0
        self.on_step: Callable[[int], None] | None = None
        self.check = check
        #: ``(time, kind, a, b)`` in time order: ``dispatch`` (group, version), ``finish``
        #: (execution, route) when an execution closes, ``ready`` (group, -1), ``enqueue``
        #: (group, step), ``micro`` / ``micro_done`` (cell, step) when a micro-step starts / ends,
        #: ``update`` (step, -1) when a step's optimizer update is done, ``publish`` (version, -1).
        #: :mod:`gyre.sim.mechanisms` reads it.
        self.event_log: list[tuple[float, str, int, int]] = []
        for cell, v in enumerate(self.has_version):
            if self.sched.cell_states[cell] is CellState.TRAINING:
                self.has_version[cell] = 0

    # ------------------------------------------------------------------ plumbing

    def _at(self, delay: float, fn: Callable[[], None]) -> None:
        ev = self.env.timeout(max(0.0, delay))
        ev.callbacks.append(lambda _ev: fn())

    def _deliver(self, event: Event) -> None:
        for cmd in self.sched.handle(event):
            self._apply(cmd)
        if self.check:
            self.sched.check_invariants()
            for route, occ in self.occupancy.items():
                assert occ == self.sched.routes.occupancy(route), (route, occ, self.sched.routes.occupancy(route))
                assert occ <= self.sched.routes.capacity[route]

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, Launch):
            self._launch(cmd)
        elif isinstance(cmd, Dispatch):
            g = self.workload.sample_group(self.rng, len(cmd.execution_ids))
            self.event_log.append((self.env.now, "dispatch", cmd.group_id, cmd.policy_version))
            self.groups[cmd.group_id] = _Group(cmd.execution_ids)
            for i, eid in enumerate(cmd.execution_ids):
                d = float(g.durations_s[i])
                self.execs[eid] = _Exec(cmd.group_id, d, d, bool(g.timed_out[i]), int(g.model_calls[i]))
        elif isinstance(cmd, Reroute):
            self._reroute(cmd)
        elif isinstance(cmd, ToTrain):
            cell = cmd.cell
            self._at(self.sim.switch_to_train_s, lambda: self._arrived(cell, Role.TRAINING))
        elif isinstance(cmd, ToRollout):
            cell = cmd.cell
            self.has_version[cell] = None
            self._at(self.sim.switch_to_rollout_s, lambda: self._arrived(cell, Role.ROLLOUT))
        elif isinstance(cmd, EnqueueGroup):
            self.event_log.append((self.env.now, "enqueue", cmd.group_id, cmd.step))
            self.pending[cmd.step] = self.pending.get(cmd.step, 0) + self.sim.micro_steps_per_group
            self._claim()
        elif isinstance(cmd, CloseJoinWindow):
            self.core_free_at = max(self.env.now, self.core_free_at) + self.sim.optimizer_s
            step = cmd.step
            self._at(self.core_free_at - self.env.now, lambda: self._update_done(step))
        elif isinstance(cmd, Publish):
            self.publish_pending = cmd.version
            self.core_free_at = max(self.env.now, self.core_free_at) + self.sim.publish_s
            version = cmd.version
            self._at(self.core_free_at - self.env.now, lambda: self._published(version))
        else:  # pragma: no cover - exhaustive
            raise TypeError(f"unknown command {cmd!r}")

    # ------------------------------------------------------------------ rollout side

    def _mult(self, route: int) -> float:
        a = self.sim.inference_slowdown
        if a == 0:
            return 1.0
        cap = self.sched.routes.capacity[route]
        return (1 + a * self.occupancy[route] / cap) / (1 + a)

    def _launch(self, cmd: Launch) -> None:
        ex = self.execs[cmd.execution_id]
        now = self.env.now
        ex.route = cmd.dest
        ex.running = True
        ex.launched_at = now
        ex.seg_start = now
        self.occupancy[cmd.dest] += 1
        self.model_calls += ex.calls
        eid = cmd.execution_id
        self._at(self.sim.launch_s, lambda: self._deliver(ExecutionLaunched(eid, now=self.env.now)))
        if self.groups[ex.group_id].ready_sent:  # group already complete: close as surplus
            self._at(0.0, lambda: self._close(eid, ExecutionStatus.SURPLUS))
            return
        ex.mult = self._mult(cmd.dest)
        self._schedule_finish(eid, ex.work_s * ex.mult)

    def _schedule_finish(self, eid: int, delay: float) -> None:
        ex = self.execs[eid]
        ex.token += 1
        token = ex.token
        self._at(delay, lambda: self._finished(eid, token))

    def _reroute(self, cmd: Reroute) -> None:
        now = self.env.now
        for eid in cmd.execution_ids:
            ex = self.execs[eid]
            ex.work_s = max(0.0, ex.work_s - max(0.0, now - ex.seg_start) / ex.mult)
            self.occupancy[cmd.source] -= 1
            self.occupancy[cmd.dest] += 1
            ex.route = cmd.dest
            ex.seg_start = now
            ex.mult = self._mult(cmd.dest)
            self.rerouted += 1
            progress = 1.0 - ex.work_s / ex.total_s if ex.total_s > 0 else 1.0
            penalty = 0.0
            if (progress * ex.calls) % 1.0 < self.sim.model_time_fraction:
                self.retried_calls += 1
                penalty = self.sim.reroute_s
            ex.seg_start = now + penalty
            self._schedule_finish(eid, penalty + ex.work_s * ex.mult)

    def _finished(self, eid: int, token: int) -> None:
        ex = self.execs[eid]
        if token != ex.token or ex.closed:
            return
        self._close(eid, ExecutionStatus.TIMEOUT if ex.timed_out else ExecutionStatus.COMPLETED)
        grp = self.groups[ex.group_id]
        grp.finished += 1
        if grp.finished >= self.cfg.N and not grp.ready_sent:
            grp.ready_sent = True
            gid = ex.group_id
            self._at(self.sim.eval_s, lambda: self._group_ready(gid))

    def _close(self, eid: int, status: ExecutionStatus) -> None:
        ex = self.execs[eid]
        if ex.closed:
            return
        ex.closed = True
        ex.running = False
        ex.token += 1
        self.occupancy[ex.route] -= 1
        self.busy_slot_s += self.env.now - ex.launched_at
        self.event_log.append((self.env.now, "finish", eid, ex.route))
        self._deliver(ExecutionFinished(eid, status, now=self.env.now))

    def _group_ready(self, gid: int) -> None:
        for eid in self.groups[gid].execution_ids:
            if self.execs[eid].running:
                self._close(eid, ExecutionStatus.SURPLUS)
        self.event_log.append((self.env.now, "ready", gid, -1))
        self._deliver(GroupReady(gid, self.sim.micro_steps_per_group, now=self.env.now))

    # ------------------------------------------------------------------ training side

    def _arrived(self, cell: int, role: Role) -> None:
        self._deliver(CellRoleChanged(cell, role, now=self.env.now))
        if role is Role.TRAINING and self.sched.cell_states[cell] is CellState.TRAINING:
            if cell == 0:
                if self.publish_pending is None:
                    self.has_version[0] = self.version
                self._claim()
            else:
                self._at(self.sim.pull_s, lambda: self._pulled(cell))

    def _pulled(self, cell: int) -> None:
        if self.sched.cell_states[cell] is CellState.TRAINING:
            self.has_version[cell] = max(self.has_version[cell] or 0, self.version)
            self._claim()

    def _claim(self) -> None:
        step = self.version
        left = self.pending.get(step, 0)
        if left <= 0:
            return
        states = self.sched.cell_states
        ready = [c for c in range(self.cfg.num_cells)
                 if states[c] is CellState.TRAINING and self.has_version[c] == step]
        k = len(ready)
        for c in ready:
            if left <= 0:
                break
            if self.busy[c]:
                continue
            self.busy[c] = True
            left -= 1
            self.event_log.append((self.env.now, "micro", c, step))
            self._at(self.micro_s * (1 + self.sim.dp_overhead * (k - 1)), lambda c=c: self._micro_done(c, step))
        self.pending[step] = left

    def _micro_done(self, cell: int, step: int) -> None:
        self.busy[cell] = False
        self.event_log.append((self.env.now, "micro_done", cell, step))
        self._deliver(MicroStepDone(cell, step, now=self.env.now))
        self._claim()

    def _update_done(self, step: int) -> None:
        self.version = step + 1
        self.step_end_s.append(self.env.now)
        self.event_log.append((self.env.now, "update", step, -1))
        if self.on_step is not None:
            self.on_step(self.version)
        if self.publish_pending is None:  # non-final step of a burst: keep training
            states = self.sched.cell_states
            if states[0] is CellState.TRAINING:
                self.has_version[0] = self.version
            for c in range(1, self.cfg.num_cells):
                if states[c] is CellState.TRAINING:
                    self._at(self.sim.broadcast_s, lambda c=c, v=self.version: self._broadcast(c, v))
            self._claim()

    def _broadcast(self, cell: int, version: int) -> None:
        if self.sched.cell_states[cell] is CellState.TRAINING:
            self.has_version[cell] = max(self.has_version[cell] or 0, version)
            self._claim()

    def _published(self, version: int) -> None:
        self.publish_pending = None
        self.event_log.append((self.env.now, "publish", version, -1))
        self._deliver(WeightsPublished(version, now=self.env.now))
        if self.sched.done:
            self.end.succeed()
            return
        if self.sched.cell_states[0] is CellState.TRAINING:
            self.has_version[0] = self.version
        for c in range(1, self.cfg.num_cells):  # async satellites never left: broadcast
            if self.sched.cell_states[c] is CellState.TRAINING:
                self._at(self.sim.broadcast_s, lambda c=c, v=self.version: self._broadcast(c, v))
        self._claim()

    # ------------------------------------------------------------------ run

    def run(self, on_step: Callable[[int], None] | None = None) -> SimResult:
        """Simulate until the last step's weights are published; return the measurements.

        ``on_step(steps_done)`` is called after each optimizer update (progress bars).

        Raises:
            RuntimeError: the run stalled (no event left before the end): a scheduler bug.
        """
        self.on_step = on_step
        self._at(0.0, lambda: self._deliver(Start(now=0.0)))
        try:
            self.env.run(until=self.end)
        except RuntimeError as exc:
            c = self.sched.counters
            raise RuntimeError(f"simulation stalled at t={self.env.now:.0f}s after {self.sched.steps_done} steps "
                               f"(d={c.d} p={c.p} f={c.f}, cells {[s.value for s in self.sched.cell_states]}, "
                               f"stream {self.sched.queue.stream}): {exc}") from None
        return self._result()

    def _result(self) -> SimResult:
        end = self.env.now
        s = self.sched
        tl = s.role_timeline(end)
        share = [sum(b - a for a, b, st in cell if st is CellState.TRAINING) / end if end > 0 else 0.0
                 for cell in tl]
        cap_s = self.cfg.standalone_concurrency * end + sum(
            (b - a) * self.cfg.rollout_concurrency_per_cell for cell in tl for a, b, st in cell
            if st is CellState.ROLLOUT)
        busy = self.busy_slot_s + sum(end - ex.launched_at for ex in self.execs.values() if ex.running)
        lat: dict[str, list[float]] = {"to_training": [], "to_rollout": []}
        for _cell, role, sec in s.switch_latencies:
            lat["to_training" if role is Role.TRAINING else "to_rollout"].append(sec)
        c = s.counters
        return SimResult(
            placement=self.cfg.placement, phi=self.cfg.phi, mu=self.cfg.mu, steps=s.steps_done,
            end_time_s=end, mean_staleness=s.mean_staleness, expected_staleness=self.cfg.expected_staleness,
            switches=s.switches, train_share=share,
            rollout_utilisation=busy / cap_s if cap_s > 0 else 0.0,
            switch_latency_s={k: (sum(v) / len(v) if v else 0.0) for k, v in lat.items()},
            counters={"d": c.d, "p": c.p, "f": c.f, "groups_dispatched": c.groups_dispatched,
                      "groups_consumed": c.groups_consumed, "surplus": c.surplus},
            rerouted_executions=self.rerouted, retried_model_calls=self.retried_calls,
            model_calls=self.model_calls, step_end_s=self.step_end_s,
            timeline=[[(a, b, st.value) for a, b, st in cell] for cell in tl])
