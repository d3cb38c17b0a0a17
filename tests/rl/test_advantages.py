"""Group-relative advantages: exact values, float32 noise, leave-one-out, exclusion."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.arguments import parse_args
from gyre.rl import AdvantageConfig, compute_advantages, group_advantages

NO_EPS = AdvantageConfig(eps=0.0)


def test_std_scaled_exact_values():
    adv, mean, std, zero = group_advantages([1, 0, 0, 1], NO_EPS)
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0]  # population std 0.5 (ddof = 0)
    assert (mean, std, zero) == (0.5, 0.5, False)
    # the default eps = 1e-6 only shifts the 6th digit
    adv, *_ = group_advantages([1, 0, 0, 1])
    np.testing.assert_allclose(adv, [1, -1, -1, 1], rtol=0, atol=1e-5)
    assert adv[0] == 0.5 / (0.5 + 1e-6)


def test_mean_only_exact_values():
    adv, *_ = group_advantages([1, 0, 0, 1], AdvantageConfig(std_scaling=False))
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_float32_noise_all_equal_group_is_zero_not_a_blowup():
    odd = float(np.float32(0.15) + np.float32(0.2))  # 0.35 computed differently
    same = float(np.float32(0.35))
    assert odd != same
    rewards = [same] * 7 + [odd]
    for cfg in (AdvantageConfig(), AdvantageConfig(std_scaling=False), AdvantageConfig(leave_one_out=True),
                AdvantageConfig(eps=0.0)):
        adv, _, std, zero = group_advantages(rewards, cfg)
        assert zero and 0 < std < 1e-7
        assert np.abs(adv).max() < 1e-6
    # what the naive formula would give: a blow-up by orders of magnitude
    r = np.asarray(rewards)
    assert np.abs((r - r.mean()) / (r.std() + 1e-6)).max() > 1e-3


def test_all_equal_group_reported_and_exactly_zero():
    g = compute_advantages({"a": 1.0, "b": 1.0, "c": 1.0})
    assert g.zero_std and g.advantages == {"a": 0.0, "b": 0.0, "c": 0.0}
    g = compute_advantages({"a": 0.0, "b": 0.0})
    assert g.zero_std


def test_leave_one_out_values():
    cfg = AdvantageConfig(std_scaling=False, leave_one_out=True)
    adv, *_ = group_advantages([1, 0, 0, 1], cfg)
    # A_1 = 1 - mean(0, 0, 1) = 2/3; A_2 = 0 - mean(1, 0, 1) = -2/3
    np.testing.assert_allclose(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=0, atol=1e-15)
    adv, *_ = group_advantages([3.0, 1.0], cfg)
    assert adv.tolist() == [2.0, -2.0]
    adv, *_ = group_advantages([1, 0, 0, 1], AdvantageConfig(leave_one_out=True, eps=0.0))
    np.testing.assert_allclose(adv, [4 / 3, -4 / 3, -4 / 3, 4 / 3], rtol=0, atol=1e-15)  # (2/3) / 0.5
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([1.0], AdvantageConfig(leave_one_out=True))


def test_excluded_execution_is_not_a_zero_and_not_in_the_baseline():
    g = compute_advantages({"a": 1.0, "b": None, "c": 0.0, "d": 1.0, "e": 0.0}, NO_EPS)
    assert g.excluded == ("b",)
    assert "b" not in g.advantages
    assert g.advantages == {"a": 1.0, "c": -1.0, "d": 1.0, "e": -1.0}  # same as without "b"
    # reading the unresolved reward as 0 would have shifted the baseline
    g0 = compute_advantages({"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "e": 0.0}, NO_EPS)
    assert g0.mean == 0.4 and g.mean == 0.5


def test_invalid_inputs_raise():
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan])
    with pytest.raises(ValueError, match="non-empty"):
        group_advantages([])
    with pytest.raises(ValueError, match="at least one valid"):
        compute_advantages({"a": None})
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=-1.0)


def test_single_valid_reward_is_a_zero_std_group():
    g = compute_advantages({"a": 0.7, "b": None})
    assert g.zero_std and g.advantages == {"a": 0.0}


def test_config_from_args():
    cfg = AdvantageConfig.from_args(parse_args(["--no-advantage-std-scaling", "--advantage-leave-one-out",
                                                "--filter-zero-std-groups"]))
    assert (cfg.std_scaling, cfg.leave_one_out, cfg.filter_zero_std_groups) == (False, True, True)
    cfg = AdvantageConfig.from_args(parse_args([]))
    assert (cfg.std_scaling, cfg.leave_one_out, cfg.filter_zero_std_groups) == (True, False, False)


rewards_st = st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=2, max_size=16)


@settings(max_examples=200, deadline=None)
@given(rewards_st, st.booleans(), st.booleans())
def test_properties(rewards, std_scaling, loo):
    cfg = AdvantageConfig(std_scaling=std_scaling, leave_one_out=loo)
    adv, mean, std, zero = group_advantages(rewards, cfg)
    assert np.isfinite(adv).all()
    assert abs(adv.sum()) < 1e-9 * max(1.0, np.abs(adv).max()) * len(rewards)  # centred
    if zero:
        assert (adv == 0).all()
    else:
        # order preserved, and with std scaling the population std of A is ~1 (n/(n-1) with LOO)
        r = np.asarray(rewards, np.float64)
        assert (np.sign(adv) == np.sign(r - r.mean())).all()
        if std_scaling:
            expect = (len(r) / (len(r) - 1)) if loo else 1.0
            assert adv.std() == pytest.approx(expect * std / (std + cfg.eps), rel=1e-9)
