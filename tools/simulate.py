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

Exit status 0 on success, 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.scheduler import PLACEMENTS  # noqa: E402
from gyre.sim.compare import compare, placement_config  # noqa: E402
from gyre.sim.presets import load_preset  # noqa: E402

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
            raise argparse.ArgumentTypeError(f"unknown placement {p!r} (expected a comma list of {', '.join(PLACEMENTS)})")
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


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    ap = _Parser(prog="simulate.py", description="Compare elastic / async / colocate placements in simulation.")
    ap.add_argument("--workload", default="paper-nl2repo",
                    help="preset name (paper-nl2repo, toy) or a .jsonl/.csv trace (default: paper-nl2repo)")
    ap.add_argument("--placement", type=_placements, default=list(PLACEMENTS),
                    help="comma list of placements (default: elastic,async,colocate)")
    ap.add_argument("--mean-staleness", type=_non_negative_float, default=1.5,
                    help="target mean staleness E[d] = phi + (mu - 1)/2 (default 1.5)")
    ap.add_argument("--steps", type=_positive_int, default=48, help="optimizer steps to simulate (default 48)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", metavar="PNG", help="write per-cell role timelines, one panel per placement")
    ap.add_argument("--elastic-phi", type=_non_negative_float, default=None, help="elastic phi (with --elastic-mu)")
    ap.add_argument("--elastic-mu", type=_positive_int, default=None, help="elastic mu (with --elastic-phi)")
    ap.add_argument("--train-cells", type=_positive_int, default=None,
                    help="async: cells fixed in training (default: the workload's)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    if (args.elastic_phi is None) != (args.elastic_mu is None):
        return _fail("--elastic-phi and --elastic-mu go together")
    elastic = (args.elastic_phi, args.elastic_mu) if args.elastic_phi is not None else None
    try:
        preset = load_preset(args.workload)
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


if __name__ == "__main__":
    sys.exit(main())
