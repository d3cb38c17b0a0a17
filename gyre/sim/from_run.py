"""A simulator setup measured from a finished main-job run directory.

:func:`preset_from_run` reads ``args.json`` (the cell layout and the dispatch shape),
``executions.jsonl`` (each closed execution's duration, model calls, timeout, task) and
``metrics.jsonl`` (role-switch latencies, per-step micro-step and update times, when groups
became ready and weights were published) and returns a :class:`~gyre.sim.presets.Preset`:

* workload: the run's executions, each from its launch to its close (harness start-up and
  evaluation included), replayed group by group in dispatch order (:class:`ReplayWorkload`;
  groups past the run's own resample one task's executions, a
  :class:`~gyre.sim.workload.TraceWorkload`);
* ``switch_to_train_s`` / ``switch_to_rollout_s``: median measured switch latencies;
* ``train_step_cell_s``: median over steps of the time the participants spent inside micro-steps
  (``compute_s``: the step's work on one cell), ``optimizer_s`` the median update time;
* ``micro_steps_per_group``: mean work items per ready group; ``eval_s``: median time from a
  group's last closed execution to its ``group_ready`` event;
* ``publish_s``: median time from a step's last ``group_ready`` to its publication, less the
  step's own training time (never below 0); ``pull_s`` / ``broadcast_s`` take the same value.

:func:`predict_from_run` simulates elastic, async and colocate on that preset with the run's
own ``(phi, mu)`` and steps.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from gyre.scheduler import SchedulerConfig

from .cluster import ClusterSim, SimConfig
from .presets import Preset
from .workload import GroupSample, TraceWorkload


@dataclass
class ReplayWorkload:
    """The run's own groups in dispatch order: the ``k``-th group drawn gets the executions of the
    run's ``k``-th group (``groups``); missing executions of a group are drawn from its own, and
    groups past the recorded ones from ``fallback``.  Stateful: :meth:`rewound` starts over."""

    name: str
    groups: list[GroupSample]
    fallback: TraceWorkload
    drawn: int = 0

    def sample_group(self, rng: np.random.Generator, n: int) -> GroupSample:
        if self.drawn >= len(self.groups):
            return self.fallback.sample_group(rng, n)
        g = self.groups[self.drawn]
        self.drawn += 1
        m = len(g.durations_s)
        pick = np.concatenate([np.arange(min(n, m)), rng.integers(m, size=max(0, n - m))]).astype(int)
        return GroupSample(g.durations_s[pick], g.timed_out[pick], g.model_calls[pick])

    def rewound(self) -> "ReplayWorkload":
        return ReplayWorkload(self.name, self.groups, self.fallback)


def _median(xs: list[float], default: float = 0.0) -> float:
    return float(statistics.median(xs)) if xs else default


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def preset_from_run(run_dir: str | Path) -> Preset:
    """The :class:`Preset` measured from ``run_dir`` (module docstring).

    Raises:
        ValueError: a missing file, or a run without closed executions or finished steps.
    """
    run = Path(run_dir)
    for name in ("args.json", "executions.jsonl", "metrics.jsonl"):
        if not (run / name).is_file():
            raise ValueError(f"{run} is not a finished run directory: {name} is missing")
    args = json.loads((run / "args.json").read_text())
    log = _events(run / "executions.jsonl")
    launched_at = {e["execution_id"]: e["t"] for e in log if e["event"] == "launched" and "t" in e}
    closed = [e for e in log
              if e["event"] == "closed" and e.get("status") in ("completed", "timeout") and e.get("duration_s")]
    for e in closed:  # launch to close (harness start and evaluation included); else the harness's own time
        if e["execution_id"] in launched_at and e.get("t") is not None:
            e["duration_s"] = max(float(e["duration_s"]), e["t"] - launched_at[e["execution_id"]])
    if not closed:
        raise ValueError(f"{run}: no closed executions in executions.jsonl")
    tasks = sorted({e["task"] for e in closed})
    trace = TraceWorkload(
        name=f"run {run}", durations_s=np.array([float(e["duration_s"]) for e in closed]),
        timed_out=np.array([e["status"] == "timeout" for e in closed]),
        model_calls=np.array([max(1, int(e.get("calls") or 1)) for e in closed]),
        query_index=tuple(np.array([i for i, e in enumerate(closed) if e["task"] == t]) for t in tasks))
    by_group: dict[tuple[int, int], list[int]] = {}
    for i, e in enumerate(closed):
        by_group.setdefault((int(e.get("attempt") or 0), int(e["group"])), []).append(i)
    groups = (np.array(v) for _, v in sorted(by_group.items()))
    samples = [GroupSample(trace.durations_s[ix], trace.timed_out[ix], trace.model_calls[ix]) for ix in groups]
    workload = ReplayWorkload(trace.name, samples, trace)
    metrics = _events(run / "metrics.jsonl")
    rows = [m for m in metrics if m.get("kind") == "metrics"]
    events = [m for m in metrics if m.get("kind") == "event"]
    if not rows:
        raise ValueError(f"{run}: no finished steps in metrics.jsonl")
    switch = {d: [e["latency_s"] for e in events if e["event"] == "role_change" and e.get("direction") == d
                  and e.get("latency_s") is not None] for d in ("rollout->training", "training->rollout")}
    # the step's micro-step work on one cell: the participants' time inside micro-steps (runs
    # without it: the core's consume time, waiting included, times the k + 1 participants)
    train = [float(r["compute_s"]) if r.get("compute_s") is not None
             else float(r["consume_s"]) * (int(r.get("window") or 0) + 1) for r in rows if r.get("consume_s")]
    update = [float(r["update_s"]) for r in rows if r.get("update_s") is not None]
    ready = [e for e in events if e["event"] == "group_ready"]
    last_close: dict[int, float] = {}
    for e in closed:
        last_close[int(e["group"])] = max(last_close.get(int(e["group"]), 0.0), float(e.get("t") or 0.0))
    evals = [max(0.0, e["t"] - last_close[e["group"]]) for e in ready if e["group"] in last_close]
    publish = _publish_gaps(ready, [e for e in events if e["event"] == "publish"], _median(train) + _median(update),
                            groups_per_step=int(args["global_batch_groups"]))
    scheduler = SchedulerConfig(
        N=int(args["n_samples_per_prompt"]), B=int(args["global_batch_groups"]), phi=float(args["extra_dispatch"]),
        mu=int(args["steps_per_burst"]), num_cells=int(args["num_cells"]),
        rollout_concurrency_per_cell=int(args["rollout_concurrency_per_cell"]),
        standalone_concurrency=int(args.get("standalone_concurrency") or 0), placement=str(args["placement"]),
        train_cells=int(args.get("train_cells") or 1), max_steps=int(args["train_steps"]),
        oversample=int(args.get("oversample_executions") or 0))
    sim = SimConfig(switch_to_train_s=_median(switch["rollout->training"]),
                    switch_to_rollout_s=_median(switch["training->rollout"]),
                    micro_steps_per_group=max(1, round(statistics.fmean([e["items"] for e in ready]))) if ready else 1,
                    train_step_cell_s=_median(train), optimizer_s=_median(update), eval_s=_median(evals),
                    publish_s=publish, pull_s=publish, broadcast_s=publish)
    return Preset(name=f"from-run:{run.name}", workload=workload, scheduler=scheduler, sim=sim,
                  description=f"measured from {run} ({len(closed)} executions, {len(rows)} steps)")


def _publish_gaps(ready: list[dict], publishes: list[dict], step_s: float, groups_per_step: int) -> float:
    """Median time from a step's last ready group to its publication, less ``step_s``."""
    ready_t = sorted(e["t"] for e in ready)
    gaps = []
    for p in publishes:
        k = int(p["version"]) * groups_per_step
        if 0 < k <= len(ready_t) and p.get("t") is not None:
            gaps.append(max(0.0, p["t"] - ready_t[k - 1] - step_s))
    return _median(gaps)


def predict_from_run(run_dir: str | Path, placements=("elastic", "async", "colocate"), seed: int = 0) -> dict:
    """Predicted wall time (seconds) of each placement on the run's measured setup, with the run's
    own ``(phi, mu)`` and step count: ``{"run": ..., "measured_s": wall_s of the run, "setup":
    {...}, "predicted_s": {placement: seconds}}``."""
    preset = preset_from_run(run_dir)
    out: dict = {}
    for p in placements:
        cfg = replace(preset.scheduler, placement=p)
        out[p] = round(ClusterSim(cfg, preset.sim, preset.workload.rewound(), seed=seed).run().end_time_s, 3)
    summary = Path(run_dir) / "summary.json"
    measured = json.loads(summary.read_text()).get("wall_s") if summary.is_file() else None
    s = preset.sim
    setup = {"executions": len(preset.workload.fallback.durations_s), "median_duration_s": round(float(np.median(
        preset.workload.fallback.durations_s)), 3), "switch_to_train_s": round(s.switch_to_train_s, 3),
        "switch_to_rollout_s": round(s.switch_to_rollout_s, 3), "train_step_cell_s": round(s.train_step_cell_s, 3),
        "optimizer_s": round(s.optimizer_s, 3), "publish_s": round(s.publish_s, 3), "eval_s": round(s.eval_s, 3),
        "micro_steps_per_group": s.micro_steps_per_group}
    return {"run": str(run_dir), "placement": preset.scheduler.placement, "measured_s": measured,
            "setup": setup, "predicted_s": out}
