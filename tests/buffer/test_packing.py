"""Micro-step packing: every target sees exactly its original context (pack, pad, tree), budgets,
execution placement (kept together when it fits, split and counted once otherwise), accounting."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.buffer.packing import MicroStepPacker, PackingConfig, pack_rows
from gyre.trajectory import AdmissionConfig, TrajectoryRow, TrajectoryTree, materialize, sample_trajectories
from tests.trajectory.helpers import examples, random_execution

LAYOUTS = [("pack", False), ("pad", False), ("pack", True), ("pad", True)]


def row(eid, tokens, targets, L, A=1.0, seed=0):
    toks = np.asarray(tokens, np.int32)
    mask = np.zeros(len(toks), bool)
    mask[list(targets)] = True
    rng = np.random.default_rng(seed)
    blp = np.where(mask, -rng.uniform(0.1, 3, len(toks)), 0).astype(np.float32)
    return TrajectoryRow(eid, toks, mask, blp, L, A, int(mask.sum()), 0, "main", 0, 0)


def expected_targets(rows):
    """Multiset of (execution, context tuple, target id, behaviour lp) from the rows."""
    out = Counter()
    for r in rows:
        for t in np.flatnonzero(r.target_mask):
            out[(r.execution_id, tuple(r.input_ids[:t].tolist()), int(r.input_ids[t]), float(r.behaviour_logprobs[t]))] += 1
    return out


def packed_targets(micro_steps):
    """The same multiset read back from micro-steps through the attention mask and position ids."""
    out = Counter()
    for ms in micro_steps:
        b, s = ms.shape
        allowed = ms.attention_mask()
        for i in range(ms.num_targets):
            r, c = divmod(int(ms.target_index[i]), s)
            cols = np.flatnonzero(allowed[r, c])
            pos = ms.position_ids[r, cols]
            order = np.argsort(pos, kind="stable")
            # the visible columns are exactly positions 0..t-1 of one sequence
            assert pos[order].tolist() == list(range(len(cols)))
            assert (ms.segment_ids[r, cols] >= 0).all()
            ctx = tuple(ms.input_ids[r, cols[order]].tolist())
            assert ms.position_ids[r, c] == len(cols) - 1
            eid = ms.execution_ids[int(ms.target_execution[i])]
            out[(eid, ctx, int(ms.target_ids[i]), float(ms.behaviour_logprobs[i]))] += 1
    return out


def check_invariants(rows, res, cfg):
    ms_list = res.micro_steps
    assert packed_targets(ms_list) == expected_targets(rows)
    L = {r.execution_id: r.num_execution_targets for r in rows}
    counted = Counter()
    where = {}
    for k, ms in enumerate(ms_list):
        b, s = ms.shape
        assert (b == 1 and s <= cfg.token_budget) if cfg.layout == "pack" else b * s <= cfg.token_budget
        for e, eid in enumerate(ms.execution_ids):
            counted[eid] += int(ms.counted[e])
            where.setdefault(eid, set()).add(k)
            assert ms.num_execution_targets[e] == L[eid]
        # padding columns are not attended by real columns
        allowed = ms.attention_mask()
        # the O(s) intervals give exactly the dense mask (the fused kernels' mask_mod)
        enter, exit_ = ms.ancestor_intervals()
        q_enter = enter[:, :, None]
        assert np.array_equal((enter[:, None, :] <= q_enter) & (q_enter <= exit_[:, None, :]), allowed)
        pad = ms.segment_ids < 0
        for r in range(b):
            assert not allowed[r][~pad[r]][:, pad[r]].any()
            if ms.is_causal:  # the plain causal mask is exact for real query columns
                assert np.array_equal(allowed[r][~pad[r]], np.tril(np.ones((s, s), bool))[~pad[r]])
        assert ms.is_causal == all(ms.segment_parent[g] < 0 and ms.segment_start[g] == 0
                                   for g in range(len(ms.segment_start)))
        if cfg.layout == "pad" and not cfg.tree:
            assert ms.is_causal
    in_E = {eid for eid, n in L.items() if n > 0}
    assert set(counted) == in_E and all(v == 1 for v in counted.values())
    for ms in ms_list:
        for e, eid in enumerate(ms.execution_ids):
            assert bool(ms.split[e]) == (len(where[eid]) > 1)
    st_ = res.stats
    assert st_.micro_steps == len(ms_list) and st_.executions == len(in_E)
    assert st_.real_tokens == sum(m.real_tokens for m in ms_list) <= st_.forward_tokens
    assert st_.row_tokens == sum(m.row_tokens for m in ms_list)
    assert st_.split_executions == sum(1 for v in where.values() if len(v) > 1)
    if not cfg.tree:
        assert st_.real_tokens == st_.row_tokens
    if ms_list:
        assert abs(st_.efficiency - st_.real_tokens / (len(ms_list) * cfg.token_budget)) < 1e-12


def small_batch():
    shared = list(range(100, 120))
    return [
        row("a", shared + [1, 2, 3, 4], [21, 22, 23], L=6, A=1.0),
        row("a", shared[:12] + [7, 8, 9], [13, 14], L=6, A=1.0),
        row("a", [5, 6, 7], [2], L=6, A=1.0),
        row("b", [9, 9, 9, 9, 9, 9], [3, 5], L=2, A=-0.5),
        row("c", [3, 1, 4, 1, 5, 9, 2, 6], [1], L=1, A=0.25),
        row("d", [1, 2, 3], [], L=0, A=0.0),  # no target: dropped, not in E
    ]


@pytest.mark.parametrize("layout, tree", LAYOUTS)
@pytest.mark.parametrize("budget", [24, 40, 1000])
def test_small_batch_invariants(layout, tree, budget):
    rows = small_batch()
    cfg = PackingConfig(budget, layout, tree)
    res = pack_rows(rows, cfg)
    check_invariants(rows, res, cfg)
    assert res.stats.dropped_rows == 1 and res.stats.targets == 9


def test_tree_shares_the_prefix_once():
    rows = small_batch()
    flat = pack_rows(rows, PackingConfig(1000, "pack")).stats
    tree = pack_rows(rows, PackingConfig(1000, "pack", tree=True)).stats
    # rows cut after their last target's predecessor: a: 23 + 14 + 2, b: 5, c: 1
    assert flat.row_tokens == flat.real_tokens == 23 + 14 + 2 + 5 + 1
    # a's second row shares 12 tokens with its first
    assert tree.real_tokens == flat.real_tokens - 12 and tree.tokens_saved == 12
    assert tree.forward_token_ratio == tree.real_tokens / tree.row_tokens


def test_execution_kept_together_when_it_fits_else_split():
    rows = small_batch()
    # a needs 39 tokens (pack); with budget 40 it stays whole, with 24 it is split
    res = pack_rows(rows, PackingConfig(40, "pack"))
    assert res.stats.split_executions == 0
    res = pack_rows(rows, PackingConfig(24, "pack"))
    split = {eid for ms in res.micro_steps for e, eid in enumerate(ms.execution_ids) if ms.split[e]}
    assert split == {"a"}
    assert all(np.isnan(ms.log_ratio_sum).all() for ms in res.micro_steps)


def test_pad_layout_shapes():
    res = pack_rows(small_batch(), PackingConfig(1000, "pad"))
    (ms,) = res.micro_steps
    assert ms.shape == (5, 23)
    assert res.stats.forward_tokens == 5 * 23 and res.stats.padding_fraction == 1 - 45 / 115


def test_deterministic():
    a = pack_rows(small_batch(), PackingConfig(24, "pack", True)).micro_steps
    b = pack_rows(small_batch(), PackingConfig(24, "pack", True)).micro_steps
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.target_index, y.target_index)


@pytest.mark.parametrize("rows, match", [
    ([row("a", list(range(50)), [49], L=1)], "budget"),
    ([row("a", [1, 2, 3], [0], L=1)], "position 0"),
    ([row("a", [1, 2, 3], [1], L=2)], "missing"),
    ([row("a", [1, 2, 3], [1], L=2), row("a", [1, 2], [1], L=3)], "disagree on L_i"),
    ([row("a", [1, 2, 3], [1], L=2, A=1.0), row("a", [1, 2], [1], L=2, A=0.5)], "advantage"),
    ([row("a", [1, 2, 3], [1], L=1, A=float("nan"))], "advantage"),
])
def test_bad_rows_are_clear_errors(rows, match):
    with pytest.raises(ValueError, match=match):
        MicroStepPacker(PackingConfig(20, "pack")).pack(rows)


def test_config_validation_and_from_args():
    with pytest.raises(ValueError):
        PackingConfig(0)
    with pytest.raises(ValueError):
        PackingConfig(10, "ragged")
    from gyre.arguments import parse_args

    cfg = PackingConfig.from_args(parse_args(["--micro-step-tokens", "512", "--packing", "pack", "--tree-packed-forward"]))
    assert (cfg.token_budget, cfg.layout, cfg.tree) == (512, "pack", True)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(LAYOUTS), st.integers(0, 12), st.integers(0, 1000))
def test_random_trees_every_target_sees_its_context(data, layout_tree, slack, seed):
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    rng = np.random.default_rng(seed)
    rows = []
    for e in range(draw_int(1, 3)):
        tree = TrajectoryTree(f"ex-{e}")
        for r in random_execution(draw_int, draw_int(1, 8)):
            r.execution_id = f"ex-{e}"
            r.input_ids = np.concatenate([[7], r.input_ids]).astype(np.int32)  # no target at position 0
            r.input_provenance = np.concatenate([[0], r.input_provenance]).astype(np.int8)
            tree.insert(r)
        adm = sample_trajectories(tree, rng, AdmissionConfig(j_max=draw_int(1, 4)))
        rows += materialize(tree, adm, float(rng.normal()))
    if not rows:
        return
    budget = max(r.num_tokens for r in rows) + slack  # any single row fits; executions may not
    cfg = PackingConfig(budget, *layout_tree)
    res = pack_rows(rows, cfg)
    check_invariants(rows, res, cfg)
