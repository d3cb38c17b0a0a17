import json

import pytest

from gyre.metrics import MetricsSink, read_metrics


def test_jsonl_rows_and_events(tmp_path):
    t = iter([100.0, 101.5, 102.0])
    with MetricsSink(tmp_path, clock=lambda: next(t)) as sink:
        sink.log(1, {"reward_mean": 0.25, "loss": float("nan"), "placement": "elastic"})
        sink.event("role_change", cell=1, role="training", latency_s=0.05)
        sink.log(2, {"reward_mean": 0.5})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"kind": "metrics", "step": 1, "time": 100.0, "reward_mean": 0.25, "loss": None,
                                    "placement": "elastic"}
    assert json.loads(lines[1]) == {"kind": "event", "event": "role_change", "time": 101.5, "cell": 1,
                                    "role": "training", "latency_s": 0.05}
    # a torn last line (killed run) is skipped by the reader
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "metrics", "st')
    rows, events = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["reward_mean"] for r in rows] == [0.25, 0.5] and [e["event"] for e in events] == ["role_change"]


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsSink(tmp_path / "run", tensorboard_dir=tmp_path / "tb") as sink:
        for step, r in enumerate([0.1, 0.4, 0.7]):
            sink.log(step, {"reward_mean": r, "note": "text is not a scalar", "clipped": True})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["clipped", "reward_mean"]
    vals = [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")]
    assert vals == [(0, 0.1), (1, 0.4), (2, 0.7)]


def test_wandb_offline_mode_writes_a_local_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path / "run", wandb={"project": "gyre-test", "name": "t", "config": {"lr": 1e-3}})
    sink.log(1, {"reward_mean": 0.25, "note": "text is skipped"})
    sink.log(2, {"reward_mean": 0.5})
    sink.close()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))  # the offline run's data file, no network used
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["reward_mean"] for r in rows] == [0.25, 0.5]
