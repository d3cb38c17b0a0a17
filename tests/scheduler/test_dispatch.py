"""Boundary dispatch and staleness accounting (paper §4.1, App. A)."""

from __future__ import annotations

import pytest

from gyre.scheduler import (CellRoleChanged, CloseJoinWindow, Dispatch, EnqueueGroup, ExecutionFinished,
                            GroupReady, Launch, MicroStepDone, Publish, Role, Scheduler, SchedulerConfig,
                            Start, ToRollout, ToTrain, WeightsPublished)
from gyre.scheduler.dispatch import BoundaryDispatch


class InstantShell:
    """Everything happens at once, in order: executions finish in launch order, groups become
    ready in dispatch order, training cells do micro-steps, publications complete."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.queue: list = []
        self.dispatched: list[Dispatch] = []
        self.training = {c for c, st in enumerate(s.cell_states) if st.value == "training"}
        self.pending = 0
        self.step = 0

    def run(self, steps: int) -> None:
        self.feed(Start())
        while self.s.steps_done < steps or self.queue:
            if not self.queue:
                self._progress()
                if not self.queue:
                    raise AssertionError("stalled")
            self.feed(self.queue.pop(0))

    def _progress(self) -> None:
        q = self.s.queue
        for gid in sorted(q.groups):
            g = q.groups[gid]
            if not g.ready and all(q.executions[e].state.value == "finished" for e in g.execution_ids[:self.s.config.N]):
                self.queue.append(GroupReady(gid, 1))
                return
        if self.pending and self.training:
            self.pending -= 1
            self.queue.append(MicroStepDone(min(self.training), self.step))

    def feed(self, event) -> None:
        for c in self.s.handle(event):
            if isinstance(c, Dispatch):
                self.dispatched.append(c)
            elif isinstance(c, Launch):
                self.queue.append(ExecutionFinished(c.execution_id))
            elif isinstance(c, ToTrain):
                self.training.add(c.cell)
                self.queue.append(CellRoleChanged(c.cell, Role.TRAINING))
            elif isinstance(c, ToRollout):
                self.training.discard(c.cell)
                self.queue.append(CellRoleChanged(c.cell, Role.ROLLOUT))
            elif isinstance(c, EnqueueGroup):
                self.pending += 1
            elif isinstance(c, CloseJoinWindow):
                self.step = c.step + 1
            elif isinstance(c, Publish):
                self.queue.append(WeightsPublished(c.version))


def test_staleness_pattern_of_phi_half_mu_three():
    # B = 2, phi * B = 1: 7 groups at v0; burst 0 consumes g0..g5 (d = 0,0,1,1,2,2); after the
    # publication of v3, 6 more at v3; burst 1 consumes g6 (v0, d = 3) then g7..g11 (v3: 0,1,1,2,2)
    s = Scheduler(SchedulerConfig(N=2, B=2, phi=0.5, mu=3, num_cells=2, rollout_concurrency_per_cell=64,
                                  placement="async", train_cells=1, max_steps=9))
    shell = InstantShell(s)
    shell.run(9)
    log = s.queue.staleness_log
    assert [d for _, _, d in log] == [0, 0, 1, 1, 2, 2, 3, 0, 1, 1, 2, 2, 3, 0, 1, 1, 2, 2]
    assert [step for _, step, _ in log] == [t for t in range(9) for _ in range(2)]
    assert [(c.group_id, c.policy_version) for c in shell.dispatched] == (
        [(g, 0) for g in range(7)] + [(g, 3) for g in range(7, 13)] + [(g, 6) for g in range(13, 19)])
    # burst >= 1 has mean phi + (mu - 1)/2 = 1.5; the first burst has no phi offset
    steady = [d for _, step, d in log if step >= 3]
    assert sum(steady) / len(steady) == pytest.approx(1.5)
    assert s.done and s.published_version == 9


def fifo_mean_staleness(phi: float, mu: int, B: int, steps: int) -> float:
    """Mean staleness when groups are consumed in dispatch order: step t has v_t = t; the startup
    dispatch of (phi + mu) * B groups is at v0, the k-th replenishment of mu * B groups at k * mu."""
    first = round((phi + mu) * B)
    total = 0
    for g in range(steps * B):
        v_d = 0 if g < first else mu * (1 + (g - first) // (mu * B))
        total += g // B - v_d
    return total / (steps * B)


@pytest.mark.parametrize("placement, phi, mu", [("elastic", 0.0, 3), ("elastic", 1.0, 2), ("colocate", 0.0, 2),
                                                ("async", 2.0, 1), ("async", 0.5, 1)])
def test_mean_staleness_converges_to_app_a_identity(placement, phi, mu):
    steps = 120
    s = Scheduler(SchedulerConfig(N=2, B=2, phi=phi, mu=mu, num_cells=2, rollout_concurrency_per_cell=64,
                                  placement=placement, train_cells=1, max_steps=steps))
    InstantShell(s).run(steps)
    assert s.mean_staleness == pytest.approx(fifo_mean_staleness(phi, mu, 2, steps))
    # App. A: phi + (mu - 1)/2, up to the warm-up of the first bursts (order (phi + mu) phi / steps)
    assert s.mean_staleness == pytest.approx(phi + (mu - 1) / 2, abs=0.05)
    assert fifo_mean_staleness(phi, mu, 2, 20000) == pytest.approx(phi + (mu - 1) / 2, abs=1e-3)


def test_queue_depth_and_replenishment():
    cfg = SchedulerConfig(N=3, B=4, phi=1.5, mu=2)
    q = BoundaryDispatch(cfg)
    cmds = q.dispatch(cfg.queue_depth_groups)
    assert len(cmds) == 14 and cfg.queue_depth_groups == (1.5 + 2) * 4
    assert q.counters.d == 14 * 3 and q.counters.queued == 42 and q.counters.waterlevel == 42
    q.published_version = 2
    more = q.dispatch(cfg.mu * cfg.B)
    assert [c.policy_version for c in more] == [2] * 8
    assert more[0].execution_ids == (42, 43, 44)


def test_ready_groups_enter_the_stream_oldest_version_first():
    cfg = SchedulerConfig(N=1, B=2, phi=0, mu=1)
    q = BoundaryDispatch(cfg)
    q.dispatch(2)                     # g0, g1 at v0
    q.published_version = 1
    q.dispatch(2)                     # g2, g3 at v1
    q.advance_step()                  # the stream of step 1 (v_t = 1)
    for g in (3, 2, 1):
        q.group_ready(g, 1)
    # v0 before v1; within v1, readiness order (g3 before g2)
    assert q.fill_stream() == [EnqueueGroup(1, 1, 1), EnqueueGroup(3, 1, 0)]
    assert q.stream_closed and not q.stream_open and q.pending_micro_steps == 2
    assert q.fill_stream() == []      # stream full: g3 waits for the next step


def test_micro_step_accounting_errors():
    q = BoundaryDispatch(SchedulerConfig(N=1, B=1))
    q.dispatch(1)
    q.group_ready(0, 1)
    q.fill_stream()
    with pytest.raises(ValueError, match="current step is 0"):
        q.micro_step_done(1)
    q.micro_step_done(0)
    with pytest.raises(ValueError, match="more micro-steps"):
        q.micro_step_done(0)
    with pytest.raises(ValueError, match=">= 0"):
        q.group_ready(0, -1)
