#!/usr/bin/env python
"""Elastic policy variants in the simulator, against the strongest Async split and Colocate.

Usage::

    python bench/policy_search.py [--steps 48] [--seeds 5] [--json]

Each variant is a :class:`gyre.scheduler.placement.ElasticPlacement` with one decision changed
(``VARIANTS``).  Every variant runs on two workloads -- ``paper-nl2repo`` and ``near-timeout``
(the same cluster; i.i.d. lognormal executions with median 3.4 h and sigma 0.15 under the 4 h
timeout, so most of a group finishes together close to the cap) -- at ``E[d]`` 1 and 1.5,
averaged over ``--seeds`` seeds.  Async is run with every training split (1 .. K-1 cells) and the
fastest split is the baseline; Colocate at the same ``E[d]``.

Prints, per workload and ``E[d]``: hours of each variant, its mean staleness, and the ratios
Async-best / variant and Colocate / variant (above 1: the variant is faster).  Run by hand; not
a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.scheduler.dispatch import ExecutionState
from gyre.scheduler.events import CellState
from gyre.scheduler.placement import ElasticPlacement
from gyre.sim import ClusterSim, LognormalWorkload, load_preset, placement_config

_TRAINING_SIDE = (CellState.TRAINING, CellState.TO_TRAINING)


class RetainCoreAlways(ElasticPlacement):
    """The core never returns to rollout."""

    def retain_core(self, s):
        return True


class KeepSatellitesThatFit(ElasticPlacement):
    """At a burst end only the satellites the waterlevel needs return (highest first); the others
    stay for the next burst when the core stays."""

    def release_at_burst_end(self, s):
        training = [c for c in range(1, s.config.num_cells) if s.cell_states[c] in _TRAINING_SIDE]
        out = []
        capacity = s.rollout_capacity(include_returning=True)
        for c in reversed(training):
            if capacity >= s.counters.waterlevel and s.supply_ok(busy_cells=len(training) - len(out)):
                break
            out.append(c)
            capacity += s.config.rollout_concurrency_per_cell
        return out


class CapacitySlack(ElasticPlacement):
    """A cell may move when the rollout capacity left covers 90 % of the waterlevel (queueing
    the rest briefly).  Its running executions may then have nowhere to go: the simulator stalls."""

    slack = 0.9

    def next_to_train(self, s):
        if not s.training_may_grow:
            return None
        from gyre.scheduler.placement import next_in_ascending_order

        j = next_in_ascending_order(s)
        if j is None or s.rollout_capacity(excluding=j) < self.slack * s.counters.waterlevel:
            return None
        return j if s.supply_ok(busy_cells=s.cells_in(_TRAINING_SIDE)) else None


class StrictSupply(ElasticPlacement):
    """A cell moves only when the step holds at least two unfinished micro-steps per training cell
    after it joins (less idle joining)."""

    def next_to_train(self, s):
        j = super().next_to_train(s)
        if j is None:
            return None
        busy = s.cells_in(_TRAINING_SIDE)
        return j if s.queue.stream_open or s.queue.pending_micro_steps >= 2 * (busy + 1) else None


class RetainCoreNearReady(ElasticPlacement):
    """Execution progress in the core's decision: the core also stays when the capacity check
    passes and some dispatched group lacks at most one finished execution (work is about to come)."""

    def retain_core(self, s):
        if super().retain_core(s):
            return True
        if s.rollout_capacity(excluding=0, include_returning=True) < s.counters.waterlevel:
            return False
        finished = ExecutionState.FINISHED
        for g in s.queue.groups.values():
            if not g.ready and sum(s.queue.executions[e].state is finished
                                   for e in g.execution_ids) >= s.config.N - 1:
                return True
        return False


VARIANTS = {"elastic": ElasticPlacement, "retain-core-always": RetainCoreAlways,
            "keep-satellites-that-fit": KeepSatellitesThatFit, "capacity-slack-0.9": CapacitySlack,
            "strict-supply": StrictSupply, "retain-core-near-ready": RetainCoreNearReady}


def workloads():
    base = load_preset("paper-nl2repo")
    near = replace(base, name="near-timeout",
                   workload=LognormalWorkload(name="near-timeout", median_s=3.4 * 3600, sigma=0.15,
                                              timeout_s=4 * 3600))
    return {"paper-nl2repo": base, "near-timeout": near}


def simulate(preset, placement: str, e: float, steps: int, seeds: int, policy=None, train_cells=None):
    cfg = placement_config(preset, placement, e, steps, train_cells=train_cells)
    runs = [ClusterSim(cfg, preset.sim, preset.workload, seed=s, placement=policy() if policy else None).run()
            for s in range(seeds)]
    return statistics.fmean(r.hours for r in runs), statistics.fmean(r.mean_staleness for r in runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="policy_search.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="one JSON line per workload and E[d]")
    a = ap.parse_args(argv)
    for wname, preset in workloads().items():
        for e in (1.0, 1.5):
            splits = {k: simulate(preset, "async", e, a.steps, a.seeds, train_cells=k)[0]
                      for k in range(1, preset.scheduler.num_cells)}
            best_k = min(splits, key=splits.get)
            colocate = simulate(preset, "colocate", e, a.steps, a.seeds)[0]
            rows = {}
            for name, policy in VARIANTS.items():
                try:
                    hours, stale = simulate(preset, "elastic", e, a.steps, a.seeds, policy=policy)
                except RuntimeError as exc:  # e.g. a move with nowhere to reroute its executions
                    rows[name] = {"stalled": str(exc)[:160]}
                    continue
                rows[name] = {"hours": round(hours, 3), "mean_staleness": round(stale, 3),
                              "async_best_over": round(splits[best_k] / hours, 4),
                              "colocate_over": round(colocate / hours, 4)}
            out = {"workload": wname, "mean_staleness": e, "steps": a.steps, "seeds": a.seeds,
                   "async_best": {"train_cells": best_k, "hours": round(splits[best_k], 3)},
                   "async_splits_h": {k: round(v, 3) for k, v in splits.items()},
                   "colocate_h": round(colocate, 3), "variants": rows}
            if a.json:
                print(json.dumps(out), flush=True)
                continue
            print(f"{wname}, E[d] = {e}: async best {best_k} training cells {splits[best_k]:.2f} h, "
                  f"colocate {colocate:.2f} h")
            for name, r in rows.items():
                if "stalled" in r:
                    print(f"  {name:<26} stalled: {r['stalled']}")
                    continue
                print(f"  {name:<26} {r['hours']:7.2f} h  staleness {r['mean_staleness']:.3f}  "
                      f"async-best/it {r['async_best_over']:.3f}  colocate/it {r['colocate_over']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
