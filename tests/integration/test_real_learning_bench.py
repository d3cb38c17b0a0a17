"""bench/real_learning.py without a model: its intervals against brute-force references, its argument
checks, the verdict, and the plot and reward curve from a fake run directory."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench import real_learning as rl


@pytest.mark.parametrize("passed, n", [(0, 10), (3, 10), (33, 64), (64, 64), (1, 1), (40, 128)])
def test_wilson_is_the_score_test_inversion(passed, n):
    # brute force: the p in [0, 1] whose score test |phat - p| <= z * sqrt(p (1 - p) / n) accepts
    ps = np.linspace(0, 1, 200_001)
    ok = np.abs(passed / n - ps) <= rl.Z95 * np.sqrt(ps * (1 - ps) / n)
    lo, hi = rl.wilson(passed, n)
    assert lo == pytest.approx(ps[ok].min(), abs=1e-5) and hi == pytest.approx(ps[ok].max(), abs=1e-5)


def test_wilson_rejects_bad_counts():
    for passed, n in ((1, 0), (-1, 3), (4, 3)):
        with pytest.raises(ValueError):
            rl.wilson(passed, n)


def test_newcombe_difference_from_the_wilson_limits():
    d = rl.newcombe_difference((50, 128), (30, 128))
    l1, u1 = rl.wilson(50, 128)
    l0, u0 = rl.wilson(30, 128)
    p1, p0 = 50 / 128, 30 / 128
    assert d["diff"] == pytest.approx(20 / 128)
    assert d["low"] == pytest.approx(p1 - p0 - math.hypot(p1 - l1, u0 - p0))
    assert d["high"] == pytest.approx(p1 - p0 + math.hypot(u1 - p1, p0 - l0))
    assert 0 < d["low"] < d["diff"] < d["high"]
    same = rl.newcombe_difference((30, 128), (30, 128))
    assert same["diff"] == 0 and same["low"] < 0 < same["high"]


def test_summary_and_verdict():
    before = {"greedy": {"passed": 33, "n": 64}, "sampled": {"passed": 40, "n": 128}}
    after = {"greedy": {"passed": 45, "n": 64}, "sampled": {"passed": 70, "n": 128}}
    s = rl.summarise(before, after)
    assert s["sampled"]["before"] == {"passed": 40, "n": 128, "rate": 0.3125, "ci95": [round(x, 4) for x in
                                                                                      rl.wilson(40, 128)]}
    assert s["sampled"]["difference"]["diff"] == pytest.approx(30 / 128, abs=1e-4)
    assert rl.verdict(s, 80, min_rise=0.10, max_minutes=90)
    assert not rl.verdict(s, 95, min_rise=0.10, max_minutes=90)  # too slow
    assert not rl.verdict(s, 80, min_rise=0.30, max_minutes=90)  # rose by 0.23 only
    small = rl.summarise({"sampled": {"passed": 2, "n": 8}}, {"sampled": {"passed": 4, "n": 8}})
    assert not rl.verdict(small, 10, min_rise=0.10, max_minutes=90)  # +0.25, but the interval holds 0
    assert not rl.verdict(rl.summarise(before, None), 10, min_rise=0.0, max_minutes=90)


def test_arguments():
    a = rl.parse(["--seeds", "0", "3", "--steps", "2", "--temperature", "0.5", "--resume", "--", "--lr", "1e-6"])
    assert a.seeds == [0, 3] and a.steps == 2 and a.temperature == 0.5 and a.resume and a.extra == ["--lr", "1e-6"]
    d = rl.parse([])
    assert (d.seeds, d.steps, d.minutes, d.temperature, d.sampled_attempts, d.heldout_size) == ([0], None, 65.0, 0.7,
                                                                                                  4, 64)
    s = rl.parse(["--smoke", "--steps", "2", "--", "--lr", "1e-6"])
    assert (s.heldout_size, s.sampled_attempts) == (8, 1)
    assert s.extra == ["--global-batch-groups", "2", "--n-samples-per-prompt", "4", "--save-interval", "1", "--lr", "1e-6"]
    for bad in (["--steps", "0"], ["--temperature", "0"], ["--minutes", "-1"], ["--sampled-attempts", "0"]):
        with pytest.raises(SystemExit) as e:
            rl.parse(bad)
        assert e.value.code == 2


def test_reward_curve_and_plot(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    rows = [{"kind": "event", "event": "run_start"}] + [
        {"kind": "metrics", "step": s, "reward_mean": r} for s, r in ((1, 0.25), (2, 0.5), (3, 0.625))]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps, rewards = rl.reward_curve(job)
    assert steps == [1, 2, 3] and rewards == [0.25, 0.5, 0.625]
    assert rl.reward_curve(tmp_path / "missing") == ([], [])
    s = rl.summarise({"greedy": {"passed": 33, "n": 64}, "sampled": {"passed": 40, "n": 128}},
                     {"greedy": {"passed": 40, "n": 64}, "sampled": {"passed": 60, "n": 128}})
    png = rl.plot(tmp_path / "learning.png", steps, rewards, s)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
