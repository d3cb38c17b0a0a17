#!/usr/bin/env python
"""Does the simulator predict real runs?  Measured vs predicted wall time of three placements.

Usage::

    python bench/sim_fidelity.py [--config examples/cpu_tiny.yaml] [--seed 1234] [--sim-seeds 5]
        [--out DIR] [--reuse]

Runs the CPU main job (``torchrun pretrain_gyre.py``) once per placement (elastic, async,
colocate) on the same configuration, seed and tasks, into ``DIR/<placement>`` (``--reuse`` keeps
finished run directories).  Then :func:`gyre.sim.from_run.predict_from_run` predicts each
placement's wall time twice: from the **elastic run's** measured setup (one measurement predicts
the other placements, as a user would before choosing one) and from **each placement's own run**.
Predictions are means over ``--sim-seeds`` simulator seeds.

Prints a table and one JSON line: ``measured_s``, ``predicted_s`` (from the elastic run),
``predicted_own_s``, ``error`` (predicted / measured - 1, from the elastic run), the measured
and predicted orders (fastest first), ``order_matches`` and ``within_20pct``.
Run by hand; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.sim.from_run import predict_from_run  # noqa: E402

PLACEMENTS = ("elastic", "async", "colocate")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error")


def run_job(config: Path, placement: str, run_dir: Path, seed: int, nproc: int) -> float:
    """One main job; returns its wall time as the launcher saw it (seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "pretrain_gyre.py"), "--config", str(config), "--placement", placement,
           "--run-dir", str(run_dir), "--seed", str(seed), "--no-progress"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"sim_fidelity: the {placement} run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return time.monotonic() - t0


def mean_prediction(run_dir: Path, placements, sim_seeds: int) -> dict[str, float]:
    runs = [predict_from_run(run_dir, placements, seed=s)["predicted_s"] for s in range(sim_seeds)]
    return {p: round(statistics.fmean(r[p] for r in runs), 2) for p in placements}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sim_fidelity.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "cpu_tiny.yaml"))
    ap.add_argument("--seed", type=int, default=1234, help="the main job's --seed (same for every placement)")
    ap.add_argument("--sim-seeds", type=int, default=5, help="simulator seeds averaged per prediction")
    ap.add_argument("--nproc", type=int, default=3, help="ranks (= cells on the CPU default)")
    ap.add_argument("--out", default=None, help="directory of the run directories (default: a new temporary one)")
    ap.add_argument("--reuse", action="store_true", help="keep run directories that already have a summary.json")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="sim-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    launcher_s = {}
    for p in PLACEMENTS:
        run = out / p
        if a.reuse and (run / "summary.json").is_file():
            continue
        launcher_s[p] = round(run_job(Path(a.config), p, run, a.seed, a.nproc), 2)
        print(f"[sim_fidelity] {p}: run finished in {launcher_s[p]} s", file=sys.stderr, flush=True)
    measured = {p: json.loads((out / p / "summary.json").read_text())["wall_s"] for p in PLACEMENTS}
    predicted = mean_prediction(out / "elastic", PLACEMENTS, a.sim_seeds)
    own = {p: mean_prediction(out / p, (p,), a.sim_seeds)[p] for p in PLACEMENTS}
    error = {p: round(predicted[p] / measured[p] - 1, 4) for p in PLACEMENTS}
    error_own = {p: round(own[p] / measured[p] - 1, 4) for p in PLACEMENTS}
    order_m = sorted(PLACEMENTS, key=measured.get)
    order_p = sorted(PLACEMENTS, key=predicted.get)
    print(f"{'placement':<10} {'measured s':>10} {'predicted s':>11} {'error':>7} {'own run s':>10} {'error':>7}")
    for p in PLACEMENTS:
        print(f"{p:<10} {measured[p]:>10.2f} {predicted[p]:>11.2f} {error[p]:>+7.1%} {own[p]:>10.2f} "
              f"{error_own[p]:>+7.1%}")
    print(json.dumps({"config": a.config, "seed": a.seed, "sim_seeds": a.sim_seeds, "runs": str(out),
                      "measured_s": measured, "predicted_s": predicted, "error": error,
                      "predicted_own_s": own, "error_own": error_own, "launcher_s": launcher_s,
                      "order_measured": order_m, "order_predicted": order_p, "order_matches": order_m == order_p,
                      "within_20pct": all(abs(e) <= 0.2 for e in error.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
