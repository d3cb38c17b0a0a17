"""Cells that span ranks (2 cells x tensor parallelism 2, or x pipeline parallelism 2, on 4 gloo
ranks): the main job's streaming step equals the single-process HF step for several join schedules
and when a satellite dies (one worker run per layout holds both), and the main job runs at TP 2 and
at PP 2 end to end (role changes, overlap, checkpoint, and at TP 2 resume)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_main_job import ENV, run_job

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_worker(tmp_path, *args):
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not installed")
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(Path(__file__).with_name("tp_cells_worker.py")), *args, "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(ENV, OMP_NUM_THREADS="1"), timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text()), r.stderr


#: The summed gradients equal the single-process ones up to float32 summation order: a bound relative
#: to the largest gradient entry (``grad_scale``; ~34 float32 ulps of it; 1.6e-6 of it is seen at PP 2).
GRAD_RTOL = 4e-6


def assert_equal_to_single_process(steps):
    for s in steps:
        assert s["normaliser"] == s["ref_normaliser"] > 0
        assert s["grad_diff"] < GRAD_RTOL * s["grad_scale"] and s["grad_scale"] > 0.1  # summed gradients applied
        assert s["weight_diff"] < 1e-7 and s["weight_change"] > 5e-7  # the update moved the weights


LAYOUTS = {"tp2": ["--tp", "2", "--pp", "1"], "pp2": ["--tp", "1", "--pp", "2", "--tied-control"]}
# steps 0-2, the join schedules: the satellite joins before any work item; after 2 are done; never.
# Step 3: it joins at once and both its ranks exit in their first micro-step.
SCHEDULE = ["--join", "0", "2", "-1", "0", "--kill-step", "3"]


@pytest.fixture(scope="module")
def cells_run(request, tmp_path_factory, tiny_model_dir):
    """The worker's ``(out, stderr)`` for the layout ``request.param`` (of ``LAYOUTS``) and
    ``SCHEDULE``: one run per layout, shared by the tests of this module that ask for it."""
    layout = request.param
    return run_worker(tmp_path_factory.mktemp(layout), *LAYOUTS[layout], *SCHEDULE)


@pytest.mark.parametrize("cells_run", ["tp2", "pp2"], indirect=True)
def test_join_schedules_equal_the_single_process_step(cells_run):
    out, _ = cells_run
    assert_equal_to_single_process(out["steps"][:3])
    core, follower, sat, sat_follower = out["reports"]
    schedules = core["steps"][:3]
    assert [s["k"] for s in schedules] == [1, 1, 0]
    assert len(sat["steps"]) == 3  # the satellite's report was taken before the kill step
    for s, mine in zip(schedules, sat["steps"]):
        assert sorted(set(s["by"])) == ([0, 1] if s["k"] else [0])
        assert s["count"] + (mine["count"] or 0) == s["items"] == len(s["by"])  # every item exactly once
        assert [s["by"].count(c) for c in (0, 1)] == [s["count"], mine["count"] or 0]
    assert schedules[1]["by"][:2] == [0, 0]  # the first two were done before the satellite joined
    assert sat["steps"][2] == {"reply": "JoinSkipped", "count": None, "reason": "window closed"}
    assert [s["reply"] for s in sat_follower["steps"]] == [None, None, None]  # only the leader replies
    # after step 2 the satellite's leader reads the core's snapshot (each shard its own) and gathers it
    assert sat["published_version"] == 3 and out["published_diff"] < 1e-7
    # the engine's copy goes over in buckets: only the leader holds them, and they add up to the model
    assert sat["buckets"] >= 3 and sat_follower["buckets"] == 0 and sat["bucket_diff"] == 0.0
    # pushed to a colocated engine of TP 2: one shared-memory payload per engine rank, each the model
    assert sat["payloads_per_bucket"] == [2]
    assert sat["payload_diff_rank0"] == sat["payload_diff_rank1"] == 0.0


@pytest.mark.parametrize("cells_run", ["pp2"], indirect=True)
def test_at_pp2_the_tied_embedding_gradient_needs_the_stage_sum(cells_run):
    """Negative control: without summing the word-embedding gradient of the first stage and the
    output-layer gradient of the last, the core's gradient of step 0 is not the single-process one
    (in the pp2 run the core first accumulates step 0's work items that way and applies nothing)."""
    out, _ = cells_run
    assert out["untied_grad_diff"] > 1e-3
    assert out["steps"][0]["grad_diff"] < GRAD_RTOL * out["steps"][0]["grad_scale"]  # with the sum, it is


@pytest.mark.parametrize("cells_run", ["tp2", "pp2"], indirect=True)
def test_a_satellite_killed_mid_batch_is_requeued_and_the_step_is_unchanged(cells_run):
    out, stderr = cells_run
    assert "cell 1 is dead" in stderr
    assert len(out["steps"]) == 4
    assert_equal_to_single_process(out["steps"][3:])
    last = out["reports"][0]["steps"][3]
    assert last["excluded_from"] == 1 and last["k"] == 0 and last["requeued"] >= 1
    assert last["by"] == [0] * last["items"] and last["count"] == last["items"]  # the core redid its work


def test_main_job_at_tensor_parallel_2(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    summary, r = run_job(run, "--num-cells", "2", "--tensor-model-parallel-size", "2", "--train-steps", "2", nproc=4,
                         timeout=900)
    assert summary["steps"] == 2 and summary["executions_trained"] == 16
    assert summary["role_changes"] >= 2 and summary["switch_latency_s"]["training_to_rollout"]
    assert summary["train_rollout_overlap_s"] > 0 and summary["tokens_trained"] > 0
    ck = run / "checkpoints" / "iter_0000002"
    assert (ck / "optimizer.pt").exists() and (ck / "optimizer_shard1.pt").exists()
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    start = next(e for e in events if e.get("event") == "run_start")
    assert sorted(start["engines"]) == ["engine-0", "engine-1"]  # one engine per cell, on its leader
    resumed, _ = run_job(run, "--num-cells", "2", "--tensor-model-parallel-size", "2", "--load", str(run),
                         "--train-steps", "3", nproc=4, timeout=900)
    assert resumed["steps"] == 3 and resumed["attempts"] == 2


def test_main_job_at_pipeline_parallel_2(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    summary, _ = run_job(run, "--num-cells", "2", "--pipeline-model-parallel-size", "2", "--train-steps", "2", nproc=4,
                         timeout=900)
    assert summary["steps"] == 2 and summary["executions_trained"] == 16
    assert summary["role_changes"] >= 2 and summary["train_rollout_overlap_s"] > 0
    ck = run / "checkpoints" / "iter_0000002"
    assert (ck / "optimizer.pt").exists() and (ck / "optimizer_shard1.pt").exists()
