"""Admission sampling: exact cases, properties, and a seeded chi-square test."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.trajectory import (
    AdmissionConfig,
    Provenance,
    TrajectoryTree,
    node_trainable_mask,
    sample_trajectories,
    trainable_counts,
)

from .helpers import EVL, EXT, POL, examples, random_execution, rec

SYS = [1, 2, 3]
USER = [4, 5]


def compaction_tree() -> TrajectoryTree:
    """Nodes: 5=[1,2,3]; 1=[4,5|10,11]; 2=[6,7|12,13]; 3=[8|14]; 4=[90,91|50,51,52] (compaction);
    6=[93,50,51,52|15] (main, new context after compaction)."""
    tree = TrajectoryTree()
    tree.insert(rec(0, SYS + USER, [10, 11]))
    tree.insert(rec(1, SYS + USER + [10, 11, 6, 7], [12, 13]))
    tree.insert(rec(2, SYS + USER + [10, 11, 6, 7, 12, 13, 8], [14]))
    tree.insert(rec(3, SYS + USER + [10, 11, 6, 7, 12, 13, 8, 14, 90, 91], [50, 51, 52], role="compaction"))
    tree.insert(rec(4, SYS + [93, 50, 51, 52], [15], prov=[EXT] * 4 + [POL] * 3))
    return tree


def test_compaction_tree_admission_exact():
    tree = compaction_tree()
    assert trainable_counts(tree).tolist() == [0, 2, 2, 1, 3, 0, 1]
    adm = sample_trajectories(tree, np.random.default_rng(0))
    # main first (its only leaf is the compacted context), then the compaction leaf whose
    # path still holds the unmasked main-agent outputs of the old context
    assert [(t.leaf, t.role, t.path, t.target_nodes, t.num_targets) for t in adm.trajectories] == [
        (6, "main", (5, 6), (6,), 1),
        (4, "compaction", (5, 1, 2, 3, 4), (1, 2, 3, 4), 8),
    ]
    assert adm.num_targets == 9 and adm.trainable_tokens == 9
    # J_max = 1 keeps only the main trajectory
    adm1 = sample_trajectories(tree, np.random.default_rng(0), AdmissionConfig(j_max=1))
    assert [t.leaf for t in adm1.trajectories] == [6] and adm1.num_targets == 1
    # compaction ranked first
    cfg = AdmissionConfig(role_priority=("compaction", "main"))
    adm2 = sample_trajectories(tree, np.random.default_rng(0), cfg)
    assert [(t.leaf, t.num_targets) for t in adm2.trajectories] == [(4, 8), (6, 1)]


def test_policy_tokens_in_input_are_never_targets():
    tree = compaction_tree()
    # node 6 holds the summary (policy provenance, reused in a new context) and one output
    assert tree.nodes[6].provenance.tolist() == [EXT, POL, POL, POL, POL]
    assert node_trainable_mask(tree, 6).tolist() == [False, False, False, False, True]


def test_undelivered_outputs_not_trainable_by_default():
    tree = TrajectoryTree()
    a = SYS + USER
    tree.insert(rec(0, a, [60, 61, 62], delivered=False))
    tree.insert(rec(1, a, [63, 64]))
    assert trainable_counts(tree).tolist() == [0, 0, 0, 2]
    adm = sample_trajectories(tree, np.random.default_rng(0))
    assert [(t.leaf, t.num_targets) for t in adm.trajectories] == [(3, 2)]
    cfg = AdmissionConfig(include_undelivered=True)
    assert trainable_counts(tree, cfg).tolist() == [0, 3, 0, 2]
    adm = sample_trajectories(tree, np.random.default_rng(0), cfg)
    assert sorted((t.leaf, t.num_targets) for t in adm.trajectories) == [(1, 3), (3, 2)]


def test_evaluator_never_trainable():
    tree = TrajectoryTree()
    tree.insert(rec(0, [700, 701], [702, 703], role="evaluator"))
    tree.insert(rec(1, SYS, [10], prov=None))
    tree.insert(rec(2, SYS + [10, 702, 703], [11], prov=[EXT] * 3 + [POL, EVL, EVL]))
    assert tree.nodes[1].provenance.tolist() == [EXT, EXT, EVL, EVL]
    assert trainable_counts(tree).tolist() == [0, 0, 1, 1]
    adm = sample_trajectories(tree, np.random.default_rng(0), AdmissionConfig(j_max=None))
    assert [(t.leaf, t.num_targets) for t in adm.trajectories] == [(3, 2)]
    with pytest.raises(ValueError, match="evaluator"):
        AdmissionConfig(role_priority=("main", "evaluator"))


@pytest.mark.parametrize(
    "kwargs",
    [{"j_max": 0}, {"j_max": 1.5}, {"role_priority": ("main", "main")}, {"role_priority": ("boss",)}],
)
def test_admission_config_errors(kwargs):
    with pytest.raises(ValueError):
        AdmissionConfig(**kwargs)


def test_empty_tree_admits_nothing():
    adm = sample_trajectories(TrajectoryTree("e"), np.random.default_rng(0))
    assert adm.trajectories == [] and adm.num_targets == 0 and adm.execution_id == "e"


# --------------------------------------------------------------------- properties


def _expected_trainable(tree: TrajectoryTree, cfg: AdmissionConfig) -> set[tuple[int, int]]:
    """Trainable token identities (node, offset), computed from records and leaf paths, not
    by the sampler: policy outputs of delivered (or included) records of a listed role that
    lie on the path of some leaf of a listed role."""
    on_eligible_path = {n for leaf in tree.leaves() if tree.role(leaf) in cfg.role_priority for n in tree.path(leaf)}
    out = set()
    for nd in tree.nodes[1:]:
        r = tree.records[nd.record]
        if nd.node_id in on_eligible_path and r.role in cfg.role_priority and (r.delivered or cfg.include_undelivered):
            for k in range(nd.n_input, nd.num_tokens):
                if nd.provenance[k] == Provenance.POLICY:
                    out.add((nd.node_id, k))
    return out


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.data(),
    st.integers(1, 14),
    st.sampled_from([1, 2, 3, None]),
    st.booleans(),
    st.permutations(["main", "subagent", "compaction", "auxiliary"]),
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
)
def test_sampling_properties(data, n_records, j_max, include_undelivered, perm, n_roles, seed):
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    tree = TrajectoryTree()
    for r in random_execution(draw_int, n_records):
        tree.insert(r)
    cfg = AdmissionConfig(j_max=j_max, role_priority=tuple(perm[:n_roles]), include_undelivered=include_undelivered)
    adm = sample_trajectories(tree, np.random.default_rng(seed), cfg)
    trainable = _expected_trainable(tree, cfg)
    rank = {r: i for i, r in enumerate(cfg.role_priority)}

    # J_i <= J_max
    assert j_max is None or len(adm.trajectories) <= j_max
    seen: set[tuple[int, int]] = set()
    masked: set[int] = set()
    for t in adm.trajectories:
        assert t.path == tuple(tree.path(t.leaf)) and not tree.nodes[t.leaf].children
        assert t.role == tree.role(t.leaf)
        # role priority: no leaf of a higher class had unmasked trainable tokens at this draw
        for leaf in tree.leaves():
            r = tree.role(leaf)
            if r in rank and rank[r] < rank[t.role]:
                left = [(n, k) for n in tree.path(leaf) if n not in masked for (m, k) in trainable if m == n]
                assert not left
        targets = {(n, k) for (n, k) in trainable if n in t.target_nodes}
        # the targets are exactly the trainable tokens still unmasked on the path
        assert targets == {(n, k) for (n, k) in trainable if n in t.path and n not in masked}
        assert len(targets) == t.num_targets >= 1
        # each target is a policy output token of its path
        for n, k in targets:
            nd = tree.nodes[n]
            assert n in t.path and k >= nd.n_input and nd.provenance[k] == Provenance.POLICY
        # disjoint target sets
        assert not (targets & seen)
        seen |= targets
        masked |= set(t.path)
    assert adm.num_targets == len(seen)
    assert adm.trainable_tokens == len(trainable)
    # stopping rule: either J_max reached or no eligible leaf has an unmasked trainable token
    if j_max is None or len(adm.trajectories) < j_max:
        for leaf in tree.leaves():
            if tree.role(leaf) in rank:
                assert not [1 for n in tree.path(leaf) if n not in masked for (m, _) in trainable if m == n]
    # with J_max = infinity, the union of the targets is the whole trainable set
    if j_max is None:
        assert seen == trainable
    assert int(trainable_counts(tree, cfg).sum()) == len(trainable)


def test_union_of_targets_is_all_trainable_tokens_with_unbounded_j_max():
    """J_max = ∞ on larger random trees whose leaves all have trainable roles."""
    rng = np.random.default_rng(7)
    for _ in range(30):
        draw_int = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
        tree = TrajectoryTree()
        for r in random_execution(draw_int, 30, roles=("main", "subagent", "compaction", "auxiliary")):
            tree.insert(r)
        cfg = AdmissionConfig(j_max=None, include_undelivered=bool(rng.integers(2)))
        adm = sample_trajectories(tree, rng, cfg)
        union = {(n, k) for t in adm.trajectories for n in t.target_nodes
                 for k in np.flatnonzero(node_trainable_mask(tree, n, cfg)).tolist()}
        every = {(nd.node_id, k) for nd in tree.nodes[1:] for k in range(nd.n_input, nd.num_tokens)
                 if tree.records[nd.record].delivered or cfg.include_undelivered}
        assert union == every
        assert adm.num_targets == len(union)


# --------------------------------------------------------------------- statistics

CHI2_DF3_P001 = 16.266  # chi-square critical value, 3 degrees of freedom, alpha = 0.001
CHI2_DF2_P001 = 13.816


def _stat_tree() -> tuple[TrajectoryTree, list[int]]:
    """A shared prefix with 5 trainable tokens and four main leaves with 10/20/30/40 more, plus
    a sub-agent leaf with 100 (never drawn while main leaves have work)."""
    tree = TrajectoryTree()
    head = list(range(100, 105))
    tree.insert(rec(0, [1, 2], head))
    leaves = []
    for i, n in enumerate((10, 20, 30, 40)):
        res = tree.insert(rec(1 + i, [1, 2] + head + [50 + i], list(range(200, 200 + n))))
        leaves.append(res.node)
    tree.insert(rec(5, [9], list(range(300, 400)), role="subagent"))
    return tree, leaves


def _chi2(observed: np.ndarray, p: np.ndarray) -> float:
    exp = p * observed.sum()
    return float(((observed - exp) ** 2 / exp).sum())


def test_leaves_drawn_proportional_to_unmasked_count():
    tree, leaves = _stat_tree()
    rng = np.random.default_rng(20240611)
    cfg = AdmissionConfig(j_max=2)
    first = np.zeros(4)
    second_after_last = np.zeros(3)
    n = 3000
    for _ in range(n):
        adm = sample_trajectories(tree, rng, cfg)
        a, b = adm.trajectories
        assert a.role == b.role == "main"
        first[leaves.index(a.leaf)] += 1
        if a.leaf == leaves[3]:
            # the shared prefix is masked now: the rest are drawn by their own counts
            assert b.num_targets == {leaves[0]: 10, leaves[1]: 20, leaves[2]: 30}[b.leaf]
            second_after_last[leaves.index(b.leaf)] += 1
    p_first = np.array([15, 25, 35, 45]) / 120
    assert _chi2(first, p_first) < CHI2_DF3_P001
    assert _chi2(second_after_last, np.array([10, 20, 30]) / 60) < CHI2_DF2_P001
    # the test has power: uniform drawing (or drawing by own counts only) would be rejected
    assert _chi2(first, np.full(4, 0.25)) > 10 * CHI2_DF3_P001
    assert _chi2(first, np.array([10, 20, 30, 40]) / 100) > CHI2_DF3_P001


def test_tokens_only_on_paths_to_unlisted_roles_are_not_trainable():
    tree = compaction_tree()
    cfg = AdmissionConfig(role_priority=("main",), j_max=None)
    # node 3 (main output) and nodes 1, 2 lead only to the compaction leaf
    assert trainable_counts(tree, cfg).tolist() == [0, 0, 0, 0, 0, 0, 1]
    adm = sample_trajectories(tree, np.random.default_rng(0), cfg)
    assert adm.num_targets == adm.trainable_tokens == 1
