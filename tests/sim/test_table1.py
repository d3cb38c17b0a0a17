"""gyre/sim/table1.py and tools/simulate.py --table1: the Table 1 ablations on paper-nl2repo."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.scheduler import SchedulerConfig
from gyre.sim.compare import regroup
from gyre.sim.presets import load_preset
from gyre.sim.table1 import TABLE1, run_table1, table1_sim

TOOL = Path(__file__).resolve().parents[2] / "tools" / "simulate.py"
NAMES = ["A0", "A1", "A2", "A3", "C0", "C1", "C2", "C3", "E0", "E1", "E2"]


@pytest.fixture(scope="module")
def base():
    return load_preset("paper-nl2repo")


@pytest.fixture(scope="module")
def runs(base):
    """Every configuration, 12 steps (the table's length), with invariant checks."""
    out = {}
    for name in NAMES:
        sim = table1_sim(base, name, 12, check=True)
        out[name] = (sim, sim.run())
    return out


def test_configurations(base):
    assert list(TABLE1) == NAMES
    shapes = {n: TABLE1[n].preset(base).scheduler for n in NAMES}
    for n, s in shapes.items():
        assert s.expected_staleness == 1.5, n
        nodes = s.num_cells * TABLE1[n].preset(base).nodes_per_cell + s.standalone_concurrency // 36
        assert nodes == 32, n
    assert [shapes[n].train_cells for n in ("A0", "A1", "A3")] == [3, 2, 3]
    assert [shapes[n].streaming for n in NAMES] == [False] * 3 + [True] + [False, False, True, True] + [True] * 3
    assert [(shapes[n].num_cells, shapes[n].standalone_concurrency) for n in ("C0", "C1", "C3", "E2")] == \
        [(8, 0), (7, 144), (6, 288), (4, 0)]
    assert shapes["E2"].rollout_concurrency_per_cell == 288
    assert TABLE1["E2"].preset(base).sim.train_step_cell_s == base.sim.train_step_cell_s / 2
    assert shapes["C1"].standalone_handoff and not shapes["C0"].standalone_handoff


def test_staleness_after_warm_up(runs):
    """Groups consumed once the startup dispatch is used up (whole bursts) have mean staleness
    phi + (mu - 1)/2 within 0.05; over all 12 steps the startup dispatch, consumed with
    staleness equal to its step, lowers the mean for phi > 0."""
    full = {}
    for name, (sim, res) in runs.items():
        cfg = sim.cfg
        warm = math.ceil((cfg.phi + cfg.mu) / cfg.mu) * cfg.mu
        late = [d for _, step, d in sim.sched.queue.staleness_log if step >= warm]
        assert abs(sum(late) / len(late) - cfg.expected_staleness) <= 0.05, name
        assert res.steps == 12
        full[name] = round(res.mean_staleness, 4)
    assert full["C0"] == 1.5
    assert full["E0"] == full["A2"] == full["C1"] == 1.375       # (0.5, 3): 1.5 - 0.5 * 3 / 12
    assert full["A0"] == full["E1"] == round(16 / 12, 4)         # (1.5, 1)


def test_table1_times(runs):
    h = {n: r.hours for n, (_, r) in runs.items()}
    assert h["E0"] == pytest.approx(16.85, abs=0.01)             # the paper reports 16.12 h
    assert h["E0"] < min(h[n] for n in NAMES if n[0] != "E")
    assert h["A3"] < h["A0"] < h["A1"]                           # streaming helps; fewer training nodes hurt
    assert h["C3"] < h["C1"] < h["C0"]                           # standalone nodes help colocate
    assert h["C2"] == h["C1"]                                    # the handoff, not streaming, decides C1's switch
    assert all(r.switches == 0 for n, (_, r) in runs.items() if n[0] == "A")


def test_run_table1_reduced(base):
    out = run_table1(base, 2, names=["A0", "C2", "E0"])
    res = out.pop("_results")
    assert set(out["configs"]) == {"A0", "C2", "E0"}
    assert out["configs"]["E0"]["time_vs_E0"] == 1.0
    assert out["configs"]["A0"]["time_vs_E0"] == pytest.approx(res["A0"].hours / res["E0"].hours, abs=1e-4)
    assert run_table1(base, 2, names=["A0"])["configs"]["A0"]["time_vs_E0"] is None
    e0 = run_table1(base, 12, names=["E0"])["configs"]["E0"]  # the identity holds once warmed up
    assert e0["mean_staleness"] < 1.45 and abs(e0["staleness_after_warmup"] - 1.5) <= 0.05


def test_cli_table1_json_and_table():
    p = subprocess.run([sys.executable, str(TOOL), "--table1", "--steps", "3", "--json", "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert list(out) == ["configs"] and list(out["configs"]) == NAMES
    for c in out["configs"].values():
        assert set(c) == {"hours", "time_vs_E0", "phi", "mu", "mean_staleness", "staleness_after_warmup"}
        assert c["hours"] > 0
    assert (out["configs"]["C1"]["phi"], out["configs"]["C1"]["mu"]) == (0.5, 3)
    p = subprocess.run([sys.executable, str(TOOL), "--table1", "--steps", "2", "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "Table 1 ablations: workload paper-nl2repo, E[d] = 1.5, 2 steps"
    lines = p.stdout.splitlines()
    assert len(lines) == 3 + len(NAMES) and lines[-1].startswith("staleness: mean over the run; warm:")
    # 2 steps: every group comes from the start-up dispatch, nothing is past the warm-up
    assert [line.split()[6] for line in lines[2:-1]][:2] == ["-", "-"]


def test_regroup_errors(base):
    with pytest.raises(ValueError, match="whole 4-node cells"):
        regroup(base, None, 3)
    with pytest.raises(ValueError, match="whole 5-node cells"):
        regroup(base, 5, 0)


def test_knob_defaults_and_validation():
    c = SchedulerConfig()
    assert c.streaming is True and c.standalone_handoff is False
    with pytest.raises(ValueError, match="colocate requires phi = 0"):
        SchedulerConfig(placement="colocate", phi=1.0, standalone_concurrency=4)
    with pytest.raises(ValueError, match="needs a standalone pool"):
        SchedulerConfig(placement="colocate", phi=1.0, standalone_handoff=True)
    with pytest.raises(ValueError, match="is for colocate"):
        SchedulerConfig(placement="elastic", standalone_concurrency=4, standalone_handoff=True)
    SchedulerConfig(placement="colocate", phi=1.0, standalone_concurrency=4, standalone_handoff=True)


def test_dispatch_without_streaming_takes_a_full_batch():
    from gyre.scheduler.dispatch import BoundaryDispatch

    for streaming, sizes in ((True, [1, 2, 3]), (False, [0, 0, 3])):
        q = BoundaryDispatch(SchedulerConfig(N=1, B=3, streaming=streaming))
        q.dispatch(4)
        got = []
        for gid in range(3):
            q.group_ready(gid, 2)
            q.fill_stream()
            got.append(len(q.stream.group_ids))
        assert got == sizes, streaming
        assert q.stream.micro_total == 6
