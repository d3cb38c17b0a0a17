"""``bench/chaos.py --quick`` (fuzz and client-retry sections, small counts): one JSON line with
every promised integer field, the sections that ran, and zeros where the proxy promises them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
FIELDS = ["engine_kills", "harness_errors", "records_lost", "records_duplicated", "rank_kills", "finished_lost",
          "trained_twice", "steps_repeated", "fuzz_requests", "responses_5xx", "requests_over_30s", "retry_calls",
          "retry_records_extra"]


def test_chaos_quick_prints_one_json_line(tiny_model_dir):
    r = subprocess.run([sys.executable, "bench/chaos.py", "--quick", "--sections", "fuzz,retries",
                        "--fuzz-requests", "60", "--retry-calls", "3"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    for f in FIELDS:
        assert isinstance(out[f], int) and not isinstance(out[f], bool), f
    assert out["sections"] == ["fuzz", "retries"] and out["quick"] is True
    assert out["fuzz_requests"] == 60 and out["retry_calls"] == 3
    assert sum(out["fuzz_status"].values()) == 60
    # the proxy's promises: a malformed body is a 4xx at once, and the proxy keeps serving
    assert out["responses_5xx"] == 0 and out["requests_over_30s"] == 0 and out["fuzz_transport_errors"] == 0
    assert out["fuzz_healthy_after"] == 1 and out["retry_final_not_200"] == 0
    # sections that did not run report zeros
    for f in ("engine_kills", "harness_errors", "records_lost", "records_duplicated", "rank_kills", "finished_lost",
              "trained_twice", "steps_repeated"):
        assert out[f] == 0, f
