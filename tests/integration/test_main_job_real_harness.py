"""The main job with a real harness: `torchrun pretrain_gyre.py --config examples/cpu_tiny.yaml
--harness <name> --train-steps 1` for mini-swe-agent, Claude Code and Codex CLI, unmodified.

Each harness is installed from its registry (PyPI / npm) into the harness cache before the job
starts; the test is skipped only when the harness is unavailable (registry unreachable, or npm
missing for the npm ones). The tiny policy's replies are noise, so the harnesses end by format
errors, step limits or output-limit errors; the job must still record every model call, evaluate
every workspace and train one step on them. Checked from the run directory: the harness's own
executable was launched, every launched execution closed once with at least one call, its
record file holds those calls (the harness's API, its client identified by the request headers),
its workspace was assessed, and every execution was trained in step 1.

Claude Code's first prompt is ~16.5k tokens and Codex's ~12.6k with the tiny model's tokenizer,
above cpu_tiny's 4096-token context: their runs raise ``--seq-length`` and
``--micro-step-tokens`` to 32768 and train with ``--training-backend hf`` (torch SDPA's causal
kernel; the Megatron CPU path materialises an s x s score matrix per head and runs out of memory
at that length on a 24 GB machine).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from gyre.harness import HarnessUnavailable, make_harness
from gyre.metrics import read_metrics
from gyre.trajectory.store import read_records
from tests.integration.test_main_job import ENV, ROOT, executions_log, torchrun

pytestmark = pytest.mark.slow

LONG_PROMPT = ("--seq-length", "32768", "--micro-step-tokens", "32768", "--training-backend", "hf")
#: name -> (N, B, extra flags, the API its calls use, the client the proxy detects, its user-agent prefix)
CASES = {
    "mini-swe-agent": (2, 1, ("--harness-max-turns", "3"), "chat", "openai-python", "OpenAI/Python"),
    "claude-code": (2, 1, ("--harness-max-turns", "2", *LONG_PROMPT), "anthropic", "claude-code", "claude-cli/"),
    "codex": (2, 1, LONG_PROMPT, "responses", "codex", "codex_exec/"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_main_job_with_a_real_harness(name, tmp_path, tiny_model_dir):
    n, b, extra, api, client, user_agent = CASES[name]
    harness = make_harness(name)
    try:
        harness.ensure_installed()  # into the harness cache, where the job's own ensure_installed finds it
    except HarnessUnavailable as exc:
        pytest.skip(f"{name} unavailable: {exc}")
    run = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run(torchrun(run, "--harness", name, "--num-cells", "1", "--train-steps", "1",
                                "--n-samples-per-prompt", str(n), "--global-batch-groups", str(b),
                                "--execution-timeout-s", "90", *extra, nproc=1),
                       capture_output=True, text=True, env=ENV, timeout=400, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-5000:]
    wall = time.monotonic() - t0
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads(r.stdout.strip().splitlines()[-1]) == summary
    assert summary["steps"] == 1 and summary["executions"] == summary["executions_trained"] == n * b, summary
    assert sum(summary["executions_closed"].values()) == n * b
    assert summary["trajectories_admitted"] >= n * b and summary["tokens_trained"] > 0

    log = executions_log(run)
    launched = [e["execution_id"] for e in log if e["event"] == "launched"]
    closed = {e["execution_id"]: e for e in log if e["event"] == "closed"}
    assert len(launched) == n * b and sorted(launched) == sorted(closed)
    exe = str(harness.executable())
    for eid, event in closed.items():
        # the real harness process ran: its own executable, launched by the job
        meta = json.loads((run / "executions" / eid / "execution.json").read_text())
        assert meta["harness"] == name and meta["argv"][0] == exe
        # its model calls went through the proxy and are stored, one record per call
        assert event["calls"] >= 1 and event["outcome"] == "valid", event
        records = list(read_records(run / "records" / f"{eid}.jsonl"))
        assert len(records) == event["calls"]
        for rec in records:
            assert rec.metadata["api"] == api and rec.metadata["harness"] == client
            assert rec.metadata["headers"]["user-agent"].startswith(user_agent)
            assert rec.role == "main" and rec.num_input_tokens > 0 and rec.num_output_tokens > 0
        assert 0.0 <= event["reward"] <= 1.0

    # every workspace assessed (one designated assessment each), every execution trained in step 1
    assessments = [json.loads(line) for line in (run / "evaluations" / "assessments.jsonl").read_text().splitlines()]
    assert {a["execution_id"] for a in assessments if a["designated"]} == set(closed)
    trained = [(e["execution_id"], e["step"]) for e in log if e["event"] == "trained"]
    assert sorted(trained) == sorted((eid, 1) for eid in closed)
    rows, _ = read_metrics(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1]
    print(f"{name}: main job {wall:.1f} s, calls {sum(e['calls'] for e in closed.values())}, "
          f"closed {summary['executions_closed']}")
