"""The GPU check's SGLang phase (f) emulated on this CPU: ``tests/gpu/gpu_check.py
--emulate-on-cpu --phases f`` with the SGLang environment's Python runs the cell's two
rollout -> training -> rollout cycles against a CPU server (``tests/gpu/sglang_cycle.py``), so the
phase calls only endpoints SGLang 0.5.23 serves and its checks hold wherever a CPU can show them;
the memory saver, CUDA graphs, CUDA IPC and the shared KV store are left to the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1800)  # one CPU server start, several minutes on a loaded 2-core machine
def test_phase_f_runs_emulated_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_check.py"), "--emulate-on-cpu",
                        "--phases", "f", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                       timeout=1700, env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = json.loads(out.read_text())
    f = report["phases"]["f_sglang"]
    assert r.returncode == 0 and report["passed"] is True, json.dumps(f)[-3000:]
    cycle = f["cycle"]
    assert cycle["status"] == "pass" and cycle["failed_checks"] == []
    assert cycle["held_before_switch"] == 1 and cycle["long_request_aborted"] is True
    assert cycle["sessions"] is True
    first, second = cycle["rounds"]
    assert (first["weight_version"], second["weight_version"]) == ("1", "2")
    assert first["held_after_switch"] == second["held_after_switch"] == 0
    assert first["logprob_vs_host_max_abs_diff"] < 1e-3 and second["logprob_vs_host_max_abs_diff"] < 1e-3
    assert first["logprob_vs_reference_max_abs_diff"] > 1e-2  # the stand-in update moved the outputs
    assert second["same_tokens_as_reference"] is True and second["logprob_vs_reference_max_abs_diff"] <= 1e-4
    assert [t["direction"] for t in cycle["transitions"]] == ["rollout->training", "training->rollout"] * 2
    assert f["shared_kv"]["status"] == "skip" and "CUDA" in f["shared_kv"]["reason"]
