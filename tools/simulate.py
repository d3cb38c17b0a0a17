#!/usr/bin/env python
"""Simulate placements at matched mean staleness on a workload (paper §6).

Usage::

    python tools/simulate.py --workload paper-nl2repo --placement elastic,async,colocate \\
        --mean-staleness 1.5 --steps 48 [--seed S] [--json] [--plot timeline.png]

``(phi, mu)`` per placement for the requested mean staleness ``E`` (paper App. A,
``E = phi + (mu - 1)/2``): Async ``(E, 1)``, Colocate ``(0, 2E + 1)``, elastic ``(0, 3)`` at ``E = 1``
and ``(0.5, 3)`` at ``E = 1.5`` (``mu = 3, phi = E - 1`` in general; ``--elastic-phi/--elastic-mu``
override).  Each placement runs the real :class:`gyre.scheduler.Scheduler` in
:class:`gyre.sim.ClusterSim` with the same seed.

Output: a table (total hours, speedup of elastic over each baseline, measured vs. expected mean
staleness, per-cell training share, switch counts), or with ``--json`` one object::

    {"placements": {"elastic": {"hours": h, "phi": p, "mu": m, "mean_staleness": s,
                                "switches": n, "train_share": [per cell]}, "async": {...}, ...},
     "speedup_over": {"async": x, "colocate": y}}

``--workload`` is a preset (``paper-nl2repo``, ``toy``) or a trace file (``.jsonl``/``.csv`` of
per-execution ``duration_s``, ``timed_out``, optional ``query``, ``model_calls``) run on the
paper-nl2repo cluster.  ``--plot`` writes a per-cell role timeline (rollout / training /
switching), one panel per placement.  A progress bar goes to stderr on a terminal.

``--no-streaming``, ``--nodes-per-cell`` and ``--standalone-nodes`` reshape every placement's
run (:func:`gyre.sim.compare.regroup` keeps the node count and per-node speeds).

``--from-run RUN_DIR`` predicts each ``--placement``'s wall time on a finished main-job run's
own measured setup (:mod:`gyre.sim.from_run`).

``--table1`` runs the paper's Table 1 ablations instead (:mod:`gyre.sim.table1`; 12 steps
unless ``--steps`` is given, at ``E[d]`` = 1.5) over ``--seeds`` seeds (default 5, from
``--seed``) and prints each configuration's mean hours with a 95 % interval, its time relative to
``E0``, and the pairs whose difference is within noise; with ``--json``::

    {"steps": 12, "seeds": [0, ...], "configs": {"A0": {"hours": h, "hours_ci": [lo, hi],
     "time_vs_E0": r, "time_vs_E0_ci": [lo, hi], "phi": p, "mu": m, "mean_staleness": s,
     "staleness_after_warmup": w, "switches": n, "mechanisms": {...}}, ...},
     "ratios": {"A0/A1": {"mean": r, "ci": [lo, hi], "within_noise": b}, ...}, "within_noise": [...]}

``--table1 --sweep`` reruns the table while varying the duration spread, the timeout share and
the training step cost one at a time (:mod:`gyre.sim.sweep`) and prints markdown tables of each
configuration's time relative to ``E0`` (``--json``: the numbers; ``--plot PNG``: one panel per
input).

Exit status 0 on success, 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.scheduler import PLACEMENTS
from gyre.sim.compare import compare, placement_config, regroup
from gyre.sim.presets import load_preset

PROG = "simulate"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.exit(2)


def _fail(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 2


def _placements(text: str) -> list[str]:
    items = [p.strip() for p in text.split(",") if p.strip()]
    for p in items:
        if p not in PLACEMENTS:
            raise argparse.ArgumentTypeError(
                f"unknown placement {p!r} (expected a comma list of {', '.join(PLACEMENTS)})")
    if not items or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError("placements must be a non-empty comma list without repeats")
    return items


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _table(out: dict, results: dict, preset_name: str, e: float, steps: int) -> str:
    lines = [f"workload {preset_name}, mean staleness E[d] = {e:g}, {steps} steps"]
    lines.append(f"{'placement':<10} {'hours':>8} {'phi':>5} {'mu':>3} {'staleness':>17} {'switches':>9} "
                 f"{'rollout util':>12}  train share per cell")
    for name, r in results.items():
        stale = f"{r.mean_staleness:.3f} (exp {r.expected_staleness:g})"
        share = " ".join(f"{x:.2f}" for x in r.train_share)
        lines.append(f"{name:<10} {r.hours:>8.2f} {r.phi:>5g} {r.mu:>3} {stale:>17} {r.switches:>9} "
                     f"{r.rollout_utilisation:>12.2f}  {share}")
    for base, x in out["speedup_over"].items():
        lines.append(f"elastic is {x:.2f}x faster than {base}")
    return "\n".join(lines)


def _table1(out: dict, preset_name: str) -> str:
    from gyre.sim.table1 import TABLE1, TABLE1_MEAN_STALENESS

    seeds = out["seeds"]
    lines = [f"Table 1 ablations: workload {preset_name}, E[d] = {TABLE1_MEAN_STALENESS:g}, {out['steps']} steps, "
             f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''} ({seeds[0]}..{seeds[-1]})"]
    lines.append(f"{'config':<6} {'hours':>7} {'95% interval':>15} {'vs E0':>6} {'phi':>4} {'mu':>3} {'staleness':>9} "
                 f"{'warm':>6} {'switches':>8}  description")
    for name, c in out["configs"].items():
        rel = "-" if c["time_vs_E0"] is None else f"{c['time_vs_E0']:.3f}"
        ci = "-" if c["hours_ci"] is None else f"{c['hours_ci'][0]:.2f}-{c['hours_ci'][1]:.2f}"
        warm = "-" if c["staleness_after_warmup"] is None else f"{c['staleness_after_warmup']:.3f}"
        lines.append(f"{name:<6} {c['hours']:>7.2f} {ci:>15} {rel:>6} {c['phi']:>4g} {c['mu']:>3} "
                     f"{c['mean_staleness']:>9.3f} {warm:>6} {c['switches']:>8g}  {TABLE1[name].description}")
    lines.append("staleness: mean over the run; warm: after the steps fed by the start-up dispatch")
    if len(seeds) < 2:
        lines.append("one seed: no intervals; use --seeds N to tell differences from noise")
    elif out["within_noise"]:
        lines.append("within noise (the ratio's 95% interval contains 1): " + ", ".join(out["within_noise"]))
    else:
        lines.append("within noise: none (every pair's ratio interval excludes 1)")
    return "\n".join(lines)


def _run_from_run(args) -> int:
    from gyre.sim.from_run import predict_from_run

    try:
        out = predict_from_run(args.from_run, args.placement, seed=args.seed)
    except ValueError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"run {out['run']} ({out['placement']}): measured {out['measured_s']} s")
    print("setup: " + ", ".join(f"{k} {v}" for k, v in out["setup"].items()))
    for p, t in out["predicted_s"].items():
        print(f"  {p:<9} predicted {t:9.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    ap = _Parser(prog="simulate.py", description="Compare elastic / async / colocate placements in simulation.")
    ap.add_argument("--workload", default="paper-nl2repo",
                    help="preset name (paper-nl2repo, toy) or a .jsonl/.csv trace (default: paper-nl2repo)")
    ap.add_argument("--placement", type=_placements, default=list(PLACEMENTS),
                    help="comma list of placements (default: elastic,async,colocate)")
    ap.add_argument("--mean-staleness", type=_non_negative_float, default=1.5,
                    help="target mean staleness E[d] = phi + (mu - 1)/2 (default 1.5)")
    ap.add_argument("--steps", type=_positive_int, default=None,
                    help="optimizer steps to simulate (default 48; 12 with --table1)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0); with --seeds the first one")
    ap.add_argument("--seeds", type=_positive_int, default=None,
                    help="--table1: seeds to average over, from --seed (default 5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", metavar="PNG", help="write per-cell role timelines, one panel per placement")
    ap.add_argument("--elastic-phi", type=_non_negative_float, default=None, help="elastic phi (with --elastic-mu)")
    ap.add_argument("--elastic-mu", type=_positive_int, default=None, help="elastic mu (with --elastic-phi)")
    ap.add_argument("--train-cells", type=_positive_int, default=None,
                    help="async: cells fixed in training (default: the workload's)")
    ap.add_argument("--no-streaming", action="store_true",
                    help="a step's groups enter training together once B are ready (default: streaming)")
    ap.add_argument("--nodes-per-cell", type=_positive_int, default=None,
                    help="regroup the workload's nodes into cells of this many nodes (default: the preset's)")
    ap.add_argument("--standalone-nodes", type=int, default=0,
                    help="nodes taken from the cells into a standalone rollout pool (default 0)")
    ap.add_argument("--table1", action="store_true",
                    help="run the paper's Table 1 ablations (A0-A3, C0-C3, E0-E2) at E[d] = 1.5 instead; "
                         "paper-nl2repo is calibrated so that E0 averages the paper's 16.12 h (docs/simulator.md)")
    ap.add_argument("--sweep", action="store_true",
                    help="with --table1: rerun it varying the duration spread, the timeout share and the training "
                         "step cost; markdown tables (--plot PNG: one panel per input)")
    ap.add_argument("--from-run", metavar="RUN_DIR",
                    help="predict the wall time of --placement on a finished main-job run's own measured setup "
                         "(its cells, dispatch shape, steps, executions and timings) instead; --json: one object")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    if (args.elastic_phi is None) != (args.elastic_mu is None):
        return _fail("--elastic-phi and --elastic-mu go together")
    elastic = (args.elastic_phi, args.elastic_mu) if args.elastic_phi is not None else None
    if (args.seeds is not None or args.sweep) and not args.table1:
        return _fail("--seeds and --sweep go with --table1")
    if args.table1:
        return _run_table1(args)
    if args.from_run:
        return _run_from_run(args)
    if args.steps is None:
        args.steps = 48
    try:
        preset = load_preset(args.workload)
        if args.nodes_per_cell is not None or args.standalone_nodes:
            preset = regroup(preset, args.nodes_per_cell, args.standalone_nodes)
        if args.no_streaming:
            preset = replace(preset, scheduler=replace(preset.scheduler, streaming=False))
        for p in args.placement:  # validate every shape before simulating anything
            placement_config(preset, p, args.mean_staleness, args.steps, elastic, args.train_cells)
    except ValueError as exc:
        return _fail(str(exc))
    if args.plot:
        parent = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(parent):
            return _fail(f"--plot: directory {parent} does not exist")

    from tqdm import tqdm

    total = args.steps * len(args.placement)
    with tqdm(total=total, desc="simulating", unit="step", file=sys.stderr, leave=False,
              disable=True if args.no_progress else None) as bar:
        out = compare(preset, args.placement, args.mean_staleness, args.steps, seed=args.seed, elastic=elastic,
                      train_cells=args.train_cells, on_step=lambda _v: bar.update(1))
    results = out.pop("_results")
    if args.plot:
        from gyre.sim.plot import plot_timelines

        try:
            plot_timelines(results, args.plot, title=f"{preset.name}, E[d] = {args.mean_staleness:g}")
        except OSError as exc:
            return _fail(f"--plot: {exc}")
    if args.json:
        print(json.dumps(out))
    else:
        print(_table(out, results, preset.name, args.mean_staleness, args.steps))
    return 0


def _run_table1(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from gyre.sim.table1 import TABLE1, run_table1

    steps = 12 if args.steps is None else args.steps
    seeds = list(range(args.seed, args.seed + (5 if args.seeds is None else args.seeds)))
    try:
        preset = load_preset(args.workload)
        for name in TABLE1:  # validate every configuration before simulating anything
            TABLE1[name].preset(preset)
        if args.sweep:
            from gyre.sim.sweep import SWEEP_VALUES, swept_preset

            for name, values in SWEEP_VALUES.items():
                for v in values:
                    swept_preset(preset, name, v)
    except ValueError as exc:
        return _fail(str(exc))
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        return _fail(f"--plot: directory {os.path.dirname(os.path.abspath(args.plot))} does not exist")
    if args.plot and not args.sweep:
        return _fail("--plot goes with --sweep under --table1")
    points = sum(len(v) for v in SWEEP_VALUES.values()) if args.sweep else 1
    with tqdm(total=points * len(TABLE1) * len(seeds), desc="simulating", unit="run", file=sys.stderr,
              leave=False, disable=True if args.no_progress else None) as bar:
        if args.sweep:
            from gyre.sim.sweep import plot_sweep, run_sweep, sweep_markdown

            out = run_sweep(preset, steps, seeds, on_done=lambda: bar.update(1))
        else:
            out = run_table1(preset, steps, seeds=seeds, on_done=lambda: bar.update(1))
    if args.sweep:
        if args.plot:
            try:
                plot_sweep(out, args.plot)
            except OSError as exc:
                return _fail(f"--plot: {exc}")
        print(json.dumps(out) if args.json else sweep_markdown(out))
        return 0
    print(json.dumps(out) if args.json else _table1(out, preset.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
