"""The main job (`torchrun pretrain_gyre.py`, the embedded CPU default) with every execution on a
three-node fleet, against one step of the same job without one: the same record files per
execution, assessment fields, closed-event fields and summary keys; every execution ran on a
fleet node."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_main_job import executions_log, run_job

ray = pytest.importorskip("ray", reason="ray is not installed")
pytestmark = pytest.mark.slow


def assessments(run) -> list[dict]:
    return [json.loads(line) for line in (run / "evaluations" / "assessments.jsonl").read_text().splitlines()]


def test_main_job_trains_with_every_execution_on_the_fleet(cluster, tmp_path, tiny_model_dir):
    fleet, local = tmp_path / "fleet", tmp_path / "local"
    summary, _ = run_job(fleet, "--execution-fleet", cluster.address, "--train-steps", "2")
    assert summary["steps"] == 2 and summary["executions_trained"] == 16
    closed = [e for e in executions_log(fleet) if e["event"] == "closed"]
    assert closed and all(e["termination"] == "completed" for e in closed), closed
    nodes = set()
    for e in closed:
        meta = json.loads((fleet / "executions" / e["execution_id"] / "execution.json").read_text())
        nodes.add(meta["fleet"]["node_id"])
        assert meta["result"]["workspace"]["ref"].startswith("sha256:")
        assert (fleet / "executions" / e["execution_id"] / "harness.log").stat().st_size > 0
        assert not (fleet / "executions" / e["execution_id"] / "workspace").exists()  # it lived on the node
    assert len(nodes) >= 2
    records = sorted((fleet / "records").glob("*.jsonl"))
    assert len(records) == summary["executions"] == len({a["execution_id"] for a in assessments(fleet)})

    base, _ = run_job(local, "--train-steps", "1")  # the key sets do not depend on the number of steps
    assert base["steps"] == 1 and sorted(summary) == sorted(base)
    assert len(records) == summary["executions"] and len(list((local / "records").glob("*.jsonl"))) == base["executions"]
    assert {frozenset(a) for a in assessments(fleet)} == {frozenset(a) for a in assessments(local)}
    assert {frozenset(e) for e in closed} == {frozenset(e) for e in executions_log(local) if e["event"] == "closed"}


def test_a_fleet_run_killed_and_resumed_reruns_no_finished_execution(cluster, tmp_path, tiny_model_dir):
    """SIGKILL of a rank after the first checkpoint, then ``--load``: every execution that finished
    on a node before the kill and was not trained yet is carried over, not launched again; the
    resumed run's executions run on the fleet too."""
    from tests.integration.test_main_job import kill_after_first_checkpoint

    run = tmp_path / "run"
    fleet = ("--execution-fleet", cluster.address)
    _, tracker = kill_after_first_checkpoint(run, "--train-steps", "2", "--save-interval", "1", *fleet)
    before = executions_log(run)
    ck = json.loads((run / "checkpoints" / f"iter_{int(tracker.read_text()):07d}" / "controller.json").read_text())
    finished = {e["execution_id"] for e in before if e["event"] == "closed"
                and e["status"] in ("completed", "timeout") and e["outcome"] != "excluded"}

    summary, _ = run_job(run, "--train-steps", "2", "--save-interval", "1", "--load", str(run), *fleet)
    assert summary["steps"] == 2 and summary["first_step"] == ck["iteration"]
    after = executions_log(run)[len(before):]
    carried = {e["execution_id"] for e in after if e["event"] == "carried_over"}
    relaunched = {e["execution_id"] for e in after if e["event"] == "launched"}
    assert carried == finished - set(ck["trained"])
    assert not relaunched & finished                       # nothing that finished on a node ran again
    for e in after:
        if e["event"] == "closed" and e["status"] == "completed":
            meta = json.loads((run / "executions" / e["execution_id"] / "execution.json").read_text())
            assert meta["fleet"]["node_id"]                # the resumed run's executions ran on the fleet
