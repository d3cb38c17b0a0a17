"""Materialisation into rows and dedup statistics."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.trajectory import (
    AdmissionConfig,
    DedupStats,
    TrajectoryTree,
    dedup_stats,
    materialize,
    sample_trajectories,
)

from .helpers import examples, lp_for, random_execution
from .test_admission import compaction_tree


def test_rows_exact():
    tree = compaction_tree()
    adm = sample_trajectories(tree, np.random.default_rng(0))
    rows = materialize(tree, adm, advantage=0.75)
    assert len(rows) == 2
    r0, r1 = rows
    assert r0.input_ids.dtype == np.int32 and r0.target_mask.dtype == bool and r0.behaviour_logprobs.dtype == np.float32
    assert r0.input_ids.tolist() == [1, 2, 3, 93, 50, 51, 52, 15]
    assert r0.target_mask.tolist() == [False] * 7 + [True]
    np.testing.assert_array_equal(r0.behaviour_logprobs, np.array([0] * 7 + lp_for([15]), np.float32))
    assert (r0.execution_id, r0.num_execution_targets, r0.L_i, r0.num_targets, r0.advantage) == ("exec-1", 9, 9, 1, 0.75)
    assert (r0.leaf, r0.role, r0.policy_version_min, r0.policy_version_max) == (6, "main", 0, 0)

    assert r1.input_ids.tolist() == [1, 2, 3, 4, 5, 10, 11, 6, 7, 12, 13, 8, 14, 90, 91, 50, 51, 52]
    expected_mask = [0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    assert r1.target_mask.astype(int).tolist() == expected_mask
    lp = np.zeros(18, np.float32)
    lp[[5, 6]] = lp_for([10, 11])
    lp[[9, 10]] = lp_for([12, 13])
    lp[12] = lp_for([14])[0]
    lp[15:18] = lp_for([50, 51, 52])
    np.testing.assert_array_equal(r1.behaviour_logprobs, lp)
    assert (r1.num_targets, r1.L_i, r1.role) == (8, 9, "compaction")

    stats = dedup_stats(tree, adm, rows)
    assert stats == DedupStats(
        tree_tokens=18 + 5,  # path of leaf 4 (18) + node 6 (5)
        trainable_tokens=9,
        targets_admitted=9,
        row_tokens=8 + 18,
        flattened_path_tokens=18 + 8,
        per_call_tokens=(5 + 2) + (9 + 2) + (12 + 1) + (15 + 3) + (7 + 1),
        rows=2,
        leaves=2,
    )


def test_advantage_placeholder_is_nan():
    tree = compaction_tree()
    rows = materialize(tree, sample_trajectories(tree, np.random.default_rng(0)))
    assert all(math.isnan(r.advantage) for r in rows)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(1, 14), st.sampled_from([1, 3, None]), st.integers(0, 1000))
def test_rows_match_tree(data, n_records, j_max, seed):
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    tree = TrajectoryTree()
    records = random_execution(draw_int, n_records)
    for r in records:
        tree.insert(r)
    adm = sample_trajectories(tree, np.random.default_rng(seed), AdmissionConfig(j_max=j_max))
    rows = materialize(tree, adm)
    assert len(rows) == len(adm.trajectories)
    for row, t in zip(rows, adm.trajectories):
        path_ids = tree.path_tokens(t.leaf)
        assert row.input_ids.tolist() == path_ids.tolist()
        assert row.target_mask.shape == row.behaviour_logprobs.shape == path_ids.shape
        assert int(row.target_mask.sum()) == t.num_targets
        assert row.L_i == adm.num_targets
        # targets are output tokens; their log-probs are the stored behaviour log-probs
        out_mask = tree.path_output_mask(t.leaf)
        assert not (row.target_mask & ~out_mask).any()
        np.testing.assert_array_equal(row.behaviour_logprobs[row.target_mask], tree.path_logprobs(t.leaf)[row.target_mask])
        assert (row.behaviour_logprobs[~row.target_mask] == 0).all()
    stats = dedup_stats(tree, adm, rows)
    assert stats.row_tokens == sum(len(r.input_ids) for r in rows) <= stats.flattened_path_tokens
    assert stats.targets_admitted == adm.num_targets <= stats.trainable_tokens
    assert stats.tree_tokens <= stats.per_call_tokens == sum(r.num_input_tokens + r.num_output_tokens for r in records)
