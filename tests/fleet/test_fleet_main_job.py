"""The main job (`torchrun pretrain_gyre.py`, the embedded CPU default) with every execution on a
three-node fleet, SIGKILLed after its first checkpoint and resumed, against one step of the same job
without a fleet: nothing that finished on a node runs again, every execution ran on a fleet node,
and the run has the same record files per execution, assessment fields, closed-event fields and
summary keys as the local one."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_main_job import executions_log, kill_after_first_checkpoint, run_job

ray = pytest.importorskip("ray", reason="ray is not installed")
pytestmark = pytest.mark.slow


def assessments(run) -> list[dict]:
    return [json.loads(line) for line in (run / "evaluations" / "assessments.jsonl").read_text().splitlines()]


def test_a_fleet_run_killed_and_resumed_runs_every_execution_on_the_fleet(cluster, tmp_path, tiny_model_dir):
    """SIGKILL of a rank after the first checkpoint, then ``--load``: every execution that finished
    on a node before the kill and was not trained yet is carried over, not launched again; the
    executions of both attempts ran on the fleet, their workspaces on the nodes."""
    run = tmp_path / "run"
    fleet = ("--execution-fleet", cluster.address, "--num-cells", "2")
    _, tracker = kill_after_first_checkpoint(run, "--train-steps", "2", "--save-interval", "1", *fleet, nproc=2)
    before = executions_log(run)
    ck = json.loads((run / "checkpoints" / f"iter_{int(tracker.read_text()):07d}" / "controller.json").read_text())
    finished = {e["execution_id"] for e in before if e["event"] == "closed"
                and e["status"] in ("completed", "timeout") and e["outcome"] != "excluded"}

    summary, _ = run_job(run, "--train-steps", "2", "--save-interval", "1", "--load", str(run), *fleet, nproc=2)
    assert summary["steps"] == 2 and summary["first_step"] == ck["iteration"] and summary["executions_trained"] == 16
    after = executions_log(run)[len(before):]
    carried = {e["execution_id"] for e in after if e["event"] == "carried_over"}
    relaunched = {e["execution_id"] for e in after if e["event"] == "launched"}
    assert carried == finished - set(ck["trained"])
    assert not relaunched & finished                       # nothing that finished on a node ran again

    # every execution that completed, in either attempt, ran on a fleet node
    closed = [e for e in executions_log(run) if e["event"] == "closed" and e["status"] == "completed"]
    trained = {e["execution_id"] for e in executions_log(run) if e["event"] == "trained"}
    assert trained <= {e["execution_id"] for e in closed} and len(trained) == 16
    nodes = set()
    for e in closed:
        assert e["termination"] == "completed", e
        root = run / "executions" / e["execution_id"]
        meta = json.loads((root / "execution.json").read_text())
        nodes.add(meta["fleet"]["node_id"])
        assert meta["result"]["workspace"]["ref"].startswith("sha256:")
        assert (root / "harness.log").stat().st_size > 0
        assert not (root / "workspace").exists()           # it lived on the node
        assert (run / "records" / f"{e['execution_id']}.jsonl").exists()
    assert len(nodes) >= 2
    assert {e["execution_id"] for e in closed} <= {a["execution_id"] for a in assessments(run)}

    # the same files and fields as the job without a fleet (the key sets do not depend on the steps)
    local = tmp_path / "local"
    base, _ = run_job(local, "--num-cells", "1", "--train-steps", "1", nproc=1)
    assert base["steps"] == 1 and sorted(summary) == sorted(base)
    assert len(list((local / "records").glob("*.jsonl"))) == base["executions"]
    assert {frozenset(a) for a in assessments(run)} == {frozenset(a) for a in assessments(local)}
    assert {frozenset(e) for e in closed} == {frozenset(e) for e in executions_log(local)
                                              if e["event"] == "closed" and e["status"] == "completed"}
