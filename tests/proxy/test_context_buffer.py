"""Context buffers: each input a prefix of its thread's buffer, written in place after the
previous one, and the tree keeping views of it instead of copies (gyre/proxy/context_buffer.py,
TrajectoryTree.insert(share_input=True), TitoSession)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from gyre.proxy.context_buffer import MIN_SPARE_TOKENS, write_input
from gyre.proxy.messages import Message
from gyre.proxy.tito import TitoSession
from gyre.trajectory import RequestRecord, TrajectoryTree

from .test_tito import chat, enc, turn

IM_END = 151645


def parts(*runs):
    """(ids parts, provenance parts) from (start, length, provenance) runs of consecutive ids."""
    return ([np.arange(s, s + n, dtype=np.int32) for s, n, _ in runs],
            [np.full(n, p, np.int8) for _, n, p in runs])


def test_a_new_input_gets_a_buffer_with_spare_room_and_read_only_views():
    ids, prov = parts((0, 10, 0), (100, 5, 2))
    x, xp, buf, replaced = write_input(ids, prov)
    assert x.tolist() == list(range(10)) + list(range(100, 105)) and xp.tolist() == [0] * 10 + [2] * 5
    assert buf.used == 15 and buf.capacity == 15 + MIN_SPARE_TOKENS and replaced is None
    assert x.base is buf.ids and xp.base is buf.prov
    with pytest.raises(ValueError):
        x[0] = 1


def test_continuing_the_latest_input_writes_after_it_in_place():
    x1, p1, buf, _ = write_input(*parts((0, 10, 0)))
    ids, prov = parts((500, 3, 1), (700, 4, 0))
    x2, p2, buf2, replaced = write_input([x1] + ids, [p1] + prov, buf, 10)
    assert buf2 is buf and replaced is None and buf.used == 17
    assert x2.tolist() == list(range(10)) + [500, 501, 502, 700, 701, 702, 703]
    assert p2.tolist() == [0] * 10 + [1] * 3 + [0] * 4
    assert x1.tolist() == list(range(10))  # the earlier input is unchanged


def test_a_second_continuation_of_the_same_input_gets_its_own_buffer():
    """Two requests continuing the same input (a retry with another last message, parallel
    calls): the first is written in place, the second may not overwrite it and is copied."""
    x1, p1, buf, _ = write_input(*parts((0, 10, 0)))
    a, pa, buf_a, _ = write_input([x1, np.array([7, 7], np.int32)], [p1, np.zeros(2, np.int8)], buf, 10)
    b, pb, buf_b, replaced = write_input([x1, np.array([9], np.int32)], [p1, np.zeros(1, np.int8)], buf, 10)
    assert buf_a is buf and buf_b is not buf and replaced is buf.ids
    assert a.tolist() == list(range(10)) + [7, 7] and b.tolist() == list(range(10)) + [9]
    assert x1.tolist() == list(range(10))


def test_a_full_buffer_is_carried_into_a_larger_one():
    x1, p1, buf, _ = write_input(*parts((0, 100, 2)))
    more = MIN_SPARE_TOKENS + 1
    x2, p2, buf2, replaced = write_input([x1, np.full(more, 5, np.int32)], [p1, np.ones(more, np.int8)], buf, 100)
    assert buf2 is not buf and replaced is buf.ids
    assert buf2.capacity == (100 + more) + max((100 + more) // 4, MIN_SPARE_TOKENS)
    assert x2.tolist() == list(range(100)) + [5] * more and p2.tolist() == [2] * 100 + [1] * more
    assert x1.tolist() == list(range(100))


def _record(call, x, xp, out):
    return RequestRecord(execution_id="e", call_index=call, role="main", input_ids=x, input_provenance=xp,
                         output_ids=np.asarray(out, np.int32), output_logprobs=np.full(len(out), -0.1, np.float32))


def _thread(tree, n_calls, first, prev=None, buf=None, prefix=None, new=50, out=20):
    """A thread of ``n_calls`` calls, each continuing the previous input and output whole; the
    first continues ``prev`` (in ``buf``, or copied into a new buffer when ``buf`` is None), or
    starts a new buffer with ``prefix`` (ids, provenance)."""
    recs = []
    for k in range(n_calls):
        fresh = (np.arange(new, dtype=np.int32) + first + 1000 * k, np.zeros(new, np.int8))
        if prev is not None:
            o = prev.output_ids
            x, xp, buf, replaced = write_input([prev.input_ids, o, fresh[0]],
                                               [prev.input_provenance, np.ones(len(o), np.int8), fresh[1]],
                                               buf, prev.input_ids.shape[0])
        else:
            head = [prefix] if prefix is not None else []
            x, xp, buf, replaced = write_input([h[0] for h in head] + [fresh[0]], [h[1] for h in head] + [fresh[1]])
        r = _record(len(tree.records), x, xp, np.arange(out, dtype=np.int32) + first + 1000 * k + 500)
        tree.insert(r, share_input=True, replaces=replaced)
        recs.append(r)
        prev = r
    return recs, buf


def _copy(records):
    plain = TrajectoryTree()
    for r in records:
        plain.insert(r)
    return plain


def _viewing(tree, buf):
    return {nd.node_id for nd in tree.nodes if nd.tokens.base is buf.ids}


def test_a_thread_in_one_buffer_is_held_once_by_the_tree():
    tree = TrajectoryTree()
    recs, buf = _thread(tree, 30, 0)  # outgrows its spare room several times
    tip = tree.record_node(recs[-1].call_index)
    path = tree.path(tip)
    assert len(path) == 30
    # every node but the last call's views the thread's current buffer
    assert _viewing(tree, buf) == set(path[:-1])
    assert tree.nodes[tip].tokens.base is None and not tree.nodes[tip].shared
    plain = _copy(recs)
    assert tree.digest() == plain.digest()
    # the ids are held once, in the buffer: the tree adds only the tip's own ids to it
    shared_ids = 4 * (tree.num_tokens - tree.nodes[tip].num_tokens)
    assert tree.nbytes() == buf.ids.nbytes + plain.nbytes() - shared_ids


def test_a_grown_buffer_leaves_no_old_buffer_alive():
    tree = TrajectoryTree(anchor_slots=1)
    recs, buf = _thread(tree, 3, 0, new=400)
    old = weakref.ref(buf.ids)
    more, buf2 = _thread(tree, 6, 50_000, prev=recs[-1], buf=buf, new=400)
    assert buf2 is not buf
    del recs, buf
    gc.collect()
    assert old() is None
    assert _viewing(tree, buf2) == set(tree.path(tree.record_node(more[-1].call_index))[:-1])


def test_a_branch_forked_deep_in_a_context_keeps_its_own_arrays():
    """A sub-agent forked from a long context: its buffer repeats that context, so the tree keeps
    the branch's own tokens instead of views that would keep the copy alive. A thread joining
    near the root (a shared system prompt) is held in views of its own buffer."""
    tree = TrajectoryTree()
    main, main_buf = _thread(tree, 6, 0)
    fork, fork_buf = _thread(tree, 4, 90_000, prev=main[-1])  # copies main's whole context
    assert _viewing(tree, fork_buf) == set()
    main_path = tree.path(tree.record_node(main[-1].call_index))
    assert _viewing(tree, main_buf) == set(main_path[:-1])
    prefix = (main[0].input_ids[:10], main[0].input_provenance[:10])
    side, side_buf = _thread(tree, 4, 70_000, prefix=prefix, new=200)
    side_path = tree.path(tree.record_node(side[-1].call_index))
    head = side_path[0]  # the 10 shared tokens stay where they are
    assert tree.nodes[head].end == 10 and tree.nodes[head].tokens.base is main_buf.ids
    assert _viewing(tree, side_buf) == set(side_path[1:-1])
    assert tree.digest() == _copy(main + fork + side).digest()


def test_one_call_branches_keep_no_buffer_alive():
    """Ten one-call branches joining a thread near its start, then the thread goes on: no
    branch's buffer stays alive, and the tree holds about what a tree of copies holds (one
    anchor, so that the insert index keeps no branch's input either)."""
    tree, plain = TrajectoryTree(anchor_slots=1), TrajectoryTree(anchor_slots=1)
    main, main_buf = _thread(tree, 20, 0, new=2000)
    for r in main:
        plain.insert(r)
    weak = []
    for k in range(10):
        at = 6000 - 500 * k
        prefix = (main[-1].input_ids[:at], main[-1].input_provenance[:at])
        branch, buf = _thread(tree, 1, 200_000 + 10_000 * k, prefix=prefix, new=4 * at)
        plain.insert(branch[0])
        weak.append(weakref.ref(buf.ids))
        del branch, buf
    more, main_buf = _thread(tree, 3, 500_000, prev=main[-1], buf=main_buf, new=2000)
    for r in more:
        plain.insert(r)
    gc.collect()
    assert all(w() is None for w in weak)
    # the main thread's buffer (with its spare room) instead of its nodes' own arrays
    assert tree.nbytes() <= plain.nbytes() + main_buf.ids.nbytes


def test_the_first_part_must_be_the_kept_prefix():
    x1, p1, buf, _ = write_input(*parts((0, 10, 0)))
    with pytest.raises(ValueError, match="kept prefix"):
        write_input([], [], buf, 10)
    with pytest.raises(ValueError, match="kept prefix"):
        write_input([x1.copy(), np.ones(2, np.int32)], [p1, np.zeros(2, np.int8)], buf, 10)
    assert buf.used == 10 and x1.tolist() == list(range(10))


def test_a_session_keeps_each_thread_once(qwen_renderer):
    """Through TitoSession: a main agent of 12 calls; every node on its path but the last views
    the buffer its latest input lives in, and the tree matches one built from copies."""
    r = qwen_renderer
    s = TitoSession("e", r)
    conv = [Message("system", "sys"), Message("user", "task")]
    records = []
    for k in range(12):
        p, rec, msg = turn(s, chat(*conv), enc(r, f"step {k}") + [IM_END])
        records.append(rec)
        conv += [msg, Message("user", f"result {k} " + "y" * (300 * k))]
    assert p.reused_tokens > 0 and rec.input_ids.base is p.buffer.ids
    path = s.tree.path(s.tree.record_node(rec.call_index))
    assert _viewing(s.tree, p.buffer) == set(path[:-1])
    assert s.tree.digest() == _copy(records).digest()


def test_a_thread_read_back_from_the_tree_shares_again(qwen_renderer):
    """A main agent and two sub-agents taking turns with a one-record cache: each thread's
    record leaves the cache, so every input is read back from the tree. The read-back is put in
    a buffer the input continues in place, the tree's views move to it, and each thread's path
    views its latest buffer."""
    r = qwen_renderer
    s = TitoSession("e", r, recent_records=1)
    convs = [[Message("system", f"agent {a}"), Message("user", f"task {a}")] for a in range(3)]
    records, last = [], {}
    for k in range(5):
        for a, conv in enumerate(convs):
            p, rec, msg = turn(s, chat(*conv), enc(r, f"agent {a} step {k}") + [IM_END])
            records.append(rec)
            last[a] = p
            conv += [msg, Message("user", f"result {a}.{k} " + "z" * 200)]
    for a, p in last.items():
        path = s.tree.path(s.tree.record_node(records[-3 + a].call_index))
        # all but the tip; the 5 tokens every thread starts with view one of the buffers
        assert _viewing(s.tree, p.buffer) - {path[0]} == set(path[1:-1])
        assert s.tree.nodes[path[0]].end == 5 and s.tree.nodes[path[0]].shared
    assert s.tree.digest() == _copy(records).digest()
