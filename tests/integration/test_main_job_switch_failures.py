"""Failed role switches in the main job: reported and retried, not the end of the run.

The fault is injected from outside the product: a ``sitecustomize`` module on ``PYTHONPATH``
makes ``EngineClient.release_memory_occupation`` raise on one rank a given number of times
(as an engine that still runs requests answers), so a cell's switch into training fails and
rolls back.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from gyre.metrics import read_metrics
from tests.integration.test_main_job import ENV, ROOT, torchrun

pytestmark = pytest.mark.slow

SITECUSTOMIZE = textwrap.dedent("""
    import os
    if os.environ.get("LOCAL_RANK") == os.environ.get("FAULT_RANK"):
        from gyre.rollout.client import engine_client

        _release = engine_client.EngineClient.release_memory_occupation
        _left = [int(os.environ["FAULT_RELEASES"])]

        def release_memory_occupation(self, tags=None):
            if _left[0] != 0:
                _left[0] -= 1
                raise RuntimeError("injected: 1 requests are running")
            return _release(self, tags)

        engine_client.EngineClient.release_memory_occupation = release_memory_occupation
""")


def run_with_faults(tmp_path, rank: int, releases: int, timeout: float = 600):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(ENV, FAULT_RANK=str(rank), FAULT_RELEASES=str(releases),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT), ENV.get("PYTHONPATH", "")]))
    # two cells (cell 1 a satellite), two steps: the retried switch has a step to train in
    return subprocess.run(torchrun(tmp_path / "run", "--num-cells", "2", "--train-steps", "2", nproc=2),
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def test_a_cell_whose_switch_fails_is_retried_and_the_run_completes(tmp_path):
    # cell 1's first switch into training fails (3 release attempts), the retried one succeeds
    r = run_with_faults(tmp_path, rank=1, releases=4)
    assert r.returncode == 0, r.stderr[-5000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["executions_trained"] == 16
    assert summary["switch_failures"] == 1
    _, events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    (failed,) = [e for e in events if e["event"] == "switch_failed"]
    assert (failed["cell"], failed["to"]) == (1, "training")
    assert failed["detail"] == ("cell 1 could not release its engine's memory (3 attempts): RuntimeError: injected: "
                                "1 requests are running")
    changes = [e for e in events if e["event"] == "role_change" and e["cell"] == 1]
    assert any(e["direction"] == "rollout->training" for e in changes)  # the retry got it into training
    assert "cell 1 could not switch to training and keeps its role" in r.stderr
    assert "failed switches 1" in r.stderr


def test_a_core_that_never_switches_ends_the_run_with_the_reason(tmp_path):
    r = run_with_faults(tmp_path, rank=0, releases=-1, timeout=300)  # every release on cell 0 fails
    assert r.returncode == 1
    assert ("RuntimeError: cell 0 (the core) could not switch into training 3 times in a row, so no cell can "
            "train: cell 0 could not release its engine's memory (3 attempts): RuntimeError: injected: 1 requests "
            "are running") in r.stderr
    _, events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [e["cell"] for e in events if e["event"] == "switch_failed"] == [0, 0, 0]
