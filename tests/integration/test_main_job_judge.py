"""The main job on judge-scored tasks: `torchrun pretrain_gyre.py --tasks examples/tasks/judge`.

The policy itself judges, through the run's proxy, with each execution's key and role
``evaluator``: the judge's calls land in the execution's records as ``evaluator`` calls (never
trained), and its assessments in ``evaluations/assessments.jsonl``.  The embedded tiny model
answers with no score, so every assessment is unresolved: each execution is excluded (no reward,
never a zero), not scored 0.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error")


def run_job(run_dir: Path, *extra: str, timeout: float = 600):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "pretrain_gyre.py"), "--config", str(ROOT / "examples" / "cpu_tiny.yaml"),
            "--run-dir", str(run_dir), "--num-cells", "2", "--no-progress", *extra]
    r = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-5000:]
    return json.loads((run_dir / "summary.json").read_text()), r


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_judge_tasks_are_assessed_by_the_policy_through_the_proxy(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    summary, _ = run_job(run, "--tasks", "examples/tasks/judge", "--train-steps", "1")
    assert summary["steps"] == 1 and summary["executions"] >= 8

    closed = [e for e in jsonl(run / "executions.jsonl") if e["event"] == "closed"]
    assert len(closed) == summary["executions"]
    assert {e["task"] for e in closed} <= {"judge-release-notes", "judge-docstring"}

    # every execution's judge was called, twice (--eval-max-retries 1), as the policy
    assessments = jsonl(run / "evaluations" / "assessments.jsonl")
    by_execution: dict[str, list[dict]] = {}
    for a in assessments:
        by_execution.setdefault(a["execution_id"], []).append(a)
    assert set(by_execution) == {e["execution_id"] for e in closed}
    for sid, recs in by_execution.items():
        assert [(a["evaluator"], a["designated"], a["attempt"]) for a in recs] == [("judge", True, 1),
                                                                                   ("judge", True, 2)], sid
        for a in recs:
            assert a["details"]["model"] == "policy" and a["details"]["turns"] == 1
            assert a["assessed_ref"].startswith("sha256:")
            # the tiny model gives no score: unresolved, never a zero
            assert a["status"] == "unresolved" and a["score"] is None
            assert a["details"]["reason"] == "no score in the judge reply"

    # unresolved twice: excluded, no reward, nothing trained
    assert all(e["outcome"] == "excluded" and e["reward"] is None for e in closed)
    assert summary["executions_trained"] == 0 and summary["tokens_trained"] == 0

    # the judge's calls are recorded in the execution's records with role evaluator, after the harness's
    for e in closed:
        records = jsonl(run / "records" / f"{e['execution_id']}.jsonl")
        roles = [r["role"] for r in records]
        assert roles.count("evaluator") == 2 and roles[0] == "main", roles
        assert roles.index("evaluator") == len(roles) - 2  # the judge ran after the harness closed
        judge = [r for r in records if r["role"] == "evaluator"]
        assert all(r["metadata"]["headers"]["x-gyre-role"] == "evaluator" for r in judge)
