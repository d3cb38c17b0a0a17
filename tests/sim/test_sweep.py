"""gyre/sim/sweep.py and tools/simulate.py --table1 --sweep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.sim.presets import load_preset
from gyre.sim.sweep import SWEEP_VALUES, run_sweep, swept_preset, sweep_markdown
from gyre.sim.table1 import run_table1

TOOL = Path(__file__).resolve().parents[2] / "tools" / "simulate.py"


@pytest.fixture(scope="module")
def base():
    return load_preset("paper-nl2repo")


def test_each_input_changes_what_it_names(base):
    w = base.workload
    assert w.statistics()["timeout_rate"] == pytest.approx(0.0625, abs=0.002)     # the fit
    for share in SWEEP_VALUES["timeout_share"]:
        got = swept_preset(base, "timeout_share", share)
        assert got.workload.statistics()["timeout_rate"] == pytest.approx(share, abs=1e-9)
        assert (got.workload.s, got.workload.timeout_h, got.sim) == (w.s, w.timeout_h, base.sim)
    wide = swept_preset(base, "duration_spread", 2.0).workload
    assert wide.s == pytest.approx(2 * w.s) and wide.pi == w.pi
    assert swept_preset(base, "train_step_h", 6.0).sim.train_step_cell_s == 6 * 3600.0
    assert swept_preset(base, "duration_spread", 1.0) == base
    with pytest.raises(ValueError, match="out of reach"):
        swept_preset(base, "timeout_share", 0.95)
    with pytest.raises(ValueError, match="unknown sweep input"):
        swept_preset(base, "gpu_count", 1.0)
    with pytest.raises(ValueError, match="is not one"):
        swept_preset(load_preset("toy"), "duration_spread", 1.0)


def test_run_sweep_reports_each_points_table(base):
    values = {"train_step_h": [1.0, 6.0]}
    out = run_sweep(base, 3, [0, 1], inputs=["train_step_h"], values=values, names=["C2", "E0"], workers=1)
    rows = out["inputs"]["train_step_h"]
    assert [r["value"] for r in rows] == [1.0, 6.0]
    for r in rows:
        t = run_table1(swept_preset(base, "train_step_h", r["value"]), 3, seeds=[0, 1], names=["C2", "E0"], workers=1)
        assert r["hours"] == {n: c["hours"] for n, c in t["configs"].items()}
        assert r["time_vs_E0"]["C2"] == t["configs"]["C2"]["time_vs_E0"]
    assert rows[1]["hours"]["C2"] > rows[0]["hours"]["C2"]          # a costlier step takes longer
    md = sweep_markdown(out).splitlines()
    assert md[2] == "| value | mean h | timeouts | E0 h | C2 |" and md[4].startswith("| 1 | 1.93 | 0.062 |")
    with pytest.raises(ValueError, match="E0 must be among"):
        run_sweep(base, 2, [0], names=["C2"])


@pytest.mark.slow  # the CLI as a process, a full sweep
def test_cli_sweep_writes_the_tables_and_the_png(tmp_path):
    png = tmp_path / "sweep.png"
    p = subprocess.run([sys.executable, str(TOOL), "--table1", "--sweep", "--steps", "1", "--seeds", "1", "--json",
                        "--plot", str(png), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert list(out["inputs"]) == list(SWEEP_VALUES)
    for name, rows in out["inputs"].items():
        assert [r["value"] for r in rows] == list(SWEEP_VALUES[name])
        assert len(rows[0]["time_vs_E0"]) == 11
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
