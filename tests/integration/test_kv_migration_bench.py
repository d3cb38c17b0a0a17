"""``bench/kv_migration.py`` at one short context: one JSON line with the promised fields, the
migrated retry recomputing (almost) nothing and matching the recompute path's log-probs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_kv_migration_bench_prints_one_json_line_per_context(tiny_qwen_model_dir):
    r = subprocess.run([sys.executable, "bench/kv_migration.py", "--contexts", "1024", "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.strip().splitlines()
    row = json.loads(line)
    for f in ("context_tokens", "recomputed_tokens_migrated", "recomputed_tokens_off", "logprob_max_abs_diff",
              "retry_latency_s_migrated", "retry_latency_s_off", "mb_per_s"):
        assert f in row, f
    ctx = row["context_tokens"]
    assert 1000 <= ctx <= 1024
    assert row["recomputed_tokens_off"] == row["context_tokens_off"] - 1  # all but the last token, which is decoded
    assert row["recomputed_tokens_migrated"] <= 0.05 * ctx and row["migrated_tokens"] >= ctx - 1
    assert row["same_output"] and row["logprob_max_abs_diff"] < 1e-4
    assert row["mb_moved"] > 0 and row["mb_per_s"] > 0 and row["copies_failed"] == 0
