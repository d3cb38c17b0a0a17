"""Counter, capacity and liveness invariants under random event sequences (hypothesis).

A fake shell mirrors what the commands did and offers every event that could legally happen
next; hypothesis picks among them.  After each event: ``0 <= f <= p <= d``, every route within
its concurrency, every running execution on a rollout route, each
execution finished at most once, and -- liveness -- some progress event is always possible
until the run is done.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gyre.scheduler import (STANDALONE, CellRoleChanged, CellState, CloseJoinWindow, Dispatch, EnqueueGroup,
                            ExecutionFinished, ExecutionLaunched, ExecutionState, ExecutionStatus,
                            GroupReady, Launch, MicroStepDone, Publish, Reroute, Role, Scheduler,
                            SchedulerConfig, Start, SwitchFailed, Tick, ToRollout, ToTrain, WeightsPublished)

STATUSES = [ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.TIMEOUT,
            ExecutionStatus.CANCELLED]


class FakeShell:
    def __init__(self, s: Scheduler, micro: int) -> None:
        self.s = s
        self.micro = micro
        self.t = 0.0
        self.running: dict[int, int] = {}         # eid -> gid
        self.route: dict[int, int] = {}
        self.closed: dict[int, int] = {}          # eid -> times the shell closed it (must be 1)
        self.unacked: set[int] = set()
        self.members: dict[int, tuple[int, ...]] = {}
        self.valid: dict[int, int] = {}
        self.ready_sent: set[int] = set()
        self.switching: dict[int, Role] = {}
        self.training: set[int] = {c for c, st_ in enumerate(s.cell_states) if st_ is CellState.TRAINING}
        self.pending: dict[int, int] = {}
        self.step = 0
        self.publish: int | None = None
        self.role_commands = 0
        self.failed_switches: dict[int, int] = {}  # at most 2 per cell: below the cap, so the run can end

    def apply(self, cmds) -> None:
        for c in cmds:
            if isinstance(c, Dispatch):
                self.members[c.group_id] = c.execution_ids
                self.valid[c.group_id] = 0
            elif isinstance(c, Launch):
                assert c.execution_id not in self.running and c.execution_id not in self.closed
                gid = self.s.queue.executions[c.execution_id].group_id
                self.running[c.execution_id] = gid
                self.route[c.execution_id] = c.dest
                self.unacked.add(c.execution_id)
            elif isinstance(c, Reroute):
                for e in c.execution_ids:
                    assert self.route[e] == c.source
                    self.route[e] = c.dest
            elif isinstance(c, ToTrain):
                self.role_commands += 1
                self.switching[c.cell] = Role.TRAINING
            elif isinstance(c, ToRollout):
                self.role_commands += 1
                self.training.discard(c.cell)
                self.switching[c.cell] = Role.ROLLOUT
            elif isinstance(c, EnqueueGroup):
                assert c.step == self.step and c.staleness >= 0
                self.pending[c.step] = self.pending.get(c.step, 0) + self.micro
            elif isinstance(c, CloseJoinWindow):
                assert c.step == self.step and self.pending.get(c.step, 0) == 0
                self.step += 1
            elif isinstance(c, Publish):
                assert self.publish is None
                self.publish = c.version

    def progress_actions(self) -> list[tuple]:
        acts: list[tuple] = []
        for e in sorted(self.running):
            gid = self.running[e]
            acts.append(("surplus", e) if gid in self.ready_sent else ("finish", e))
        acts += [("ack", e) for e in sorted(self.unacked)]
        acts += [("ready", g) for g in sorted(self.valid)
                 if g not in self.ready_sent and self.valid[g] >= self.s.config.N]
        acts += [("switch", c) for c in sorted(self.switching)]
        acts += [("switch_fail", c) for c in sorted(self.switching) if self.failed_switches.get(c, 0) < 2]
        if self.pending.get(self.step, 0) > 0:
            acts += [("micro", c) for c in sorted(self.training)]
        if self.publish is not None:
            acts.append(("publish",))
        return acts

    def event(self, act, status) -> object:
        self.t += 1.0
        kind = act[0]
        if kind in ("finish", "surplus"):
            e = act[1]
            gid = self.running.pop(e)
            self.closed[e] = self.closed.get(e, 0) + 1
            self.unacked.discard(e)
            if kind == "finish":
                self.valid[gid] += 1
                return ExecutionFinished(e, status, now=self.t)
            return ExecutionFinished(e, ExecutionStatus.SURPLUS, now=self.t)
        if kind == "dup":
            return ExecutionFinished(act[1], status, now=self.t)
        if kind == "ack":
            self.unacked.discard(act[1])
            return ExecutionLaunched(act[1], now=self.t)
        if kind == "ready":
            self.ready_sent.add(act[1])
            return GroupReady(act[1], self.micro, now=self.t)
        if kind == "switch":
            role = self.switching.pop(act[1])
            if role is Role.TRAINING:
                self.training.add(act[1])
            return CellRoleChanged(act[1], role, now=self.t)
        if kind == "switch_fail":  # the cell rolls back to the role it left
            role = self.switching.pop(act[1])
            self.failed_switches[act[1]] = self.failed_switches.get(act[1], 0) + 1
            if role is Role.ROLLOUT:
                self.training.add(act[1])
            return SwitchFailed(act[1], role, now=self.t)
        if kind == "micro":
            self.pending[self.step] -= 1
            return MicroStepDone(act[1], self.step, now=self.t)
        if kind == "publish":
            v, self.publish = self.publish, None
            return WeightsPublished(v, now=self.t)
        return Tick(now=self.t)

    def check(self) -> None:
        s = self.s
        s.check_invariants()
        c = s.counters
        finished = sum(1 for r in s.queue.executions.values() if r.state is ExecutionState.FINISHED)
        assert finished == c.f
        assert c.f == sum(self.closed.values()) + c.surplus_at_queue
        assert all(n == 1 for n in self.closed.values())
        for e, route in self.route.items():
            if e in self.running:
                assert s.queue.executions[e].route == route
                assert route == STANDALONE or s.cell_states[route] is CellState.ROLLOUT


@st.composite
def configs(draw):
    placement = draw(st.sampled_from(["elastic", "async", "colocate"]))
    K = draw(st.integers(2 if placement == "async" else 1, 3))
    B = draw(st.integers(1, 3))
    return SchedulerConfig(
        N=draw(st.integers(1, 3)), B=B,
        phi=0.0 if placement == "colocate" else draw(st.integers(0, 3)) / B,
        mu=draw(st.integers(1, 3)), num_cells=K,
        rollout_concurrency_per_cell=draw(st.integers(1, 3)),
        standalone_concurrency=draw(st.sampled_from([0, 2])),
        placement=placement, train_cells=draw(st.integers(1, K - 1)) if placement == "async" else 1,
        max_steps=draw(st.integers(1, 4)), oversample=draw(st.integers(0, 1)))


def _examples(n: int) -> int:
    """``n`` scaled by ``$GYRE_HYPOTHESIS_SCALE`` (default 1) for deep runs."""
    return max(1, int(n * float(os.environ.get("GYRE_HYPOTHESIS_SCALE", "1"))))


@settings(max_examples=_examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), micro=st.integers(0, 2), data=st.data())
def test_counters_capacity_and_liveness_under_random_events(cfg, micro, data):
    s = Scheduler(cfg)
    shell = FakeShell(s, micro)
    shell.apply(s.handle(Start()))
    shell.check()
    for _ in range(400):
        acts = shell.progress_actions()
        if not acts:
            break
        noise = [("tick",)] + [("dup", e) for e in sorted(shell.closed)[:3]]
        act = data.draw(st.sampled_from(acts + noise))
        status = data.draw(st.sampled_from(STATUSES))
        shell.apply(s.handle(shell.event(act, status)))
        shell.check()
    event(f"done={s.done} placement={cfg.placement}")
    # liveness: the run only runs out of possible events once it is done
    if not shell.progress_actions():
        assert s.done, (s.cell_states, s.queue.stream, s.counters)
        assert s.steps_done == cfg.max_steps
    if cfg.placement == "async":
        assert shell.role_commands == 0
