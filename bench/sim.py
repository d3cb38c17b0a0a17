#!/usr/bin/env python
"""Simulator benchmarks: seed spread of the paper comparison and sensitivity sweeps.

Usage::

    python bench/sim.py                 # paper-nl2repo, E[d] in {1, 1.5}, 48 steps, seeds 0..4
    python bench/sim.py --sweep         # + training cost (h per step on one cell) x Async split
    python bench/sim.py --seeds 10 --steps 48
    python bench/sim.py --calibrate     # the inference slowdown that puts Table 1's E0 at 16.12 h

Prints elastic / Async / Colocate hours and elastic's speedups (mean +- sd over seeds) next to
the paper's (1.42-1.53x over Async, 1.36-1.47x over Colocate), and the wall time per run.
Run by hand; not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.sim import load_preset, run_placement

PAPER = {"async": "1.42-1.53", "colocate": "1.36-1.47"}


def _ms(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.2f}" + (f" +- {statistics.stdev(xs):.2f}" if len(xs) > 1 else "")


def seeds_table(steps: int, seeds: int) -> None:
    preset = load_preset("paper-nl2repo")
    print(f"paper-nl2repo, {steps} steps, seeds 0..{seeds - 1} "
          f"(train {preset.sim.train_step_cell_s / 3600:g} h/step/cell, Async train cells {preset.scheduler.train_cells})")
    for e in (1.0, 1.5):
        hours: dict[str, list[float]] = {"elastic": [], "async": [], "colocate": []}
        t0 = time.perf_counter()
        for seed in range(seeds):
            for p in hours:
                hours[p].append(run_placement(preset, p, e, steps, seed=seed).hours)
        wall = (time.perf_counter() - t0) / (3 * seeds)
        print(f"  E[d]={e:g}: hours " + ", ".join(f"{p} {_ms(h)}" for p, h in hours.items()))
        for base in ("async", "colocate"):
            sp = [b / a for a, b in zip(hours["elastic"], hours[base])]
            print(f"           elastic over {base:<8} {_ms(sp)}x  (paper {PAPER[base]}x)")
        print(f"           {wall:.2f} s per simulated run")


def sweep(steps: int) -> None:
    base = load_preset("paper-nl2repo")
    print(f"\nsensitivity (seed 0, {steps} steps): training cost per step on one cell x Async split")
    print(f"{'train h':>7} {'E':>4} {'elastic':>8} {'colocate':>9} {'x':>5}   async by train cells (hours, x)")
    for t1 in (0.5, 1.0, 2.0, 3.0, 4.0, 6.0):
        preset = replace(base, sim=replace(base.sim, train_step_cell_s=t1 * 3600.0))
        for e in (1.0, 1.5):
            el = run_placement(preset, "elastic", e, steps).hours
            co = run_placement(preset, "colocate", e, steps).hours
            asy = {k: run_placement(preset, "async", e, steps, train_cells=k).hours for k in (1, 2, 3, 4)}
            cells = "  ".join(f"{k}: {h:6.1f} {h / el:4.2f}" for k, h in asy.items())
            print(f"{t1:>7g} {e:>4g} {el:>8.1f} {co:>9.1f} {co / el:>5.2f}   {cells}", flush=True)


def calibrate(target_h: float = 16.12, steps: int = 12, seeds: int = 5, iters: int = 12) -> float:
    """Bisect ``SimConfig.inference_slowdown`` (a faster decode on a less occupied engine) until
    Table 1's E0 averages ``target_h`` over ``seeds``; print each try and return the value.

    E0 is rollout-bound, so the training cost barely moves it (0.5 h to 3 h per step on one cell:
    16.70 h to 16.95 h); the slowdown is the one free parameter that does."""
    from gyre.sim.table1 import run_table1

    base = load_preset("paper-nl2repo")
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        a = (lo + hi) / 2
        preset = replace(base, sim=replace(base.sim, inference_slowdown=a))
        h = run_table1(preset, steps, seeds=range(seeds), names=["E0"])["configs"]["E0"]["hours"]
        print(f"inference_slowdown {a:.5f}: E0 {h:.3f} h over seeds 0..{seeds - 1}", flush=True)
        lo, hi = (a, hi) if h > target_h else (lo, a)
    a = round((lo + hi) / 2, 4)
    print(f"calibrated inference_slowdown = {a} (E0 target {target_h} h, {steps} steps)")
    return a


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also sweep training cost x Async split")
    ap.add_argument("--calibrate", action="store_true",
                    help="only bisect the inference slowdown that puts Table 1's E0 at 16.12 h (5 seeds, 12 steps)")
    args = ap.parse_args()
    if args.calibrate:
        calibrate()
        return 0
    seeds_table(args.steps, args.seeds)
    if args.sweep:
        sweep(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
