#!/usr/bin/env python
"""Do the placements learn alike?  The toy-learning run under elastic, async and colocate.

Usage::

    python bench/placement_parity.py [--seeds 0 1] [--warmstart-steps 300] [--out runs/parity]
        [--train-steps N]

Per seed: one supervised format warm-start (``bench/toy_learning.py``'s), then the main job of
``examples/cpu_toy_learning.yaml`` from it once per placement, same seed and tasks.  The
configuration has ``(phi, mu) = (0, 1)``, so every placement runs at the same expected staleness
``E[d] = 0`` (async: cell 0 trains, the others serve rollouts).

Prints one JSON line per seed and placement (``curve``: mean training reward per step,
``final5``: mean of the last five steps, ``wall_s``, ``mean_staleness``), then one summary
line (per seed: the largest difference between the placements' ``final5``, and whether it is
within 0.1) and writes ``OUT/placement_parity.png`` with every curve.  Run by hand; not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from toy_learning import run_toy, warm_start  # noqa: E402

PLACEMENTS = ("elastic", "async", "colocate")


def curve_of(run: Path) -> list[float]:
    summary = json.loads((run / "summary.json").read_text())
    by_step = summary["reward_mean_by_step"]
    return [float(by_step[k]) for k in sorted(by_step, key=int) if by_step[k] is not None]


def plot(curves: dict[tuple[int, str], list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"elastic": "-", "async": "--", "colocate": ":"}
    for (seed, placement), curve in sorted(curves.items()):
        ax.plot(range(1, len(curve) + 1), curve, styles[placement], label=f"{placement}, seed {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel("mean training reward")
    ax.set_title("toy learning: placements at E[d] = 0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="placement_parity.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--warmstart-steps", type=int, default=300)
    ap.add_argument("--train-steps", type=int, default=None, help="override the configuration's --train-steps")
    ap.add_argument("--out", default=str(ROOT / "runs" / "parity"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--train-steps", str(a.train_steps)] if a.train_steps else []
    curves: dict[tuple[int, str], list[float]] = {}
    spread: dict[int, float] = {}
    for seed in a.seeds:
        warm = warm_start(out / f"warm-{seed}", seed, a.warmstart_steps)
        finals = {}
        for placement in PLACEMENTS:
            run = out / f"seed-{seed}-{placement}"
            r = run_toy(warm, seed, run, "--placement", placement, *extra)
            if r.returncode != 0:
                print(f"placement_parity: seed {seed} {placement} failed (exit {r.returncode})\n{r.stderr[-3000:]}",
                      file=sys.stderr)
                return 1
            summary = json.loads((run / "summary.json").read_text())
            curve = curves[(seed, placement)] = curve_of(run)
            finals[placement] = sum(curve[-5:]) / len(curve[-5:])
            print(json.dumps({"seed": seed, "placement": placement, "curve": [round(x, 3) for x in curve],
                              "final5": round(finals[placement], 4), "wall_s": summary["wall_s"],
                              "mean_staleness": round(summary["staleness_mean"], 4)}), flush=True)
        spread[seed] = round(max(finals.values()) - min(finals.values()), 4)
    png = out / "placement_parity.png"
    plot(curves, png)
    print(json.dumps({"final5_spread_by_seed": spread, "within_0.1": all(v <= 0.1 for v in spread.values()),
                      "png": str(png)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
