#!/usr/bin/env python
"""Does the tiny model learn the toy task through the whole pipeline?

    python bench/toy_learning.py [--seeds 0 1 2] [--warmstart-steps 300] [--out runs/toy-bench]

Per seed: a supervised format warm-start on *other* digit lists answered with a random listed
digit (``tools/warmstart.py --builtin toy-largest --exclude-tasks
examples/tasks/toy/largest.tasks.jsonl``), then the main job
(``torchrun --nproc-per-node 3 pretrain_gyre.py --config examples/cpu_toy_learning.yaml``:
reference harness -> proxy -> trajectory tree -> executable evaluator -> GSPO objective ->
streaming cells).  Prints each seed's reward curve (mean training reward per step), the mean of
the last 3 steps minus the first 3, and the wall time; exits 1 if a seed rises by less than
``--min-rise`` (0.4) or takes longer than ``--max-minutes`` (15).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error")


def warm_start(out: Path, seed: int, steps: int) -> Path:
    """The supervised format warm-start of ``seed`` into ``out`` (a servable HF directory)."""
    subprocess.run([sys.executable, str(ROOT / "tools" / "warmstart.py"), "--out", str(out), "--builtin", "toy-largest",
                    "--exclude-tasks", str(ROOT / "examples" / "tasks" / "toy" / "largest.tasks.jsonl"),
                    "--steps", str(steps), "--batch-size", "8", "--lr", "1e-3", "--seed", str(seed)],
                   check=True, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def run_toy(model_dir: Path, seed: int, run: Path, *extra: str) -> subprocess.CompletedProcess:
    """The toy-learning main job from ``model_dir`` into ``run``."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(ROOT / "pretrain_gyre.py"), "--config", str(ROOT / "examples" / "cpu_toy_learning.yaml"),
                           "--model-dir", str(model_dir), "--seed", str(seed), "--run-dir", str(run), "--no-progress",
                           *extra], env=ENV, cwd=ROOT, capture_output=True, text=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--warmstart-steps", type=int, default=300)
    p.add_argument("--out", default=str(ROOT / "runs" / "toy-bench"))
    p.add_argument("--min-rise", type=float, default=0.4)
    p.add_argument("--max-minutes", type=float, default=15.0)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra pretrain_gyre.py flags")
    a = p.parse_args(argv)
    out = Path(a.out)
    ok = True
    for seed in a.seeds:
        t0 = time.monotonic()
        warm = warm_start(out / f"warm-{seed}", seed, a.warmstart_steps)
        t_warm = time.monotonic() - t0
        r = run_toy(warm, seed, out / f"seed-{seed}", *[x for x in a.extra if x != "--"])
        run = out / f"seed-{seed}"
        minutes = (time.monotonic() - t0) / 60
        if r.returncode != 0:
            print(f"seed {seed}: run failed (exit {r.returncode})\n{r.stderr[-3000:]}")
            ok = False
            continue
        summary = json.loads((run / "summary.json").read_text())
        curve = [summary["reward_mean_by_step"][k] for k in sorted(summary["reward_mean_by_step"], key=int)]
        rise = sum(curve[-3:]) / 3 - sum(curve[:3]) / 3
        passed = rise >= a.min_rise and minutes <= a.max_minutes
        ok &= passed
        print(json.dumps({"seed": seed, "curve": [round(x, 3) for x in curve], "rise": round(rise, 3),
                          "minutes": round(minutes, 2), "warmstart_s": round(t_warm, 1),
                          "rl_wall_s": summary["wall_s"], "pass": passed}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
