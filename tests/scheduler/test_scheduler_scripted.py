"""Scripted event sequences with the exact commands expected.

Every expected list below is derived by hand from the rules (comments give the reasoning):
launches and reroutes go standalone first, then rollout cells in descending order; cells enter
training in ascending order when the capacity check (rollout capacity without the cell >=
waterlevel d - f) and the supply check (stream open, or more unfinished micro-steps than
training cells) pass.
"""

from __future__ import annotations

import pytest

from gyre.scheduler import (STANDALONE, CellRoleChanged, CloseJoinWindow, Dispatch, EnqueueGroup,
                            ExecutionFinished, ExecutionLaunched, ExecutionStatus, GroupReady, Launch,
                            MicroStepDone, Publish, Reroute, Role, Scheduler, SchedulerConfig, Start,
                            SwitchFailed, Tick, ToRollout, ToTrain, WeightsPublished)

T, R = Role.TRAINING, Role.ROLLOUT


class Driver:
    """Feeds events with increasing timestamps and checks the invariants after each."""

    def __init__(self, **cfg) -> None:
        self.s = Scheduler(SchedulerConfig(**cfg))
        self.t = 0.0

    def __call__(self, event):
        self.t += 1.0
        if isinstance(event, Tick):
            event = Tick(now=self.t)
        elif not isinstance(event, Start):
            event = type(event)(*[getattr(event, f) for f in event.__slots__ if f != "now"], now=self.t)
        out = self.s.handle(event)
        self.s.check_invariants()
        return out

    def finish(self, *eids):
        out = []
        for e in eids:
            out += self(ExecutionFinished(e))
        return out


def test_startup_fills_queue_and_launches_standalone_first_then_descending():
    # phi * B = 1 extra group: (phi + mu) * B = 3 groups of N = 2; capacity c_s + 2c = 5.
    d = Driver(N=2, B=2, phi=0.5, mu=1, num_cells=2, rollout_concurrency_per_cell=2, standalone_concurrency=1)
    assert d(Start()) == [
        Dispatch(0, 0, (0, 1)), Dispatch(1, 0, (2, 3)), Dispatch(2, 0, (4, 5)),
        Launch(0, 0, STANDALONE), Launch(1, 0, 1), Launch(2, 1, 1), Launch(3, 1, 0), Launch(4, 2, 0),
    ]
    c = d.s.counters
    assert (c.d, c.p, c.f, c.queued, c.waterlevel) == (6, 5, 0, 1, 6)
    # a slot frees on cell 1: the queued execution 5 launches there
    assert d.finish(1) == [Launch(5, 2, 1)]


def test_cells_enter_training_in_ascending_order_only_when_both_checks_pass():
    d = Driver(N=2, B=2, phi=0, mu=1, num_cells=3, rollout_concurrency_per_cell=2, max_steps=2)
    assert d(Start()) == [Dispatch(0, 0, (0, 1)), Dispatch(1, 0, (2, 3)),
                          Launch(0, 0, 2), Launch(1, 0, 2), Launch(2, 1, 1), Launch(3, 1, 1)]
    # capacity without the core is 4 >= waterlevel 4, but no ready work: supply fails, no move
    assert d.finish(0, 1) == []
    # group 0 ready -> stream of step 0 open (1 of B = 2).  Core: capacity 4 >= 2 -> moves.
    # Cell 1: capacity without it = cell 2 = 2 >= 2 -> moves, its executions go to cell 2.
    # Cell 2: capacity without it = 0 < 2 -> stays.
    assert d(GroupReady(0, 2)) == [EnqueueGroup(0, 0, 0), ToTrain(0), Reroute((2, 3), 1, 2), ToTrain(1)]
    assert d(CellRoleChanged(0, T)) == []
    assert d(CellRoleChanged(1, T)) == []
    assert d(ExecutionFinished(2)) == []              # waterlevel 1 > capacity 0 without cell 2
    # waterlevel 0 <= 0 and the stream is still open: cell 2 joins too
    assert d(ExecutionFinished(3)) == [ToTrain(2)]
    assert [s.value for s in d.s.cell_states] == ["training", "training", "to_training"]


def test_capacity_check_blocks_the_core_until_the_waterlevel_drops():
    # phi = 2: 3 groups (6 executions) on 2 cells x 2 slots
    d = Driver(N=2, B=1, phi=2, mu=1, num_cells=2, rollout_concurrency_per_cell=2)
    assert d(Start()) == [Dispatch(0, 0, (0, 1)), Dispatch(1, 0, (2, 3)), Dispatch(2, 0, (4, 5)),
                          Launch(0, 0, 1), Launch(1, 0, 1), Launch(2, 1, 0), Launch(3, 1, 0)]
    assert d.finish(0, 1) == [Launch(4, 2, 1), Launch(5, 2, 1)]
    # supply passes (1 micro-step, no training cell), capacity 2 < waterlevel 4: core stays
    assert d(GroupReady(0, 1)) == [EnqueueGroup(0, 0, 0)]
    assert d.finish(2) == []                          # waterlevel 3 > 2
    assert d.finish(3) == [ToTrain(0)]                # waterlevel 2 <= 2; cell 0 is empty: no reroute


@pytest.mark.parametrize("finished, expected_reroutes", [
    # standalone has 1 free slot, then cell 2 (descending order) takes the next
    ((0, 2, 4, 5), [Reroute((6,), 0, STANDALONE), Reroute((7,), 0, 2)]),
    # standalone full: cell 2 first, then cell 1
    ((2, 4, 5), [Reroute((6,), 0, 2), Reroute((7,), 0, 1)]),
])
def test_reroute_destinations_standalone_first_then_descending(finished, expected_reroutes):
    d = Driver(N=2, B=1, phi=3, mu=1, num_cells=3, rollout_concurrency_per_cell=2, standalone_concurrency=2)
    assert d(Start())[4:] == [Launch(0, 0, STANDALONE), Launch(1, 0, STANDALONE), Launch(2, 1, 2),
                              Launch(3, 1, 2), Launch(4, 2, 1), Launch(5, 2, 1), Launch(6, 3, 0),
                              Launch(7, 3, 0)]
    assert d.finish(*finished) == []
    # group 2 ready: the core moves (capacity 6 >= waterlevel), every one of its executions
    # rerouted to a destination with room; cell 1 then fails the supply check (1 micro-step,
    # 1 training cell, stream closed)
    assert d(GroupReady(2, 1)) == [EnqueueGroup(2, 0, 0), *expected_reroutes, ToTrain(0)]
    routes = d.s.routes
    assert routes.occupancy(0) == 0 and all(routes.free(r) >= 0 for r in routes.capacity)


def test_burst_end_returns_satellites_and_publishes():
    d = Driver(N=2, B=1, phi=0, mu=2, num_cells=3, rollout_concurrency_per_cell=2, max_steps=4)
    # 2 groups: 0,1 -> cell 2; 2,3 -> cell 1
    d(Start())
    d.finish(0, 1, 2, 3)
    # waterlevel 0; supply: 3 unfinished micro-steps > 0, 1, 2 cells already training: all three join
    assert d(GroupReady(0, 3)) == [EnqueueGroup(0, 0, 0), ToTrain(0), ToTrain(1), ToTrain(2)]
    for cell in range(3):
        assert d(CellRoleChanged(cell, T)) == []
    assert d(MicroStepDone(0, 0)) == []
    assert d(MicroStepDone(1, 0)) == []
    # step 0 drained: join window closes; not a burst end (mu = 2): nothing else
    assert d(MicroStepDone(2, 0)) == [CloseJoinWindow(0)]
    assert d(GroupReady(1, 1)) == [EnqueueGroup(1, 1, 1)]
    # step 1 ends the burst: satellites 1 and 2 return, the core publishes version 2
    assert d(MicroStepDone(0, 1)) == [CloseJoinWindow(1), ToRollout(1), ToRollout(2), Publish(2)]
    # no cell may enter training while the publication is pending
    assert d(Tick(now=0.0)) == []
    assert d(CellRoleChanged(1, R)) == []


def test_satellite_still_switching_at_burst_end_returns_on_arrival():
    d = Driver(N=2, B=2, phi=0, mu=1, num_cells=3, rollout_concurrency_per_cell=2, max_steps=2)
    d(Start())
    d.finish(0, 1)
    d(GroupReady(0, 2))                               # cells 0 and 1 to training
    d(CellRoleChanged(0, T))
    d(CellRoleChanged(1, T))
    assert d.finish(2, 3) == [ToTrain(2)]
    assert d(GroupReady(1, 1)) == [EnqueueGroup(1, 0, 0)]
    for _ in range(3):
        out = d(MicroStepDone(0, 0))
    # cell 2 is still switching in: it is released when it arrives
    assert out == [CloseJoinWindow(0), ToRollout(1), Publish(1)]
    assert d(CellRoleChanged(2, T)) == [ToRollout(2)]


def test_core_leaves_when_no_ready_work_at_publication():
    d = Driver(N=2, B=2, phi=0, mu=1, num_cells=3, rollout_concurrency_per_cell=2, max_steps=2)
    d(Start())
    d.finish(0, 1)
    d(GroupReady(0, 2))
    d(CellRoleChanged(0, T))
    d(CellRoleChanged(1, T))
    d.finish(2, 3)                                    # ToTrain(2)
    d(GroupReady(1, 1))
    d(MicroStepDone(0, 0))
    d(MicroStepDone(1, 0))
    assert d(MicroStepDone(0, 0)) == [CloseJoinWindow(0), ToRollout(1), Publish(1)]
    # next dispatch at version 1; no ready group -> supply fails -> the core returns; no rollout
    # cell is up yet (1 and 0 switching back, 2 switching in), so nothing launches
    assert d(WeightsPublished(1)) == [Dispatch(2, 1, (4, 5)), Dispatch(3, 1, (6, 7)), ToRollout(0)]
    assert d(CellRoleChanged(1, R)) == [Launch(4, 2, 1), Launch(5, 2, 1)]
    assert d(CellRoleChanged(0, R)) == [Launch(6, 3, 0), Launch(7, 3, 0)]


def test_core_stays_when_supply_and_capacity_without_it_pass():
    d = Driver(N=2, B=1, phi=1, mu=1, num_cells=2, rollout_concurrency_per_cell=2, max_steps=3)
    assert d(Start())[2:] == [Launch(0, 0, 1), Launch(1, 0, 1), Launch(2, 1, 0), Launch(3, 1, 0)]
    d.finish(0, 1)
    # capacity without the core: 2 >= waterlevel 2; its executions move to cell 1
    assert d(GroupReady(0, 1)) == [EnqueueGroup(0, 0, 0), Reroute((2, 3), 0, 1), ToTrain(0)]
    d(CellRoleChanged(0, T))
    assert d.finish(2, 3) == []                       # cell 1: 1 micro-step, 1 training cell: no supply
    assert d(GroupReady(1, 1)) == []                  # step 0's stream is full (B = 1): waits
    # step 0 ends the burst; step 1's stream takes group 1 (dispatched at v0: staleness 1)
    assert d(MicroStepDone(0, 0)) == [CloseJoinWindow(0), Publish(1), EnqueueGroup(1, 1, 1)]
    # after the dispatch the waterlevel is 2 <= cell 1's capacity, and step 1 has work: core stays
    assert d(WeightsPublished(1)) == [Dispatch(2, 1, (4, 5)), Launch(4, 2, 1), Launch(5, 2, 1)]
    assert d.s.cell_states[0].value == "training"
    assert d(MicroStepDone(0, 1)) == [CloseJoinWindow(1), Publish(2)]


def test_colocate_waits_for_the_tail_then_switches_the_whole_pool():
    d = Driver(N=2, B=1, phi=0, mu=2, num_cells=2, rollout_concurrency_per_cell=2, placement="colocate",
               max_steps=4)
    assert d(Start()) == [Dispatch(0, 0, (0, 1)), Dispatch(1, 0, (2, 3)),
                          Launch(0, 0, 1), Launch(1, 0, 1), Launch(2, 1, 0), Launch(3, 1, 0)]
    d.finish(0, 1)
    assert d(GroupReady(0, 1)) == [EnqueueGroup(0, 0, 0)]   # ready work, but the tail is running
    assert d.finish(2) == []
    assert d.finish(3) == [ToTrain(0), ToTrain(1)]          # last admitted execution done
    d(CellRoleChanged(0, T))
    d(CellRoleChanged(1, T))
    assert d(MicroStepDone(1, 0)) == [CloseJoinWindow(0)]
    assert d(GroupReady(1, 1)) == [EnqueueGroup(1, 1, 1)]
    assert d(MicroStepDone(0, 1)) == [CloseJoinWindow(1), ToRollout(1), Publish(2)]
    assert d(WeightsPublished(2)) == [Dispatch(2, 2, (4, 5)), Dispatch(3, 2, (6, 7)), ToRollout(0)]
    assert d(CellRoleChanged(1, R)) == [Launch(4, 2, 1), Launch(5, 2, 1)]
    assert d(CellRoleChanged(0, R)) == [Launch(6, 3, 0), Launch(7, 3, 0)]


def test_async_never_moves_cells():
    d = Driver(N=2, B=1, phi=1, mu=1, num_cells=3, rollout_concurrency_per_cell=2, placement="async",
               train_cells=1, max_steps=3)
    assert [s.value for s in d.s.cell_states] == ["training", "rollout", "rollout"]
    out = d(Start())
    assert out == [Dispatch(0, 0, (0, 1)), Dispatch(1, 0, (2, 3)),
                   Launch(0, 0, 2), Launch(1, 0, 2), Launch(2, 1, 1), Launch(3, 1, 1)]
    seen = list(out)
    seen += d.finish(0, 1, 2, 3)
    seen += d(GroupReady(0, 1))
    seen += d(GroupReady(1, 1))
    seen += d(MicroStepDone(0, 0))
    assert seen[-2:] == [Publish(1), EnqueueGroup(1, 1, 1)]
    seen += d(WeightsPublished(1))
    seen += d(MicroStepDone(0, 1))
    seen += d(WeightsPublished(2))
    assert not [c for c in seen if isinstance(c, (ToTrain, ToRollout))]
    assert d.s.switches == 0


def test_oversampled_surplus_is_counted_once_and_queued_surplus_closes_at_the_queue():
    # N = 2 + 1 oversampled; 2 groups x 3 executions on one 4-slot cell: 4, 5 queued
    d = Driver(N=2, B=1, phi=1, mu=1, num_cells=1, rollout_concurrency_per_cell=4, oversample=1)
    out = d(Start())
    assert out[:2] == [Dispatch(0, 0, (0, 1, 2)), Dispatch(1, 0, (3, 4, 5))]
    assert [c.execution_id for c in out if isinstance(c, Launch)] == [0, 1, 2, 3]
    assert d.finish(0, 1) == [Launch(4, 1, 0), Launch(5, 1, 0)]
    d(GroupReady(0, 1))                               # first N valid: 2 is surplus, still running
    assert d(ExecutionFinished(2, ExecutionStatus.SURPLUS)) == []
    d.finish(3, 4)
    # group 1 ready with 5 still running; nothing queued; the shell closes 5 as surplus
    d(GroupReady(1, 1))
    d(ExecutionFinished(5, ExecutionStatus.SURPLUS))
    c = d.s.counters
    assert (c.d, c.p, c.f, c.surplus) == (6, 6, 6, 2)


def test_unlaunched_surplus_passes_through_p_and_f_without_launch():
    d = Driver(N=2, B=1, phi=0, mu=1, num_cells=1, rollout_concurrency_per_cell=2, oversample=1)
    out = d(Start())
    assert [c for c in out if isinstance(c, Launch)] == [Launch(0, 0, 0), Launch(1, 0, 0)]
    d(GroupReady(0, 1))                               # 2 never launched: closed at the queue
    c = d.s.counters
    assert (c.d, c.p, c.f, c.surplus_at_queue, c.queued) == (3, 3, 1, 1, 0)
    d.finish(0, 1)
    assert (c.p, c.f, c.waterlevel) == (3, 3, 0)


def test_repeated_notifications_change_no_counter():
    d = Driver(N=2, B=1, phi=0, mu=1, num_cells=1, rollout_concurrency_per_cell=2)
    d(Start())
    d(ExecutionLaunched(0))
    d(ExecutionLaunched(0))
    d.finish(0)
    assert d.finish(0) == []
    d.finish(1)
    d(GroupReady(0, 1))
    assert d(GroupReady(0, 1)) == []
    c = d.s.counters
    assert (c.p, c.f, c.duplicate_finishes, c.duplicate_acks, c.duplicate_ready, c.groups_consumed) == (2, 2, 1, 1, 1, 1)


@pytest.mark.parametrize("event, match", [
    (ExecutionFinished(99), "unknown execution"),
    (GroupReady(7), "unknown group"),
    (MicroStepDone(0, 0), "state rollout"),
    (CellRoleChanged(0, T), "reported role training while rollout"),
    (WeightsPublished(1), "expected None"),
])
def test_contradicting_events_raise(event, match):
    s = Scheduler(SchedulerConfig(N=2, B=1, num_cells=1, rollout_concurrency_per_cell=1))
    s.handle(Start())
    with pytest.raises(ValueError, match=match):
        s.handle(event)


def test_protocol_errors_before_start_and_backwards_time():
    s = Scheduler(SchedulerConfig(N=2, B=1, num_cells=1, rollout_concurrency_per_cell=1))
    with pytest.raises(ValueError, match="before Start"):
        s.handle(Tick(now=1.0))
    s.handle(Start(now=5.0))
    with pytest.raises(ValueError, match="backwards"):
        s.handle(Tick(now=4.0))
    with pytest.raises(ValueError, match="never launched"):
        s.handle(ExecutionFinished(1))                # queued: capacity 1
    with pytest.raises(ValueError, match="twice"):
        s.handle(Start(now=6.0))


def test_switch_latency_is_measured_per_transition():
    d = Driver(N=2, B=1, phi=0, mu=1, num_cells=2, rollout_concurrency_per_cell=2, max_steps=1)
    d(Start())
    d.finish(0, 1)
    d(GroupReady(0, 1))                               # ToTrain(0) at t=4
    d.s.handle(CellRoleChanged(0, T, now=12.52))
    assert d.s.switch_latencies == [(0, T, pytest.approx(8.52))]


def test_a_failed_switch_puts_the_cell_back_and_is_commanded_again_until_the_cap():
    d = Driver(N=2, B=2, phi=0, mu=1, num_cells=3, rollout_concurrency_per_cell=2, max_steps=2,
               max_switch_failures=3)
    d(Start())
    d.finish(0, 1)
    assert d(GroupReady(0, 2)) == [EnqueueGroup(0, 0, 0), ToTrain(0), Reroute((2, 3), 1, 2), ToTrain(1)]
    # cell 1 is back in rollout with nothing on it; both checks still pass: commanded again
    assert d(SwitchFailed(1, T)) == [ToTrain(1)]
    assert d(SwitchFailed(1, T)) == [ToTrain(1)]
    # the third failure in a row: cells 1 and 2 stay in rollout for the rest of the run
    assert d(SwitchFailed(1, T)) == []
    assert d.s.training_cell_limit == 1 and d.s.switch_failures == 3 and d.s.stalled is None
    assert [s.value for s in d.s.cell_states] == ["to_training", "rollout", "rollout"]
    assert d(CellRoleChanged(0, T)) == []
    assert d.finish(2, 3) == []  # waterlevel 0 and the stream open: cell 1 would have moved
    assert [s.value for s in d.s.cell_states] == ["training", "rollout", "rollout"]


def test_a_successful_switch_resets_the_count_and_a_failed_return_keeps_the_cell_training():
    d = Driver(N=2, B=1, phi=0, mu=2, num_cells=2, rollout_concurrency_per_cell=2, max_steps=4,
               max_switch_failures=2)
    d(Start())
    d.finish(0, 1, 2, 3)
    assert d(GroupReady(0, 3)) == [EnqueueGroup(0, 0, 0), ToTrain(0), ToTrain(1)]
    assert d(SwitchFailed(1, T)) == [ToTrain(1)]
    assert d(CellRoleChanged(1, T)) == []  # success: the count starts again
    assert d.s._failures_in_a_row == {}
    d(CellRoleChanged(0, T))
    for cell in (0, 1, 0):
        d(MicroStepDone(cell, 0))
    d(GroupReady(1, 1))
    # burst end: the satellite returns, version 2 published
    assert d(MicroStepDone(0, 1)) == [CloseJoinWindow(1), ToRollout(1), Publish(2)]
    # a return to rollout that fails is commanded again at once; the second failure in a row stalls the run
    assert d(SwitchFailed(1, R)) == [ToRollout(1)]
    assert d.s.stalled is None and d.s.switch_failures == 2
    assert d(SwitchFailed(1, R)) == []
    assert [s.value for s in d.s.cell_states] == ["training", "training"]
    assert d.s.stalled == "cell 1 could not return to rollout 2 times in a row"
    with pytest.raises(ValueError, match="cell 1 failed to switch to rollout while training"):
        d(SwitchFailed(1, R))


def test_the_core_failing_every_switch_leaves_no_cell_to_train():
    d = Driver(N=2, B=2, phi=0, mu=1, num_cells=2, rollout_concurrency_per_cell=4, max_steps=2,
               max_switch_failures=2)
    d(Start())
    d.finish(0, 1)
    assert d(GroupReady(0, 2))[-1] == ToTrain(0)
    assert d(SwitchFailed(0, T)) == [ToTrain(0)]
    assert d(SwitchFailed(0, T)) == []
    assert d.s.training_cell_limit == 0 and d.s.cell_states[0].value == "rollout"
    assert d.s.stalled == "cell 0 (the core) could not switch into training 2 times in a row, so no cell can train"


def test_cells_above_a_cell_that_failed_into_training_return_to_rollout():
    d = Driver(N=2, B=1, phi=0, mu=2, num_cells=3, rollout_concurrency_per_cell=2, max_steps=4)
    d(Start())
    d.finish(0, 1, 2, 3)
    assert d(GroupReady(0, 3)) == [EnqueueGroup(0, 0, 0), ToTrain(0), ToTrain(1), ToTrain(2)]
    assert d(CellRoleChanged(1, T)) == []
    # the core fails: cell 1 (training) is sent back, cell 2 (still switching) returns on arrival;
    # the core is commanded again at once (the supply check passes with no cell training)
    assert d(SwitchFailed(0, T)) == [ToRollout(1), ToTrain(0)]
    assert d(CellRoleChanged(2, T)) == [ToRollout(2)]
    assert [s.value for s in d.s.cell_states] == ["to_training", "to_rollout", "to_rollout"]


def test_joining_cells_are_the_training_prefix_while_no_publication_is_pending():
    d = Driver(N=2, B=1, phi=0, mu=2, num_cells=3, rollout_concurrency_per_cell=2, max_steps=2)
    d(Start())
    d.finish(0, 1, 2, 3)
    d(GroupReady(0, 3))
    assert d.s.joining_cells() == []  # all three still switching
    d(CellRoleChanged(1, T))
    assert d.s.joining_cells() == []  # cell 1 trains, but the core has not arrived: nobody joins
    d(CellRoleChanged(0, T))
    assert d.s.joining_cells() == [0, 1]
    d(CellRoleChanged(2, T))
    assert d.s.joining_cells() == [0, 1, 2]
    for cell in (0, 1, 2):
        d(MicroStepDone(cell, 0))
    d(GroupReady(1, 1))
    assert d(MicroStepDone(0, 1)) == [CloseJoinWindow(1), ToRollout(1), ToRollout(2), Publish(2)]
    assert d.s.joining_cells() == []  # publication pending (and the last step is done)


@pytest.mark.parametrize("streaming", [True, False])
def test_colocate_handoff_switches_when_the_tail_fits_the_standalone_pool(streaming):
    """With a standalone pool the colocated cells switch together once the unfinished executions
    fit on it (they are rerouted there); without streaming also not before the burst's mu * B
    groups are ready, since the trainer takes whole batches."""
    # (phi + mu) * B = 3 groups of one execution: standalone first, then cell 1 (descending)
    d = Driver(N=1, B=1, phi=1, mu=2, num_cells=2, rollout_concurrency_per_cell=2, standalone_concurrency=1,
               placement="colocate", standalone_handoff=True, streaming=streaming, max_steps=2)
    assert d(Start())[3:] == [Launch(0, 0, STANDALONE), Launch(1, 1, 1), Launch(2, 2, 1)]
    d.finish(0)
    assert d(GroupReady(0, 1)) == [EnqueueGroup(0, 0, 0)]        # waterlevel 2 > c_s = 1
    assert d.s.burst_groups_missing == 1
    switch = [ToTrain(0), Reroute((2,), 1, STANDALONE), ToTrain(1)]
    assert d.finish(1) == (switch if streaming else [])          # the tail fits the standalone pool
    assert d(GroupReady(1, 1)) == ([] if streaming else switch)  # the burst's 2 groups are ready
    assert d.s.burst_groups_missing == 0
