"""The main job with SGLang cells on the CPU (examples/cpu_sglang.yaml): three cells, each a real
SGLang server the job launches, Megatron training on gloo, elastic placement and the reference
harness, 3 steps end to end; the servers' logs stay clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.sglang.conftest import LOG_FAILURES

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_sglang_main_job_trains_three_steps(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "pretrain_gyre.py", "--config", "examples/cpu_sglang.yaml", "--run-dir", str(run)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("gyre:")))
    assert summary["steps"] == 3 and summary["executions_trained"] > 0
    assert summary["role_changes"] >= 2 and summary["switch_failures"] == 0
    assert summary["executions_closed"] == {"completed": summary["executions"]}
    assert summary["weight_pushes"]["at_switch"] >= 1
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e.get("event") == "publish"] == [1, 2, 3]
    logs = sorted(run.glob("sglang_cell*.log"))
    assert len(logs) == 3
    for log in logs:
        text = log.read_text(errors="replace")
        for bad in LOG_FAILURES:
            assert bad not in text, f"{bad} in {log}"
