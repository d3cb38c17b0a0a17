"""gyre.runtime.plot and tools/plot_run.py on a recorded metrics.jsonl of the cpu_tiny example."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from gyre.metrics import read_metrics
from gyre.runtime.plot import plot_run, step_series, training_figure

#: metrics.jsonl of a real `bash examples/run_cpu_tiny.sh` run (3 optimizer steps).
RECORDED = Path(__file__).resolve().parents[1] / "data" / "metrics" / "cpu_tiny.jsonl"


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(RECORDED, run / "metrics.jsonl")
    return run


def test_step_series_of_the_recorded_run():
    rows, _ = read_metrics(RECORDED)
    steps, rewards = step_series(rows, "reward_mean")
    assert steps == [1, 2, 3]  # 1-based, as written to metrics.jsonl
    assert rewards == pytest.approx([0.8333333333333333, 0.43333333333333335, 0.5666666666666667])
    assert step_series(rows, "loss") == ([1, 2, 3], [0.0, 0.0, 0.0])
    assert step_series(rows, "grad_norm") == ([1, 2, 3], [0.0, 0.0, 0.0])
    assert step_series(rows, "clip_fraction") == ([1, 2, 3], [0.0, 0.0, 0.0])
    assert step_series(rows, "no_such_key") == ([], [])


def test_step_series_skips_missing_and_non_finite_values_and_sorts():
    rows = [{"step": 3, "loss": 0.5}, {"step": 1, "loss": 0.25}, {"step": 2, "loss": math.nan},
            {"step": 4, "loss": None}, {"step": 5}, {"loss": 9.0}]
    assert step_series(rows, "loss") == ([1, 3], [0.25, 0.5])


def _is_integer_ticks(ax) -> bool:
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    return bool(ticks) and all(float(t).is_integer() for t in ticks)


def test_plot_run_writes_reward_and_training_pngs(run_dir, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    real_subplots = plt.subplots

    def recording_subplots(*args, **kwargs):
        fig, axes = real_subplots(*args, **kwargs)
        figures.append(fig)
        return fig, axes

    monkeypatch.setattr(plt, "subplots", recording_subplots)
    monkeypatch.setattr(plt, "close", lambda fig=None: None)  # keep the figures to inspect
    paths = plot_run(run_dir)
    assert paths == [run_dir / "reward.png", run_dir / "training.png"]  # no timeline.json here
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    reward_fig, training_fig = figures
    (reward_ax,) = reward_fig.axes
    assert [list(line.get_xdata()) for line in reward_ax.get_lines()] == [[1, 2, 3]]
    assert _is_integer_ticks(reward_ax)
    titles = [ax.get_title(loc="left") for ax in training_fig.axes]
    assert titles == ["loss", "grad norm", "clip fraction"]
    for ax in training_fig.axes:
        assert _is_integer_ticks(ax)
        assert all(list(line.get_xdata()) == [1, 2, 3] for line in ax.get_lines())
    assert [line.get_label() for line in training_fig.axes[2].get_lines()] == ["executions (gspo)",
                                                                             "tokens (ppo/grpo)"]
    monkeypatch.undo()
    for fig in figures:
        plt.close(fig)


def test_training_figure_none_without_training_metrics():
    assert training_figure([{"step": 1, "reward_mean": 0.5}]) is None


def test_plot_run_cli(run_dir, capsys, tmp_path):
    import importlib.util

    tool = Path(__file__).resolve().parents[2] / "tools" / "plot_run.py"
    spec = importlib.util.spec_from_file_location("plot_run_tool", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(run_dir)]) == 0
    assert capsys.readouterr().out.split() == [str(run_dir / "reward.png"), str(run_dir / "training.png")]
    assert mod.main([str(tmp_path / "missing")]) == 2
    assert "not a Gyre run directory" in capsys.readouterr().err


def test_a_step_logged_again_after_a_resume_keeps_its_last_value():
    from gyre.runtime.plot import step_series

    rows = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}, {"step": 2, "loss": 0.3}, {"step": 3, "loss": 0.2}]
    assert step_series(rows, "loss") == ([1, 2, 3], [0.5, 0.3, 0.2])
