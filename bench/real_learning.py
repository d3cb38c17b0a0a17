#!/usr/bin/env python
"""Does SmolLM2-135M-Instruct learn small sums through the main job?  Held-out pass rate before and after.

    python bench/real_learning.py --seeds 0 [--minutes 65 | --steps N] [--temperature 0.7] [--out runs/real-learning]
    python bench/real_learning.py --seeds 0 --resume          # continue each seed's run from its last checkpoint
    python bench/real_learning.py --seeds 0 --eval-only       # only the "before" evaluation
    python bench/real_learning.py --seeds 0 --smoke --steps 2 # a quick end-to-end check (8 held-out tasks)

Per seed, in ``OUT/seed-S/``:

1. the seed's splits of :mod:`gyre.tasks.arithmetic` (``tasks/train.tasks.jsonl``,
   ``tasks/heldout.tasks.jsonl``; disjoint, commuted problems on one side);
2. **before**: the held-out split through the harness, proxy and embedded engine
   (``bench/heldout_eval.py``), greedy (one attempt per task) and sampled at ``--temperature``
   (``--sampled-attempts`` per task); ``eval_before.json``;
3. **train**: ``torchrun --nproc-per-node 2 pretrain_gyre.py --config
   examples/cpu_smollm2_learning.yaml`` (two cells, elastic placement, the embedded engine) on the
   train split at ``--temperature``, into ``job/``, for ``--steps`` optimizer steps, or else until
   ``--minutes`` of training wall time have passed (then the job is stopped with SIGTERM and the
   last checkpoint counts; the config saves every 2 steps).  ``--resume`` adds ``--load job/``;
4. **after**: the same evaluation of the last checkpoint's ``hf/``; ``eval_after.json``;
5. ``result.json`` (pass rates with Wilson 95 % intervals, their differences with Newcombe's 95 %
   interval) and ``learning.png`` (the training reward per step and the held-out pass rates).

Prints one JSON line per seed; exits 1 unless every seed's sampled held-out pass rate rose by at least
``--min-rise`` (0.10) with the difference's interval above 0 and within ``--max-minutes`` (90).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cpu_smollm2_learning.yaml"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error")
Z95 = 1.959963984540054
#: Main-job flags of ``--smoke``: small steps, a checkpoint after each.
SMOKE_JOB_FLAGS = ("--global-batch-groups", "2", "--n-samples-per-prompt", "4", "--save-interval", "1")


# --------------------------------------------------------------------------- statistics (pure)


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``passed / n``.

    Raises:
        ValueError: ``n < 1`` or ``passed`` outside 0..n.
    """
    if n < 1 or not 0 <= passed <= n:
        raise ValueError(f"need 0 <= passed <= n and n >= 1, got {passed}/{n}")
    p = passed / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_difference(after: tuple[int, int], before: tuple[int, int], z: float = Z95) -> dict[str, float]:
    """``after - before`` of two proportions given as ``(passed, n)``, with Newcombe's hybrid score
    interval (from the two Wilson intervals; treats the samples as independent)."""
    p1, p0 = after[0] / after[1], before[0] / before[1]
    l1, u1 = wilson(*after, z=z)
    l0, u0 = wilson(*before, z=z)
    d = p1 - p0
    return {"diff": d, "low": d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2),
            "high": d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2)}


def summarise(before: dict[str, dict], after: dict[str, dict] | None) -> dict[str, Any]:
    """Pass rates with intervals per mode (``greedy``, ``sampled``) and, with ``after``, the differences."""
    out: dict[str, Any] = {}
    for mode, b in before.items():
        row: dict[str, Any] = {"before": _rate(b)}
        if after is not None and mode in after:
            row["after"] = _rate(after[mode])
            row["difference"] = {k: round(v, 4) for k, v in
                                 newcombe_difference((after[mode]["passed"], after[mode]["n"]),
                                                     (b["passed"], b["n"])).items()}
        out[mode] = row
    return out


def _rate(r: dict) -> dict[str, Any]:
    lo, hi = wilson(r["passed"], r["n"])
    return {"passed": r["passed"], "n": r["n"], "rate": round(r["passed"] / r["n"], 4),
            "ci95": [round(lo, 4), round(hi, 4)]}


def verdict(summary: dict[str, Any], minutes: float, *, min_rise: float, max_minutes: float) -> bool:
    """True when the sampled pass rate rose by ``min_rise`` or more, the difference's interval lies
    above 0, and the seed took at most ``max_minutes``."""
    d = summary.get("sampled", {}).get("difference")
    return d is not None and d["diff"] >= min_rise and d["low"] > 0 and minutes <= max_minutes


# --------------------------------------------------------------------------- plot


def reward_curve(job: Path) -> tuple[list[int], list[float]]:
    """``(steps, reward_mean)`` from the main job's ``metrics.jsonl`` (``kind: metrics`` rows)."""
    steps, rewards = [], []
    path = job / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "metrics" and row.get("reward_mean") is not None:
                steps.append(int(row["step"]))
                rewards.append(float(row["reward_mean"]))
    return steps, rewards


def plot(path: Path, steps: list[int], rewards: list[float], summary: dict[str, Any]) -> Path:
    """Write ``path`` (PNG): the training reward per step (left) and the held-out pass rates before
    and after with their 95 % intervals (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_p) = plt.subplots(1, 2, figsize=(10, 4))
    ax_r.plot(steps, rewards, marker="o", color="tab:blue")
    ax_r.set(title="training reward", xlabel="optimizer step", ylabel="mean reward", ylim=(-0.02, 1.02))
    labels, xs = [], 0
    for mode, colour in (("greedy", "tab:green"), ("sampled", "tab:orange")):
        for when in ("before", "after"):
            r = summary.get(mode, {}).get(when)
            if r is None:
                continue
            lo, hi = r["ci95"]
            ax_p.errorbar([xs], [r["rate"]], yerr=[[r["rate"] - lo], [hi - r["rate"]]], fmt="o", color=colour,
                          capsize=4)
            labels.append(f"{mode}\n{when} (n={r['n']})")
            xs += 1
    ax_p.set_xticks(range(len(labels)), labels, fontsize=8)
    ax_p.set(title="held-out pass@1 (95 % Wilson)", ylabel="pass rate", ylim=(-0.02, 1.02))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- the run (shell)


def evaluate_both(model_dir: str, heldout: Path, out: Path, a: argparse.Namespace) -> dict[str, dict]:
    """Greedy and sampled evaluations of ``model_dir`` on ``heldout`` (``bench/heldout_eval.py``) into
    ``out/greedy`` and ``out/sampled`` (an earlier evaluation's files there are removed first)."""
    from bench.heldout_eval import evaluate

    res = {}
    for mode, temperature, attempts in (("greedy", 0.0, 1), ("sampled", a.temperature, a.sampled_attempts)):
        shutil.rmtree(out / mode, ignore_errors=True)
        r = evaluate(model_dir, str(heldout), temperature=temperature, attempts=attempts, out=out / mode,
                     job_flags=["--config", str(CONFIG)], concurrency=a.eval_concurrency, seed=a.eval_seed)
        res[mode] = {k: r[k] for k in ("passed", "n", "pass_rate", "not_assessed", "temperature", "wall_s")}
    return res


def train(seed: int, model_dir: str, train_tasks: Path, job: Path, a: argparse.Namespace) -> int | str:
    """Run the main job; returns its exit status, or ``"deadline"`` when it was stopped with SIGTERM
    at the ``--minutes`` deadline (its last checkpoint is the result)."""
    steps = a.steps if a.steps is not None else 10_000
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
           str(ROOT / "pretrain_gyre.py"), "--config", str(CONFIG), "--model-dir", model_dir, "--seed", str(seed),
           "--run-dir", str(job), "--tasks", str(train_tasks), "--rollout-temperature", str(a.temperature),
           "--train-steps", str(steps), "--num-cells", str(a.nproc), "--no-progress", *a.extra]
    if a.resume:
        cmd += ["--load", str(job)]
    job.mkdir(parents=True, exist_ok=True)
    with open(job.parent / "job.log", "a") as log:
        proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=None if a.steps is not None else a.minutes * 60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return "deadline"
    return rc


def last_checkpoint(job: Path) -> Path | None:
    """The ``hf/`` directory of the newest complete checkpoint of ``job``, or ``None``."""
    from gyre.runtime.checkpointing import find_checkpoint

    ckpt = find_checkpoint(job) if (job / "checkpoints").exists() else None
    return ckpt / "hf" if ckpt is not None else None


def run_seed(seed: int, model_dir: str, a: argparse.Namespace) -> dict[str, Any]:
    from gyre.tasks.arithmetic import write_tasks

    root = Path(a.out) / f"seed-{seed}"
    t0 = time.monotonic()
    train_tasks = write_tasks(root / "tasks" / "train.tasks.jsonl", "train", seed, a.heldout_size)
    heldout = write_tasks(root / "tasks" / "heldout.tasks.jsonl", "heldout", seed, a.heldout_size)
    before_path = root / "eval_before.json"
    if before_path.exists():  # a resumed or repeated run evaluates the starting model once
        before = json.loads(before_path.read_text())
    else:
        before = evaluate_both(model_dir, heldout, root / "eval_before", a)
        before_path.write_text(json.dumps(before, indent=1))
    result: dict[str, Any] = {"seed": seed, "before": summarise(before, None)}
    if a.eval_only:
        return result
    job = root / "job"
    t_train = time.monotonic()
    rc = train(seed, model_dir, train_tasks, job, a)
    train_minutes = (time.monotonic() - t_train) / 60
    ckpt = last_checkpoint(job)
    if ckpt is None:
        return {**result, "error": f"main job ended ({rc}) without a checkpoint (see {root / 'job.log'})"}
    after = evaluate_both(str(ckpt), heldout, root / "eval_after", a)
    (root / "eval_after.json").write_text(json.dumps({**after, "checkpoint": str(ckpt)}, indent=1))
    summary = summarise(before, after)
    steps, rewards = reward_curve(job)
    plot(root / "learning.png", steps, rewards, summary)
    minutes = (time.monotonic() - t0) / 60
    result = {"seed": seed, "job_exit": rc, "checkpoint": str(ckpt.parent.name), "steps": len(steps),
              "train_minutes": round(train_minutes, 1), "minutes": round(minutes, 1),
              "reward_curve": [round(r, 3) for r in rewards], **summary,
              "pass": verdict(summary, minutes, min_rise=a.min_rise, max_minutes=a.max_minutes)}
    (root / "result.json").write_text(json.dumps(result, indent=1))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--minutes", type=float, default=65.0, help="Training wall time when --steps is not given.")
    p.add_argument("--steps", type=int, default=None, help="The run's total optimizer steps, counted from its start "
                   "with --resume too (instead of --minutes).")
    p.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature of training and of the "
                   "sampled evaluation.")
    p.add_argument("--sampled-attempts", type=int, default=4, help="Sampled attempts per held-out task.")
    p.add_argument("--heldout-size", type=int, default=64)
    p.add_argument("--eval-concurrency", type=int, default=4)
    p.add_argument("--eval-seed", type=int, default=0, help="The evaluation engine's sampling seed.")
    p.add_argument("--nproc", type=int, default=2, help="Ranks (= cells) of the main job.")
    p.add_argument("--model-dir", default=None, help="Starting model (default: tools/setup_real_model.sh's).")
    p.add_argument("--out", default=str(ROOT / "runs" / "real-learning"))
    p.add_argument("--resume", action="store_true", help="Continue each seed's job from its last checkpoint.")
    p.add_argument("--eval-only", action="store_true", help="Only the evaluation of the starting model.")
    p.add_argument("--smoke", action="store_true", help="A quick end-to-end check, not a measurement: "
                   f"--heldout-size 8, --sampled-attempts 1 and main-job flags {' '.join(SMOKE_JOB_FLAGS)}.")
    p.add_argument("--min-rise", type=float, default=0.10)
    p.add_argument("--max-minutes", type=float, default=90.0)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra pretrain_gyre.py flags")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    a.extra = [x for x in a.extra if x != "--"]
    if a.smoke:
        a.heldout_size, a.sampled_attempts, a.extra = 8, 1, [*SMOKE_JOB_FLAGS, *a.extra]
    if a.steps is not None and a.steps < 1:
        p.error("--steps must be >= 1")
    if a.minutes <= 0 or a.sampled_attempts < 1 or a.heldout_size < 1:
        p.error("--minutes, --sampled-attempts and --heldout-size must be positive")
    if not 0 < a.temperature <= 2:
        p.error("--temperature must be in (0, 2]")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    model_dir = a.model_dir or subprocess.run(["bash", str(ROOT / "tools" / "setup_real_model.sh")], check=True,
                                              capture_output=True, text=True, env=dict(ENV, GYRE_PYTHON=sys.executable),
                                              ).stdout.strip().splitlines()[-1]
    ok = True
    for seed in a.seeds:
        result = run_seed(seed, model_dir, a)
        print(json.dumps(result), flush=True)
        ok &= bool(result.get("pass", a.eval_only))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
