import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_prefix_groups_and_snapshots_across_three_cells(tmp_path):
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not installed")
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        str(Path(__file__).with_name("prefix_groups_worker.py")), "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    recs = json.loads(out.read_text())
    assert [x.get("sum_prefix_1") for x in recs] == [3.0, 3.0, None]  # 1 + 2, rank 2 not a member
    assert [x["sum_prefix_2"] for x in recs] == [6.0, 6.0, 6.0]
    assert [x["members_1"] for x in recs] == [[0, 1], [0, 1], []]
    assert recs[1]["gloo_version"] == 3 and "gloo_version" not in recs[2]
    assert [x.get("mooncake_version") for x in recs] == [None, 4, 4]
    assert all(x["equal_to_core"] for x in recs)
