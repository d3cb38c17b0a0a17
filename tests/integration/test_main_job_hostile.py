"""The main job with hostile executions, sandboxed by default (bwrap): a fork bomb, a memory bomb and
a disk fill, each in its own execution, end that execution as crashed with the limit named, while
the other executions finish and the job trains its step."""

from __future__ import annotations

import json

import pytest

from gyre.sandbox.bwrap import bwrap_unavailable_reason
from gyre.sandbox.cgroups import cgroups_supported
from tests.integration.test_main_job import executions_log, run_job

pytestmark = pytest.mark.slow


def test_bombs_do_not_stop_the_run(tmp_path, tiny_model_dir):
    reason = bwrap_unavailable_reason()
    if reason or not cgroups_supported():
        pytest.skip(f"bwrap with cgroups unavailable here: {reason or 'no writable cgroups'}")
    run = tmp_path / "run"
    summary, r = run_job(run, "--harness", "tests.sandbox.hostile_harness:BombHarness", "--train-steps", "1",
                         "--num-cells", "2", "--execution-pids-limit", "64", "--execution-memory-limit", "256m",
                         "--execution-workspace-limit", "32m", "--execution-timeout-s", "60", nproc=2)
    assert summary["steps"] == 1
    closed = {e["execution_id"]: e for e in executions_log(run) if e["event"] == "closed"}
    bombs = {sid: e for sid, e in closed.items() if sid.startswith("a0-g0000-e0000") and sid[-1] in "012"}
    assert len(bombs) == 3, sorted(closed)
    errors = sorted(e["error"] for e in bombs.values())
    assert all(e["termination"] == "crashed" for e in bombs.values()), bombs
    assert any("process limit" in x for x in errors) and any("memory limit" in x for x in errors) \
        and any("workspace size limit" in x for x in errors), errors
    others = [e for sid, e in closed.items() if sid not in bombs]
    assert sum(e["termination"] == "completed" for e in others) >= 4, others
    assert not [e for e in others if e["termination"] == "crashed"], others
    meta = json.loads((run / "executions" / next(iter(bombs)) / "execution.json").read_text())
    assert meta["backend"] == "bwrap"
