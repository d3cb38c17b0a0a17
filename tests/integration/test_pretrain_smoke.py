"""`torchrun tools/megatron_smoke.py` (the Megatron-core path on CPU) and pretrain_gyre.py's CLI checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_megatron_smoke_two_cells(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tools" / "megatron_smoke.py"), "--config", str(ROOT / "examples" / "cpu_tiny.yaml"),
         "--num-cells", "2", "--training-backend", "megatron", "--train-steps", "3", "--run-dir", str(run_dir)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2 and summary["num_cells"] == 2
    assert summary["replicas_identical"] is True
    losses = summary["lm_loss_by_step"]
    assert len(losses) == 3 and losses[-1] < losses[0]  # lr 1e-4 on the format examples
    assert json.loads(r.stdout.strip().splitlines()[-1]) == summary


def test_pretrain_gyre_bad_config_exits_2(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("steps-per-burst: 0\n")
    r = subprocess.run([sys.executable, str(ROOT / "pretrain_gyre.py"), "--config", str(cfg)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["pretrain_gyre.py: error: argument --steps-per-burst: mu must be >= 1"]


def test_pretrain_gyre_help_lists_groups():
    r = subprocess.run([sys.executable, str(ROOT / "pretrain_gyre.py"), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0
    for group in ("rollout:", "placement:", "admission:", "objective:"):
        assert group in r.stdout
