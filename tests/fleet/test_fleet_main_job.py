"""The main job (`torchrun pretrain_gyre.py`, the embedded CPU default) with every execution on a
three-node fleet, against the same job without one: the same records, assessment fields and
summary keys; every execution ran on a fleet node."""

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
    summary, _ = run_job(fleet, "--execution-fleet", cluster.address, "--train-steps", "3")
    assert summary["steps"] == 3 and summary["executions_trained"] == 24
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

    base, _ = run_job(local, "--train-steps", "3")
    assert sorted(summary) == sorted(base)
    assert len(records) == summary["executions"] and len(list((local / "records").glob("*.jsonl"))) == base["executions"]
    assert {frozenset(a) for a in assessments(fleet)} == {frozenset(a) for a in assessments(local)}
    assert {frozenset(e) for e in closed} == {frozenset(e) for e in executions_log(local) if e["event"] == "closed"}
