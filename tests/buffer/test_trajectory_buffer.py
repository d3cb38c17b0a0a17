"""Trajectory buffer: group readiness, exclusion, oversampling, drops, zero-std groups, scheduler event."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gyre.arguments import parse_args
from gyre.buffer import DropReason, GroupDropped, ReadyGroup, TrajectoryBuffer, materialize_group
from gyre.evaluation import ExecutionOutcome, OutcomeStatus, TerminationStatus, placeholder_tree
from gyre.rl import AdvantageConfig
from gyre.scheduler import GroupReady
from gyre.trajectory import RequestRecord, TrajectoryTree

T = TerminationStatus


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def valid(eid, r, term=T.COMPLETED):
    return ExecutionOutcome(eid, OutcomeStatus.VALID, r, term, "sha256:x", "", 1)


def excluded(eid, term=T.COMPLETED):
    return ExecutionOutcome(eid, OutcomeStatus.EXCLUDED, None, term, "sha256:x", "", 4, "budget exhausted")


def buf(n=4, **adv):
    adv.setdefault("eps", 0.0)
    return TrajectoryBuffer(n, AdvantageConfig(**adv), clock=Clock())


def test_ready_when_all_n_valid_with_exact_advantages():
    b = buf()
    b.add_group(7, ["e0", "e1", "e2", "e3"], policy_version=3)
    assert b.record_outcome(valid("e0", 1.0)) == []
    assert b.record_outcome(valid("e1", 0.0, T.TIMEOUT)) == []
    assert b.record_outcome(valid("e2", 0.0)) == []
    assert b.group_status(7) == "pending" and b.num_ready == 0
    (ev,) = b.record_outcome(valid("e3", 1.0))
    assert isinstance(ev, ReadyGroup)
    assert ev.execution_ids == ("e0", "e1", "e2", "e3")
    assert ev.rewards == (1.0, 0.0, 0.0, 1.0) and ev.advantages == (1.0, -1.0, -1.0, 1.0)
    assert (ev.mean, ev.std, ev.zero_std, ev.policy_version) == (0.5, 0.5, False, 3)
    assert ev.outcomes[1].termination is T.TIMEOUT  # termination recorded beside the reward
    assert ev.advantage_of("e1") == -1.0 and ev.surplus_execution_ids == ()
    assert b.num_ready == 1 and b.group_status(7) == "ready"
    assert b.take(7) is ev and b.group_status(7) == "taken" and b.num_ready == 0
    with pytest.raises(KeyError):
        b.take(7)


def test_mean_only_advantages():
    b = buf(std_scaling=False)
    b.add_group(0, list("abcd"))
    evs = [b.record_outcome(valid(e, r)) for e, r in zip("abcd", [1, 0, 0, 1])]
    assert evs[-1][0].advantages == (0.5, -0.5, -0.5, 0.5)


def test_unresolved_execution_is_not_a_zero_and_not_in_the_baseline():
    """Without oversampling a group with an excluded execution never reaches N: dropped, not
    trained with a fake 0; with oversampling the baseline is computed over valid rewards only."""
    b = buf()
    b.add_group(1, ["a", "b", "c", "d"])
    b.record_outcome(valid("a", 1.0))
    (ev,) = b.record_outcome(excluded("b"))
    assert isinstance(ev, GroupDropped) and ev.reason is DropReason.INSUFFICIENT_VALID
    assert ev.excluded_execution_ids == ("b",) and set(ev.open_execution_ids) == {"c", "d"}
    assert b.counters.groups_dropped_insufficient == 1 and b.counters.executions_surplus == 2
    assert b.record_outcome(valid("c", 0.0)) == [] and b.counters.late_outcomes == 1
    assert b.group_status(1) == "dropped"

    b = buf(n=4)
    b.add_group(2, ["a", "b", "c", "d", "e"])  # N = 4, one oversampled execution
    for o in (valid("a", 1.0), excluded("b"), valid("c", 0.0), valid("d", 0.0)):
        assert b.record_outcome(o) == []
    (ready,) = b.record_outcome(valid("e", 1.0))
    assert ready.execution_ids == ("a", "c", "d", "e") and ready.excluded_execution_ids == ("b",)
    assert ready.mean == 0.5  # a zero for "b" would have made it 0.4
    assert ready.advantages == (1.0, -1.0, -1.0, 1.0)
    with pytest.raises(KeyError):
        ready.advantage_of("b")


def test_oversampling_takes_the_next_valid_one_and_closes_surplus():
    b = buf(n=2)
    b.add_group(3, ["a", "b", "c", "d"])  # N = 2 + 2 oversampled
    assert b.record_outcome(excluded("b")) == []  # exhausted budget
    assert b.record_outcome(valid("c", 0.2)) == []
    (ready,) = b.record_outcome(valid("a", 0.6))
    assert ready.execution_ids == ("c", "a")  # arrival order: the next valid one replaced "b"
    assert ready.surplus_execution_ids == ("d",)
    assert ready.advantages == pytest.approx((-1.0, 1.0))
    assert b.record_outcome(valid("d", 1.0)) == []  # a late valid outcome is surplus, ignored
    c = b.counters
    assert (c.groups_ready, c.executions_surplus, c.late_outcomes, c.executions_excluded) == (1, 1, 1, 1)


def test_dropped_as_soon_as_n_is_unreachable_with_oversampling():
    b = buf(n=2)
    b.add_group(4, ["a", "b", "c"])
    assert b.record_outcome(excluded("a")) == []
    (ev,) = b.execution_lost("b", "cancelled at the queue")
    assert isinstance(ev, GroupDropped) and ev.num_valid == 0 and ev.open_execution_ids == ("c",)
    assert b.counters.executions_lost == 1


def test_zero_std_groups_are_reported_and_optionally_filtered():
    odd = float(np.float32(0.15) + np.float32(0.2))
    rewards = [float(np.float32(0.35))] * 3 + [odd]
    b = buf()
    b.add_group(5, list("abcd"))
    (ready,) = [e for o in zip("abcd", rewards) for e in b.record_outcome(valid(*o))]
    assert ready.zero_std and ready.advantages == (0.0, 0.0, 0.0, 0.0)
    assert b.counters.groups_zero_std == 1

    b = TrajectoryBuffer(4, AdvantageConfig(filter_zero_std_groups=True), clock=Clock())
    b.add_group(6, list("abcde"))
    evs = [e for o in zip("abcd", [1.0] * 4) for e in b.record_outcome(valid(*o))]
    (ev,) = evs
    assert isinstance(ev, GroupDropped) and ev.reason is DropReason.ZERO_STD and ev.open_execution_ids == ("e",)
    assert b.num_ready == 0 and b.group_status(6) == "dropped"
    assert (b.counters.groups_zero_std, b.counters.groups_dropped_zero_std) == (1, 1)


def test_placeholder_is_a_valid_zero_in_the_baseline():
    b = buf(n=2)
    b.add_group(8, ["a", "b"])
    b.record_outcome(ExecutionOutcome.placeholder("a"), placeholder_tree("a"))
    (ready,) = b.record_outcome(valid("b", 1.0))
    assert ready.rewards == (0.0, 1.0) and ready.advantages == (-1.0, 1.0)
    assert b.counters.executions_placeholder == 1


def _tree(eid):
    t = TrajectoryTree(eid)
    t.insert(RequestRecord(eid, 0, "main", np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32),
                           np.array([-0.1, -0.2], np.float32)))
    return t


def test_materialize_group_fills_advantages_and_skips_placeholders():
    b = buf(n=2)
    b.add_group(9, ["a", "b"])
    b.record_outcome(valid("a", 1.0), _tree("a"))
    (ready,) = b.record_outcome(ExecutionOutcome.placeholder("b"), placeholder_tree("b"))
    rows = materialize_group(ready, np.random.default_rng(0))
    assert [(r.execution_id, r.advantage, r.num_targets) for r in rows] == [("a", 1.0, 2)]


def test_maps_to_the_scheduler_event():
    b = buf(n=2)
    b.add_group(11, ["a", "b"])
    b.record_outcome(valid("a", 1.0))
    (ready,) = b.record_outcome(valid("b", 0.0))
    ev = ready.to_scheduler_event(num_micro_steps=3)
    assert ev == GroupReady(group_id=11, num_micro_steps=3, now=ready.now)


def test_bad_inputs_and_from_args():
    b = buf(n=2)
    b.add_group(0, ["a", "b"])
    with pytest.raises(ValueError):
        b.add_group(0, ["c", "d"])
    with pytest.raises(ValueError):
        b.add_group(1, ["a", "c"])  # "a" already in group 0
    with pytest.raises(ValueError):
        b.add_group(2, ["x"])  # fewer than N
    with pytest.raises(ValueError):
        b.add_group(3, ["y", "y"])
    with pytest.raises(KeyError):
        b.record_outcome(valid("zzz", 1.0))
    b.record_outcome(valid("a", 1.0))
    with pytest.raises(ValueError):
        b.record_outcome(valid("a", 1.0))
    with pytest.raises(ValueError):
        TrajectoryBuffer(0)
    fb = TrajectoryBuffer.from_args(parse_args(["--n-samples-per-prompt", "3", "--filter-zero-std-groups"]))
    assert fb.n == 3 and fb.advantage.filter_zero_std_groups and fb.advantage.std_scaling
    assert math.isclose(AdvantageConfig().eps, 1e-6)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 4), extra=st.integers(0, 3), data=st.data())
def test_readiness_invariants(n, extra, data):
    """Ready exactly when N rewards arrived (the first N in arrival order); dropped exactly when
    N became unreachable; excluded executions never among the designated ones."""
    ids = [f"e{i}" for i in range(n + extra)]
    order = data.draw(st.permutations(ids))
    kinds = data.draw(st.lists(st.sampled_from(["valid", "excluded", "placeholder", "lost"]),
                               min_size=len(ids), max_size=len(ids)))
    b = TrajectoryBuffer(n, AdvantageConfig(), clock=Clock())
    b.add_group(0, ids)
    rewarded, no_reward, events = [], [], []
    for eid, kind in zip(order, kinds):
        final_before = b.group_status(0) != "pending"
        if kind == "valid":
            evs = b.record_outcome(valid(eid, float(len(eid) % 3)))
        elif kind == "placeholder":
            evs = b.record_outcome(ExecutionOutcome.placeholder(eid))
        elif kind == "excluded":
            evs = b.record_outcome(excluded(eid))
        else:
            evs = b.execution_lost(eid)
        if final_before:
            assert evs == []
            continue
        (rewarded if kind in ("valid", "placeholder") else no_reward).append(eid)
        events.extend(evs)
        if len(rewarded) == n:
            (ev,) = evs
            assert isinstance(ev, ReadyGroup) and list(ev.execution_ids) == rewarded
            assert not set(ev.execution_ids) & set(no_reward)
            assert abs(sum(ev.advantages)) < 1e-9
        elif len(ids) - len(no_reward) < n:
            (ev,) = evs
            assert isinstance(ev, GroupDropped) and ev.reason is DropReason.INSUFFICIENT_VALID
        else:
            assert evs == []
    assert len(events) <= 1
    assert (b.group_status(0) == "pending") == (not events)
