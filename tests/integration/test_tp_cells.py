"""Cells that span ranks (2 cells x tensor parallelism 2, or x pipeline parallelism 2, on 4 gloo
ranks): the main job's streaming step equals the single-process HF step for several join schedules
and when a satellite dies, and the main job runs at TP 2 and at PP 2 end to end (role changes,
overlap, checkpoint, and at TP 2 resume)."""

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


def assert_equal_to_single_process(steps):
    for s in steps:
        assert s["normaliser"] == s["ref_normaliser"] > 0
        assert s["grad_diff"] < 1e-6 and s["grad_scale"] > 0.1  # summed gradients the core applies
        assert s["weight_diff"] < 1e-7 and s["weight_change"] > 5e-7  # the update moved the weights


@pytest.mark.parametrize("layout", [["--tp", "2", "--pp", "1"], ["--tp", "1", "--pp", "2"]], ids=["tp2", "pp2"])
def test_join_schedules_equal_the_single_process_step(tmp_path, tiny_model_dir, layout):
    # step 0: the satellite joins before any work item; step 1: after 2 are done; step 2: never
    out, _ = run_worker(tmp_path, *layout, "--join", "0", "2", "-1")
    assert_equal_to_single_process(out["steps"])
    core, follower, sat, sat_follower = out["reports"]
    assert [s["k"] for s in core["steps"]] == [1, 1, 0]
    for s, mine in zip(core["steps"], sat["steps"]):
        assert sorted(set(s["by"])) == ([0, 1] if s["k"] else [0])
        assert s["count"] + (mine["count"] or 0) == s["items"] == len(s["by"])  # every item exactly once
        assert [s["by"].count(c) for c in (0, 1)] == [s["count"], mine["count"] or 0]
    assert core["steps"][1]["by"][:2] == [0, 0]  # the first two were done before the satellite joined
    assert sat["steps"][2] == {"reply": "JoinSkipped", "count": None, "reason": "window closed"}
    assert [s["reply"] for s in sat_follower["steps"]] == [None, None, None]  # only the leader replies
    # the satellite's leader reads the core's last snapshot (each shard its own) and gathers it
    assert sat["published_version"] == 3 and out["published_diff"] < 1e-7
    # the engine's copy goes over in buckets: only the leader holds them, and they add up to the model
    assert sat["buckets"] >= 3 and sat_follower["buckets"] == 0 and sat["bucket_diff"] == 0.0
    # pushed to a colocated engine of TP 2: one shared-memory payload per engine rank, each the model
    assert sat["payloads_per_bucket"] == [2]
    assert sat["payload_diff_rank0"] == sat["payload_diff_rank1"] == 0.0


def test_at_pp2_the_tied_embedding_gradient_needs_the_stage_sum(tmp_path, tiny_model_dir):
    """Negative control: without summing the word-embedding gradient of the first stage and the
    output-layer gradient of the last, the step is not the single-process one."""
    out, _ = run_worker(tmp_path, "--tp", "1", "--pp", "2", "--join", "-1", "--skip-tied-reduction")
    assert out["steps"][0]["grad_diff"] > 1e-3


@pytest.mark.parametrize("layout", [["--tp", "2", "--pp", "1"], ["--tp", "1", "--pp", "2"]], ids=["tp2", "pp2"])
def test_a_satellite_killed_mid_batch_is_requeued_and_the_step_is_unchanged(tmp_path, tiny_model_dir, layout):
    out, stderr = run_worker(tmp_path, *layout, "--join", "0", "0", "--kill-step", "1")
    assert "cell 1 is dead" in stderr
    assert_equal_to_single_process(out["steps"])
    last = out["reports"][0]["steps"][-1]
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
