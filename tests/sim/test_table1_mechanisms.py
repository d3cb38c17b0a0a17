"""Each Table 1 ablation's mechanism, seen in the simulator's event log, and gone when switched off.

Every test runs the configurations it compares on ``paper-nl2repo`` (12 steps, seed 0 unless
it says otherwise) and asserts what the mechanism does to the event log, then that the
configuration with the mechanism switched off loses it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gyre.sim.cluster import ClusterSim
from gyre.sim.mechanisms import burst_traces, finishes_while_training, mechanism_figures, training_idle_share
from gyre.sim.presets import load_preset
from gyre.sim.table1 import TABLE1, Ablation, table1_sim

STEPS = 12


@pytest.fixture(scope="module")
def base():
    return load_preset("paper-nl2repo")


@pytest.fixture(scope="module")
def run(base):
    """``run(name_or_ablation, seed=0, preset=None)``: a finished ClusterSim, cached."""
    cache: dict = {}

    def go(config, seed: int = 0, preset=None) -> ClusterSim:
        key = (config, seed, id(preset))
        if key not in cache:
            p = preset or base
            if isinstance(config, Ablation):
                q = config.preset(p)
                sim = ClusterSim(replace(q.scheduler, max_steps=STEPS), q.sim, q.workload, seed=seed)
            else:
                sim = table1_sim(p, config, STEPS, seed)
            sim.run()
            cache[key] = (sim, preset)
        return cache[key][0]
    return go


def hours(sim: ClusterSim) -> float:
    return sim.env.now / 3600.0


def dispatch_times(sim: ClusterSim) -> dict[float, int]:
    out: dict[float, int] = {}
    for t, kind, _g, _v in sim.event_log:
        if kind == "dispatch":
            out[t] = out.get(t, 0) + 1
    return out


def publish_times(sim: ClusterSim) -> list[float]:
    return [t for t, kind, _v, _ in sim.event_log if kind == "publish"]


def test_async_boundary_dispatch_waits_for_publication(run):
    """Under Async, replacement rollouts are dispatched only at a publication (mu * B groups)."""
    for name in ("A0", "A1", "A2"):
        sim = run(name)
        cfg = sim.cfg
        starts = dispatch_times(sim)
        assert starts.pop(0.0) == cfg.queue_depth_groups, name
        pubs = publish_times(sim)
        assert set(starts) <= set(pubs), name
        assert set(starts.values()) == {cfg.mu * cfg.B}, name


def test_a1_smaller_training_pool_consumes_a_burst_more_slowly(run, base):
    """A1: 2 training cells instead of 3: a burst trains longer after its data is ready, so its
    publication (and the dispatch that waits for it) comes later; with A0's training nodes it is A0."""
    a0, a1 = run("A0"), run("A1")
    assert a1.cfg.train_cells == 2 and a0.cfg.train_cells == 3
    m0, m1 = mechanism_figures(a0), mechanism_figures(a1)
    assert m1["exposed_training_h"] > 1.3 * m0["exposed_training_h"]
    pubs0, pubs1 = publish_times(a0), publish_times(a1)
    assert all(t1 > t0 for t0, t1 in zip(pubs0[2:], pubs1[2:]))
    assert hours(a1) > hours(a0)
    off = run(replace(TABLE1["A1"], train_nodes=12))
    assert hours(off) == hours(a0)


def test_a2_training_waits_for_a_multi_step_bursts_data(run):
    """A2: 3-step bursts on a fixed split.  The publication every 3 steps releases 3 * B groups
    at once; the rollout pool serves them in waves, so training cells idle more waiting for data
    than A0's, and the run is slower.  With 1-step bursts (A0's shape) the waiting goes."""
    a0, a2 = run("A0"), run("A2")
    assert set(dispatch_times(a2).values()) >= {3 * a2.cfg.B}
    assert training_idle_share(a2) > training_idle_share(a0) + 0.01
    assert hours(a2) > hours(a0)
    off = run(replace(TABLE1["A2"], phi=1.5, mu=1))
    assert hours(off) == hours(a0)


def test_a3_streaming_under_async_starts_steps_before_their_batch_is_ready(run):
    """A3: a step's first micro-step starts before its last group is ready; without streaming
    (A0) never.  The split stays fixed either way: no switch, no reroute."""
    def early_steps(sim):
        ready = {g: t for t, k, g, _ in sim.event_log if k == "ready"}
        groups: dict[int, list[int]] = {}
        first: dict[int, float] = {}
        for t, k, a, b in sim.event_log:
            if k == "enqueue":
                groups.setdefault(b, []).append(a)
            elif k == "micro":
                first.setdefault(b, t)
        return sum(first[s] < max(ready[g] for g in groups[s]) for s in groups)

    a0, a3 = run("A0"), run("A3")
    assert early_steps(a3) >= STEPS // 2
    assert early_steps(a0) == 0
    assert a3.sched.switches == a0.sched.switches == 0 and a3.rerouted == 0
    assert hours(a3) < hours(a0)
    assert hours(run(replace(TABLE1["A3"], streaming=False))) == hours(a0)


def test_c1_standalone_nodes_keep_executions_running_while_the_pool_trains(run):
    """C1: the colocated pool switches with executions unfinished; they are rerouted to the
    standalone pool (their harness state kept) and finish there while every cell trains.
    Without streaming the pool waits for the burst's data before it switches.  C0 (no
    standalone pool) has none of this."""
    c0, c1 = run("C0"), run("C1")
    assert c1.rerouted > 0 and finishes_while_training(c1)["standalone"] > 0
    assert c0.rerouted == 0 and finishes_while_training(c0) == {"standalone": 0, "cells": 0}
    for b in burst_traces(c1):
        assert b.train_entries_s[0] >= b.data_ready_s
        assert b.streamed_s == 0
    assert hours(c1) < hours(c0)


def test_c2_streaming_trains_on_complete_groups_while_the_rest_arrive(run):
    """C2 = C1 + streaming: the pool still switches together (all its cells at one instant), but
    training starts before the burst's last group is ready, on the groups already complete;
    with streaming forced off C2 is C1."""
    c1, c2 = run("C1"), run("C2")
    bursts = burst_traces(c2)
    assert sum(b.streamed_s > 0 for b in bursts) >= len(bursts) - 1
    for b in bursts:
        assert len(set(b.train_entries_s)) == 1 and len(b.train_entries_s) == c2.cfg.num_cells
        assert b.first_micro_s < b.data_ready_s or b.streamed_s == 0
    assert finishes_while_training(c2)["standalone"] > 0
    assert hours(c2) < hours(c1)
    assert hours(run(replace(TABLE1["C2"], streaming=False))) == hours(c1)


def test_c3_more_standalone_nodes_switch_earlier_and_train_longer(run):
    """C3: 8 standalone nodes.  The pool that switches together is smaller (6 cells), so its
    executions fit on the standalone pool sooner and it switches earlier in each burst; fewer
    nodes train, so the training phase is longer.  With C2's 4 standalone nodes it is C2."""
    c2, c3 = run("C2"), run("C3")
    b2, b3 = burst_traces(c2)[1:], burst_traces(c3)[1:]
    def entry(bs):
        return sum(b.train_entries_s[0] - p.publish_s for p, b in zip(bs, bs[1:])) / (len(bs) - 1)

    assert entry(b3) < entry(b2)
    assert mechanism_figures(c3)["training_h"] > mechanism_figures(c2)["training_h"]
    assert hours(run(replace(TABLE1["C3"], standalone_nodes=4))) == hours(c2)


def test_e0_cells_switch_one_by_one_while_others_serve(run):
    """E0 vs C2: elastic cells enter training one at a time within a burst while the others keep
    serving executions; C2's colocated cells all switch at one instant."""
    e0, c2 = run("E0"), run("C2")
    assert mechanism_figures(e0)["train_entry_spread_h"] > 0.5
    assert mechanism_figures(c2)["train_entry_spread_h"] == 0
    assert finishes_while_training(e0)["cells"] > 1000
    assert finishes_while_training(c2)["cells"] == 0
    assert hours(e0) < hours(c2)


def test_e2_coarser_cells_leave_less_slack_to_hide_training(run, base):
    """E2: 4 cells of 8 nodes.  A cell can move only when twice the capacity is free, so training
    starts later in each burst and its cells idle less (E0's training cells idle ~a sixth of
    their time: the slack with which rollout hides training); with a step twice as costly E2
    leaves more training on the critical path than E0.  With 4-node cells it is E0."""
    for seed in (0, 1, 2):
        e0, e2 = run("E0", seed), run("E2", seed)
        def first(sim):
            return [b.train_entries_s[0] for b in burst_traces(sim)]

        assert all(t2 > t0 for t0, t2 in zip(first(e0), first(e2))), seed
        assert training_idle_share(e2) < training_idle_share(e0) - 0.05, seed
        assert 0.1 < training_idle_share(e0) < 0.25, seed
    costly = replace(base, sim=replace(base.sim, train_step_cell_s=2 * base.sim.train_step_cell_s))
    e0, e2 = run("E0", 0, costly), run("E2", 0, costly)
    assert mechanism_figures(e2)["exposed_training_h"] > 1.15 * mechanism_figures(e0)["exposed_training_h"]
    assert hours(e2) > hours(e0)
    assert hours(run(replace(TABLE1["E2"], nodes_per_cell=None))) == hours(run("E0"))


def test_no_two_configurations_take_the_same_time(run):
    h = {name: hours(run(name)) for name in TABLE1}
    assert len(set(h.values())) == len(h), h
