"""The simulator setup measured from a run directory (gyre.sim.from_run, tools/simulate.py --from-run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gyre.sim.from_run import predict_from_run, preset_from_run

ROOT = Path(__file__).resolve().parents[2]

ARGS = {"n_samples_per_prompt": 2, "global_batch_groups": 1, "extra_dispatch": 0.0, "steps_per_burst": 1,
        "num_cells": 2, "rollout_concurrency_per_cell": 2, "standalone_concurrency": 0, "placement": "elastic",
        "train_cells": 1, "train_steps": 2, "oversample_executions": 0}


def write_run(run: Path) -> Path:
    run.mkdir()
    (run / "args.json").write_text(json.dumps(ARGS))
    ex = []
    for eid, group, task, t0, t1, dur, status, calls in [
            ("e0", 0, "a", 0.0, 3.0, 2.0, "completed", 3), ("e1", 0, "a", 0.0, 5.0, 4.0, "completed", 5),
            ("e2", 1, "b", 5.5, 7.5, 1.0, "completed", 1), ("e3", 1, "b", 5.5, 9.5, 4.0, "timeout", 2)]:
        ex.append({"event": "launched", "execution_id": eid, "group": group, "task": task, "t": t0})
        ex.append({"event": "closed", "execution_id": eid, "group": group, "task": task, "status": status,
                   "duration_s": dur, "calls": calls, "t": t1})
    ex.append({"event": "closed", "execution_id": "e4", "group": 1, "task": "b", "status": "cancelled",
               "duration_s": 9.0, "calls": 1, "t": 9.0})
    (run / "executions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ex))
    events = [{"event": "role_change", "direction": "rollout->training", "latency_s": 1.0},
              {"event": "role_change", "direction": "rollout->training", "latency_s": 3.0},
              {"event": "role_change", "direction": "training->rollout", "latency_s": 0.5},
              {"event": "group_ready", "group": 0, "t": 5.25, "items": 3},
              {"event": "group_ready", "group": 1, "t": 9.75, "items": 1},
              {"event": "publish", "version": 1, "t": 8.45}, {"event": "publish", "version": 2, "t": 12.95}]
    rows = [{"step": 1, "consume_s": 1.0, "window": 1, "update_s": 0.1},  # no compute_s: 1.0 x 2 cells
            {"step": 2, "consume_s": 5.0, "window": 0, "update_s": 0.3, "compute_s": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "event", **e}) + "\n" for e in events)
                                       + "".join(json.dumps({"kind": "metrics", **r}) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"wall_s": 13.5}))
    return run


def test_the_setup_is_measured_from_the_run_files(tmp_path):
    p = preset_from_run(write_run(tmp_path / "run"))
    w = p.workload.fallback
    assert w.durations_s.tolist() == [3.0, 5.0, 2.0, 4.0]  # launch to close; the cancelled one left out
    assert w.timed_out.tolist() == [False, False, False, True] and w.model_calls.tolist() == [3, 5, 1, 2]
    assert [ix.tolist() for ix in w.query_index] == [[0, 1], [2, 3]]  # a group draws one task's executions
    # the run's own groups come back in dispatch order; a larger group draws its missing ones from itself
    replay, rng = p.workload.rewound(), np.random.default_rng(0)
    assert replay.sample_group(rng, 2).durations_s.tolist() == [3.0, 5.0]
    g = replay.sample_group(rng, 3)
    assert g.durations_s.tolist()[:2] == [2.0, 4.0] and g.durations_s[2] in (2.0, 4.0)
    assert g.timed_out.tolist()[:2] == [False, True] and g.model_calls.tolist()[:2] == [1, 2]
    assert replay.sample_group(rng, 2).durations_s.tolist()[0] in (3.0, 5.0, 2.0, 4.0)  # past the run: resampled
    assert p.workload.rewound().sample_group(rng, 2).durations_s.tolist() == [3.0, 5.0]
    s = p.sim
    assert (s.switch_to_train_s, s.switch_to_rollout_s) == (2.0, 0.5)
    assert s.train_step_cell_s == 2.0 and s.optimizer_s == pytest.approx(0.2)
    assert s.micro_steps_per_group == 2 and s.eval_s == pytest.approx(0.25)
    assert s.publish_s == pytest.approx(1.0) and s.pull_s == s.broadcast_s == s.publish_s
    c = p.scheduler
    assert (c.N, c.B, c.phi, c.mu, c.num_cells, c.rollout_concurrency_per_cell, c.max_steps) == (2, 1, 0.0, 1, 2, 2, 2)


def test_predictions_for_every_placement_and_the_cli(tmp_path):
    run = write_run(tmp_path / "run")
    out = predict_from_run(run)
    assert out["measured_s"] == 13.5 and out["placement"] == "elastic"
    assert set(out["predicted_s"]) == {"elastic", "async", "colocate"}
    # two steps of at least one execution (>= 2 s) and one training step each
    assert all(t > 2 * (2.0 + 2.0 / 2) for t in out["predicted_s"].values())
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "simulate.py"), "--from-run", str(run), "--json"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == out
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "simulate.py"), "--from-run", str(tmp_path / "x")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"simulate: error: {tmp_path / 'x'} is not a finished run directory: "
                                               f"args.json is missing"]
