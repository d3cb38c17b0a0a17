"""Trajectory tree: exact structures for the agent patterns (compaction, sub-agents, edited
outputs, retries), plus properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.trajectory import ROOT, InsertResult, TrajectoryTree

from .helpers import EVL, EXT, POL, examples, full, lp_for, random_execution, rec

SYS = [1, 2, 3]
USER = [4, 5]


def struct(tree: TrajectoryTree) -> dict[int, tuple[int, int, list[int], int, list[int]]]:
    """node id -> (parent, start, tokens, n_input, children)."""
    return {
        nd.node_id: (nd.parent, nd.start, nd.tokens.tolist(), nd.n_input, list(nd.children))
        for nd in tree.nodes[1:]
    }


def linear_records():
    r0 = rec(0, SYS + USER, [10, 11])
    r1 = rec(1, SYS + USER + [10, 11, 6, 7], [12, 13], prov=[EXT] * 5 + [POL, POL] + [EXT] * 2)
    r2 = rec(2, SYS + USER + [10, 11, 6, 7, 12, 13, 8], [14], prov=[EXT] * 5 + [POL] * 2 + [EXT] * 2 + [POL] * 2 + [EXT])
    return [r0, r1, r2]


def test_linear_agent_loop_is_one_path():
    tree = TrajectoryTree()
    results = [tree.insert(r) for r in linear_records()]
    assert results == [
        InsertResult(node=1, parent=0, matched_tokens=0, new_tokens=7, split=None),
        InsertResult(node=2, parent=1, matched_tokens=7, new_tokens=4, split=None),
        InsertResult(node=3, parent=2, matched_tokens=11, new_tokens=2, split=None),
    ]
    assert struct(tree) == {
        1: (0, 0, [1, 2, 3, 4, 5, 10, 11], 5, [2]),
        2: (1, 7, [6, 7, 12, 13], 2, [3]),
        3: (2, 11, [8, 14], 1, []),
    }
    assert tree.leaves() == [3]
    assert tree.path(3) == [1, 2, 3]
    assert tree.path_tokens(3).tolist() == [1, 2, 3, 4, 5, 10, 11, 6, 7, 12, 13, 8, 14]
    assert tree.path_provenance(3).tolist() == [EXT] * 5 + [POL] * 2 + [EXT] * 2 + [POL] * 2 + [EXT, POL]
    assert tree.path_output_mask(3).tolist() == [False] * 5 + [True] * 2 + [False] * 2 + [True] * 2 + [False, True]
    np.testing.assert_array_equal(
        tree.path_logprobs(3),
        np.array([0] * 5 + lp_for([10, 11]) + [0, 0] + lp_for([12, 13]) + [0] + lp_for([14]), np.float32),
    )
    assert tree.num_tokens == 13
    assert [tree.record_node(i) for i in range(3)] == [1, 2, 3]
    assert tree.execution_id == "exec-1"


def test_compaction_call_and_compacted_context_branch():
    tree = TrajectoryTree()
    for r in linear_records():
        tree.insert(r)
    path = tree.path_tokens(3).tolist()
    # the compaction call sees the whole history plus a "summarise" request -> child of the leaf
    res = tree.insert(rec(3, path + [90, 91], [50, 51, 52], role="compaction"))
    assert res == InsertResult(node=4, parent=3, matched_tokens=13, new_tokens=5, split=None)
    # the main agent continues in a new context: system prompt + summary (policy tokens reused
    # verbatim, but in a new context) -> branch right after the system prompt
    res = tree.insert(rec(4, SYS + [93, 50, 51, 52], [15], prov=[EXT] * 4 + [POL] * 3))
    assert res == InsertResult(node=6, parent=5, matched_tokens=3, new_tokens=5, split=5)
    assert struct(tree) == {
        1: (5, 3, [4, 5, 10, 11], 2, [2]),
        2: (1, 7, [6, 7, 12, 13], 2, [3]),
        3: (2, 11, [8, 14], 1, [4]),
        4: (3, 13, [90, 91, 50, 51, 52], 2, []),
        5: (0, 0, [1, 2, 3], 3, [1, 6]),
        6: (5, 3, [93, 50, 51, 52, 15], 4, []),
    }
    assert tree.nodes[ROOT].children == [5]
    assert tree.leaves() == [4, 6]
    assert [tree.role(n) for n in (4, 6)] == ["compaction", "main"]
    assert tree.nodes[6].provenance.tolist() == [EXT, POL, POL, POL, POL]
    # the split head keeps its owner (call 0); the original node keeps its identity and end
    assert tree.owner(5).call_index == 0 and tree.record_node(0) == 1 and tree.nodes[1].end == 7
    assert tree.nodes[1].logprobs.tolist() == pytest.approx(lp_for([10, 11]))
    assert tree.nodes[5].logprobs.shape == (0,)


def test_subagent_fresh_context_is_a_root_branch():
    tree = TrajectoryTree()
    for r in linear_records():
        tree.insert(r)
    res = tree.insert(rec(3, [200, 201, 202], [210, 211], role="subagent"))
    assert res == InsertResult(node=4, parent=ROOT, matched_tokens=0, new_tokens=5, split=None)
    res = tree.insert(rec(4, [200, 201, 202, 210, 211, 203], [212], role="subagent"))
    assert res == InsertResult(node=5, parent=4, matched_tokens=5, new_tokens=2, split=None)
    assert tree.nodes[ROOT].children == [1, 4]
    assert tree.leaves() == [3, 5]
    # the main agent resumes: its anchor is found again, no split of the sub-agent
    res = tree.insert(rec(5, tree.path_tokens(3).tolist() + [9], [16]))
    assert res == InsertResult(node=6, parent=3, matched_tokens=13, new_tokens=2, split=None)


def test_subagent_with_shared_system_prompt_branches_after_it():
    tree = TrajectoryTree()
    tree.insert(rec(0, SYS + USER, [10, 11]))
    res = tree.insert(rec(1, SYS + [300], [301], role="subagent"))
    assert res == InsertResult(node=3, parent=2, matched_tokens=3, new_tokens=2, split=2)
    assert struct(tree) == {
        1: (2, 3, [4, 5, 10, 11], 2, []),
        2: (0, 0, [1, 2, 3], 3, [1, 3]),
        3: (2, 3, [300, 301], 1, []),
    }


def test_think_stripping_branches_at_first_output_token():
    tree = TrajectoryTree()
    think = [100, 101, 102, 103]  # <think> ... </think>
    tree.insert(rec(0, SYS + USER, think + [20, 21]))
    res = tree.insert(rec(1, SYS + USER + [20, 21, 6], [22]))
    assert res == InsertResult(node=3, parent=2, matched_tokens=5, new_tokens=4, split=2)
    assert struct(tree) == {
        1: (2, 5, [100, 101, 102, 103, 20, 21], 0, []),
        2: (0, 0, [1, 2, 3, 4, 5], 5, [1, 3]),
        3: (2, 5, [20, 21, 6, 22], 3, []),
    }
    assert tree.nodes[1].logprobs.tolist() == pytest.approx(lp_for(think + [20, 21]))


def test_reserialised_tool_call_branches_at_exact_token():
    tree = TrajectoryTree()
    out = [30, 31, 32, 33, 34]  # <tool_call>{"a":1,"b":2}</tool_call>
    tree.insert(rec(0, SYS + USER, out))
    # the harness re-serialises the JSON: same first token, keys swapped afterwards
    res = tree.insert(rec(1, SYS + USER + [30, 32, 31, 33, 34, 7], [40]))
    assert res == InsertResult(node=3, parent=2, matched_tokens=6, new_tokens=6, split=2)
    assert struct(tree) == {
        1: (2, 6, [31, 32, 33, 34], 0, []),
        2: (0, 0, [1, 2, 3, 4, 5, 30], 5, [1, 3]),
        3: (2, 6, [32, 31, 33, 34, 7, 40], 5, []),
    }
    lps = lp_for(out)
    assert tree.nodes[2].logprobs.tolist() == pytest.approx(lps[:1])
    assert tree.nodes[1].logprobs.tolist() == pytest.approx(lps[1:])


@pytest.mark.parametrize("same_tokens", [False, True])
def test_retried_identical_request_gives_sibling_outputs(same_tokens):
    tree = TrajectoryTree()
    a = SYS + USER
    o1 = [60, 61, 62]
    o2 = o1 if same_tokens else [60, 63]
    tree.insert(rec(0, a, o1, delivered=False))  # the harness timed out and retried
    res = tree.insert(rec(1, a, o2))
    assert res == InsertResult(node=3, parent=2, matched_tokens=5, new_tokens=len(o2), split=2)
    assert struct(tree) == {
        1: (2, 5, o1, 0, []),
        2: (0, 0, a, 5, [1, 3]),
        3: (2, 5, o2, 0, []),
    }
    # the harness continues from the delivered response
    res = tree.insert(rec(2, a + o2 + [8], [70]))
    assert res.parent == 3 and res.matched_tokens == 5 + len(o2)


def test_ambiguous_sibling_outputs_resolved_exactly_from_an_anchor():
    # outputs of a retried request share their first token (<think>); the newest anchor is
    # the shorter sibling, yet the input extends the longer one
    tree = TrajectoryTree()
    a = SYS + USER
    tree.insert(rec(0, a, [100, 7, 8]))
    tree.insert(rec(1, a, [100], delivered=False))
    res = tree.insert(rec(2, a + [100, 7, 8, 9], [70]))
    assert res.parent == tree.record_node(0) and res.matched_tokens == 8
    assert (tree.nodes[1].amb_parent, tree.nodes[1].amb_child) == (2, 1)
    assert (tree.nodes[res.node].amb_parent, tree.nodes[res.node].amb_child) == (2, 1)


def test_tie_between_identical_outputs_prefers_delivered_on_root_walk():
    # anchor_slots=1 and an unrelated call in between force the walk from the root
    tree = TrajectoryTree(anchor_slots=1)
    a = SYS + USER
    tree.insert(rec(0, a, [60, 61], delivered=True))
    tree.insert(rec(1, a, [60, 61], delivered=False))
    tree.insert(rec(2, [500], [501], role="auxiliary"))
    res = tree.insert(rec(3, a + [60, 61, 9], [70]))
    assert res.parent == tree.record_node(0)
    tree2 = TrajectoryTree(anchor_slots=1)
    tree2.insert(rec(0, a, [60, 61], delivered=False))
    tree2.insert(rec(1, a, [60, 61], delivered=True))
    tree2.insert(rec(2, [500], [501], role="auxiliary"))
    assert tree2.insert(rec(3, a + [60, 61, 9], [70])).parent == tree2.record_node(1)


def test_request_ending_inside_a_node_and_empty_output():
    tree = TrajectoryTree()
    tree.insert(rec(0, SYS + USER, [10, 11]))
    # re-issue of a shorter request (ends inside node 1): split, node holds only the output
    res = tree.insert(rec(1, SYS + [4], [12]))
    assert res == InsertResult(node=3, parent=2, matched_tokens=4, new_tokens=1, split=2)
    # an empty output exactly at a node end: an empty leaf, never descended into
    res = tree.insert(rec(2, SYS + [4], []))
    assert res == InsertResult(node=4, parent=2, matched_tokens=4, new_tokens=0, split=None)
    res = tree.insert(rec(3, SYS + [4, 5, 10, 11, 6], [13]))
    assert res.parent == 1 and res.matched_tokens == 7
    assert tree.leaves() == [3, 4, 5]
    assert tree.nodes[4].num_tokens == 0 and tree.path_tokens(4).tolist() == [1, 2, 3, 4]


def test_mixed_roles_and_provenance():
    tree = TrajectoryTree()
    tree.insert(rec(0, SYS + USER, [10, 11]))
    tree.insert(rec(1, [400, 401], [402], role="auxiliary"))  # title generation
    tree.insert(rec(2, [700, 701], [702, 703], role="evaluator"))  # judge
    critique = [702, 703]
    ctx = SYS + USER + [10, 11] + [6] + critique
    tree.insert(rec(3, ctx, [12], prov=[EXT] * 5 + [POL, POL, EXT, EVL, EVL]))
    tree.insert(rec(4, ctx + [12, 7], [13], role="subagent", prov=[EXT] * 5 + [POL, POL, EXT, EVL, EVL, POL, EXT]))
    roles = {n: tree.role(n) for n in tree.leaves()}
    assert roles == {2: "auxiliary", 3: "evaluator", 5: "subagent"}
    assert tree.nodes[3].provenance.tolist() == [EXT, EXT, EVL, EVL]  # evaluator output
    assert tree.nodes[4].provenance.tolist() == [EXT, EVL, EVL, POL]
    assert tree.path(5) == [1, 4, 5]
    assert [tree.role(n) for n in tree.path(5)] == ["main", "main", "subagent"]


def test_insert_errors():
    tree = TrajectoryTree()
    tree.insert(rec(0, [1], [2]))
    with pytest.raises(ValueError, match="duplicate call_index"):
        tree.insert(rec(0, [1], [3]))
    with pytest.raises(ValueError, match="execution"):
        tree.insert(rec(1, [1], [3], eid="other"))
    with pytest.raises(ValueError):
        TrajectoryTree(anchor_slots=0)


def test_match_does_not_modify():
    tree = TrajectoryTree()
    for r in linear_records():
        tree.insert(r)
    before = tree.digest()
    m = tree.match(np.array([1, 2, 3, 4, 5, 10, 99], np.int32))
    assert (m.node, m.offset, m.depth) == (1, 6, 6)
    m = tree.match(np.array([1, 2, 3, 4, 5, 10, 11, 6, 7, 12, 13, 8, 14, 5], np.int32))
    assert (m.node, m.offset, m.depth) == (3, 2, 13)
    assert tree.match(np.array([9], np.int32)).depth == 0
    assert tree.digest() == before


def _brute_force_match(records, x: np.ndarray) -> int:
    """Longest prefix of x shared with any earlier record's input ++ output (every stored path
    prefix is a prefix of its owner's full sequence)."""
    best = 0
    for r in records:
        s = full(r)
        n = min(len(s), len(x))
        k = 0
        while k < n and s[k] == x[k]:
            k += 1
        best = max(best, k)
    return best


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(1, 14), st.sampled_from([1, 2, 8]))
def test_insert_properties(data, n_records, slots):
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    records = random_execution(draw_int, n_records)
    tree = TrajectoryTree(anchor_slots=slots)
    for i, r in enumerate(records):
        expected = _brute_force_match(records[:i], r.input_ids)
        res = tree.insert(r)
        # longest match, whatever the anchors
        assert res.matched_tokens == expected
        assert tree.nodes[res.node].start == expected
    for r in records:
        # every record's context and output are exactly a stored path
        assert tree.path_tokens(tree.record_node(r.call_index)).tolist() == full(r).tolist()
    total = 0
    for nd in tree.nodes[1:]:
        parent = tree.nodes[nd.parent]
        assert nd.start == parent.end
        assert nd.node_id in parent.children
        assert nd.logprobs.shape[0] == nd.num_output >= 0
        total += nd.num_tokens
        if nd.num_tokens == 0:
            assert not nd.children  # empty nodes are leaves
    assert total == tree.num_tokens
    # trie over inputs: siblings sharing a first token differ only as independent outputs
    for nd in tree.nodes:
        for first, kids in nd.index.items():
            assert all(int(tree.nodes[k].tokens[0]) == first for k in kids)
            assert sum(tree.nodes[k].n_input > 0 for k in kids) <= 1
    # canonical: rebuilding with any number of anchors gives the bit-identical tree
    again = TrajectoryTree(anchor_slots=9 - slots)
    for r in records:
        again.insert(r)
    assert again.digest() == tree.digest()
    # the ambiguity chain names the deepest ambiguous branching point above each node
    for nd in tree.nodes[1:]:
        expected = (-1, -1)
        for c in tree.path(nd.node_id):
            cn = tree.nodes[c]
            if cn.num_tokens and len(tree.nodes[cn.parent].index[int(cn.tokens[0])]) > 1:
                expected = (cn.parent, c)
        assert (nd.amb_parent, nd.amb_child) == expected


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(1, 14))
def test_sharing_input_views_changes_no_content(data, n_records):
    """``share_input``: nodes may become views of the records' inputs; the tree is bit-identical
    to one built with copies, every view shows the tokens it replaced and is read-only, and the
    records' arrays are not modified."""
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    records = random_execution(draw_int, n_records)
    before = [(r.input_ids.copy(), r.output_ids.copy()) for r in records]
    plain, shared = TrajectoryTree(), TrajectoryTree()
    for r in records:
        plain.insert(r)
        shared.insert(r, share_input=True)
        for a, b in zip(plain.nodes, shared.nodes):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert not b.shared or not b.tokens.flags.writeable
    assert shared.digest() == plain.digest()
    for r, (i, o) in zip(records, before):
        assert r.input_ids.tolist() == i.tolist() and r.output_ids.tolist() == o.tolist()
