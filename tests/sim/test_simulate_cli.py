"""tools/simulate.py: flags, --json shape, --plot, one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "simulate.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


def test_json_shape_and_plot(tmp_path):
    png = tmp_path / "timeline.png"
    p = _run("--workload", "toy", "--placement", "elastic,async,colocate", "--mean-staleness", "1.5",
             "--steps", "24", "--seed", "3", "--json", "--plot", str(png))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"placements", "speedup_over"}
    assert set(out["placements"]) == {"elastic", "async", "colocate"}
    for name, (phi, mu) in {"elastic": (0.5, 3), "async": (1.5, 1), "colocate": (0.0, 4)}.items():
        entry = out["placements"][name]
        assert set(entry) == {"hours", "phi", "mu", "mean_staleness", "switches", "train_share"}
        assert (entry["phi"], entry["mu"]) == (phi, mu)
        assert len(entry["train_share"]) == 4 and entry["hours"] > 0
    assert set(out["speedup_over"]) == {"async", "colocate"}
    e = out["placements"]["elastic"]["hours"]
    assert out["speedup_over"]["async"] == pytest.approx(out["placements"]["async"]["hours"] / e, rel=1e-3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_output_and_elastic_override():
    p = _run("--workload", "toy", "--placement", "elastic", "--mean-staleness", "1", "--steps", "6",
             "--elastic-phi", "1", "--elastic-mu", "1")
    assert p.returncode == 0, p.stderr
    assert "elastic" in p.stdout and "hours" in p.stdout and "speedup" not in p.stdout


@pytest.mark.parametrize("args, needle", [
    (["--placement", "elastic,foo"], "unknown placement 'foo'"),
    (["--mean-staleness", "0.3"], "not a whole number"),
    (["--mean-staleness", "-1"], "must be a finite number >= 0"),
    (["--steps", "0"], "must be >= 1"),
    (["--workload", "nope"], "unknown workload"),
    (["--elastic-phi", "1"], "go together"),
    (["--elastic-phi", "1", "--elastic-mu", "3"], "mean staleness 2"),
    (["--plot", "/nonexistent/dir/x.png"], "does not exist"),
    (["--workload", "missing.jsonl"], "missing.jsonl"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    p = _run("--steps", "2", *args) if "--steps" not in args else _run(*args)
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("simulate: error:") and needle in lines[0], p.stderr
