"""SchedulerConfig: validation and construction from the argparse namespace."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gyre.scheduler import SchedulerConfig


def _ns(**kw):
    base = dict(n_samples_per_prompt=16, global_batch_groups=32, extra_dispatch=0.5, steps_per_burst=3,
                placement="elastic", num_cells=8, train_cells=1, rollout_concurrency_per_cell=144,
                standalone_concurrency=0, oversample_executions=0, train_steps=2, max_switch_failures=3)
    base.update(kw)
    return SimpleNamespace(**base)


def test_from_args_reads_the_flag_attributes():
    cfg = SchedulerConfig.from_args(_ns(oversample_executions=2, train_steps=48))
    assert (cfg.N, cfg.B, cfg.phi, cfg.mu, cfg.num_cells, cfg.rollout_concurrency_per_cell) == (16, 32, 0.5, 3, 8, 144)
    assert (cfg.placement, cfg.train_cells, cfg.standalone_concurrency, cfg.oversample, cfg.max_steps) == (
        "elastic", 1, 0, 2, 48)
    assert cfg.queue_depth_groups == 112 and cfg.expected_staleness == 1.5 and cfg.executions_per_group == 18


def test_from_args_overrides():
    cfg = SchedulerConfig.from_args(_ns(), max_steps=5)
    assert cfg.oversample == 0 and cfg.max_steps == 5


def test_from_args_with_the_real_parser():
    arguments = pytest.importorskip("gyre.arguments")
    build = getattr(arguments, "build_parser", None)
    if build is None:
        pytest.skip("gyre.arguments has no build_parser")
    args = build().parse_args(["--n-samples-per-prompt", "16", "--global-batch-groups", "32",
                               "--extra-dispatch", "0.5", "--steps-per-burst", "3", "--num-cells", "8",
                               "--rollout-concurrency-per-cell", "144", "--train-steps", "48"])
    cfg = SchedulerConfig.from_args(args)
    assert (cfg.N, cfg.B, cfg.phi, cfg.mu, cfg.num_cells, cfg.max_steps) == (16, 32, 0.5, 3, 8, 48)


@pytest.mark.parametrize("kw, match", [
    (dict(phi=0.3, B=4), "whole number of groups"),
    (dict(placement="colocate", phi=1.0), "colocate requires phi = 0"),
    (dict(placement="async", num_cells=2, train_cells=2), "async needs"),
    (dict(placement="nope"), "placement must be one of"),
    (dict(mu=0), "mu must be >= 1"),
    (dict(N=0), "N must be >= 1"),
    (dict(max_steps=0), "max_steps"),
])
def test_validation_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kw)
