"""The GPU check script on a machine without a GPU: every phase, and the preflight, reports
``skip``; emulated on CPU, the phases' code runs and passes (the GPU measurements are left out), so the script that waits
for a GPU machine is itself exercised here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "gpu_check.py"
pytestmark = pytest.mark.slow


def run(tmp_path, *args):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=900)
    return r, json.loads(out.read_text())


def test_without_a_gpu_every_phase_is_skipped(tmp_path):
    r, report = run(tmp_path)
    assert r.returncode == 1  # nothing ran: not a pass
    assert sorted(report["phases"]) == ["a_megatron_step_equals_hf_step", "b_cells_tp2_on_one_gpu",
                                        "c_training_state_offload", "d_cuda_ipc_weight_push",
                                        "e_main_job_backend_gpu", "f_sglang"]
    assert {p["status"] for p in report["phases"].values()} == {"skip"} and report["passed"] is False
    assert report["preflight"] == {"status": "skip", "reason": "no CUDA device"}  # nothing to import for
    assert json.loads(r.stdout) == report


def test_the_phases_code_runs_emulated_on_cpu(tmp_path):
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not installed")
    r, report = run(tmp_path, "--emulate-on-cpu", "--phases", "a,c,d,e")
    phases = report["phases"]
    assert r.returncode == 0, json.dumps(phases)[-3000:]
    a, c, d, e = (phases[k] for k in sorted(phases))
    assert a["status"] == "pass" and a["grad_max_abs_diff"] < 1e-5 and a["grad_norm"] > 0.1
    assert c["status"] == "pass" and c["bit_identical"] is True and c["param_gb"] > 0.01
    assert c["moved_gb"] > c["param_gb"] and c["offload_gb_per_s"] > 0 and c["restore_gb_per_s"] > 0
    assert d["status"] == "pass" and d["pushes"] == 5 and d["logprob_max_abs_diff"] < 1e-4
    assert e["status"] == "pass" and e["steps"] == 1 and e["role_changes"] > 0


def test_phase_f_without_sglang_is_skipped_with_its_reason(tmp_path):
    """Phase f needs SGLang (the GPU machine has none): emulated here, where this Python has no
    SGLang, it is skipped with the reason, and the check still passes (f may be skipped)."""
    import importlib.metadata as md

    try:  # the distribution, not the module: tests/sglang would pass for a module here
        md.version("sglang")
    except md.PackageNotFoundError:
        pass
    else:
        pytest.skip("this Python has SGLang: the SGLang tier runs phase f (tests/sglang/test_sglang_gpu_check.py)")
    r, report = run(tmp_path, "--emulate-on-cpu", "--phases", "f")
    f = report["phases"]["f_sglang"]
    assert f["status"] == "skip" and "sglang is not importable" in f["reason"]
    assert r.returncode == 0 and report["passed"] is True


def test_a_missing_import_stops_the_check_before_any_phase(tmp_path):
    """The preflight imports what the phases need; one that fails (here ``uvicorn``, shadowed by a
    module that raises) fails every phase at once instead of spending device time on each."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "uvicorn.py").write_text("raise ImportError('uvicorn is not installed here')\n")
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--emulate-on-cpu"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(shadow)})
    report = json.loads(out.read_text())
    assert r.returncode == 1 and report["passed"] is False
    assert report["preflight"]["ok"] is False
    assert "uvicorn is not installed here" in report["preflight"]["failed_imports"]["uvicorn"]
    assert {p["status"] for p in report["phases"].values()} == {"fail"} and len(report["phases"]) == 6
