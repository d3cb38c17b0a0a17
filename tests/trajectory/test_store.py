"""Durable record store: round trips, delta encoding, torn tails, fsync policy."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.trajectory import (
    RecordWriter,
    StoreCorruptError,
    TornTailWarning,
    TrajectoryStore,
    TrajectoryTree,
    load_tree,
    read_records,
)
from gyre.trajectory import store as store_mod

from .helpers import EXT, POL, examples, random_execution, rec


def agent_records():
    sys_ = [1, 2, 3, 4]
    r0 = rec(0, sys_, [10, 11, 12], version=1)
    r1 = rec(1, sys_ + [10, 11, 12, 5, 6], [13, 14], prov=[EXT] * 4 + [POL] * 3 + [EXT] * 2, version=1)
    r2 = rec(2, [900, 901], [902], role="subagent", delivered=False)
    r3 = rec(3, sys_ + [10, 11, 12, 5, 6, 13, 14, 7], [15], prov=[EXT] * 4 + [POL] * 3 + [EXT] * 2 + [POL] * 2 + [EXT])
    return [r0, r1, r2, r3]


def live_tree(records):
    tree = TrajectoryTree()
    for r in records:
        tree.insert(r)
    return tree


def lines(path):
    return path.read_bytes().split(b"\n")[:-1]


def payload(line: bytes) -> dict:
    return json.loads(line[: line.rfind(b',"crc":')] + b"}")


def test_round_trip_bit_identical(tmp_path):
    records = agent_records()
    path = tmp_path / "exec-1.jsonl"
    with RecordWriter(path) as w:
        assert [w.append(r) for r in records] == [0, 1, 2, 3]
    back = read_records(path)
    assert len(back) == 4 and all(a.same_as(b) for a, b in zip(records, back))
    assert load_tree(path).digest() == live_tree(records).digest()
    # delta encoding: call 1 stores only its new input tokens, based on call 0's full path
    objs = [payload(x) for x in lines(path)]
    assert [o["base"] for o in objs] == [None, [0, 7], None, [1, 11]]
    assert [o["n_in"] for o in objs] == [4, 9, 2, 12]


def test_delta_base_stops_at_provenance_change(tmp_path):
    path = tmp_path / "e.jsonl"
    with RecordWriter(path) as w:
        w.append(rec(0, [1, 2], [3, 4]))
        # same tokens, but the proxy marked the reused output as external: base covers the input only
        w.append(rec(1, [1, 2, 3, 4, 5], [6], prov=[EXT] * 5))
    assert [payload(x)["base"] for x in lines(path)] == [None, [0, 2]]
    assert read_records(path)[1].input_provenance.tolist() == [EXT] * 5


def test_thread_keeps_its_ring_slot_while_subagents_run(tmp_path):
    path = tmp_path / "e.jsonl"
    main = rec(0, list(range(100)), [100, 101])
    with RecordWriter(path, ring_size=2) as w:
        w.append(main)
        ctx = list(range(100)) + [100, 101]
        for i in range(5):  # a sub-agent of 5 calls, each extending the previous one
            w.append(rec(1 + i, [500 + j for j in range(i + 1)], [600 + i], role="subagent"))
        w.append(rec(6, ctx + [7], [8], prov=[EXT] * 100 + [POL] * 2 + [EXT]))
    objs = [payload(x) for x in lines(path)]
    assert objs[-1]["base"] == [0, 102]
    assert read_records(path)[-1].same_as(rec(6, ctx + [7], [8], prov=[EXT] * 100 + [POL] * 2 + [EXT]))


@pytest.mark.parametrize("tail", [b'{"v":1,"seq":4,"exec', b"\x00\x00\x00\x00", b'{"v":1}\n', b"garbage"])
def test_torn_last_line_skipped_with_warning(tmp_path, tail):
    records = agent_records()
    path = tmp_path / "e.jsonl"
    with RecordWriter(path) as w:
        for r in records:
            w.append(r)
    good = path.read_bytes()
    path.write_bytes(good + tail)
    with pytest.warns(TornTailWarning, match="torn final record"):
        back = read_records(path)
    assert len(back) == 4
    with pytest.warns(TornTailWarning):
        assert load_tree(path).digest() == live_tree(records).digest()


def test_partially_written_last_record(tmp_path):
    records = agent_records()
    path = tmp_path / "e.jsonl"
    with RecordWriter(path) as w:
        for r in records:
            w.append(r)
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    for cut in (last_start + 1, (last_start + len(data)) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.warns(TornTailWarning):
            back = read_records(path)
        assert len(back) == 3 and all(a.same_as(b) for a, b in zip(records, back))
        with pytest.warns(TornTailWarning):
            assert load_tree(path).digest() == live_tree(records[:3]).digest()


def test_writer_reopen_truncates_torn_tail_and_continues(tmp_path):
    records = agent_records()
    path = tmp_path / "e.jsonl"
    with RecordWriter(path) as w:
        for r in records[:3]:
            w.append(r)
    with open(path, "ab") as f:
        f.write(b'{"v":1,"seq":3,"execution_id":"exec-1","call_ind')
    with pytest.warns(TornTailWarning):
        w = RecordWriter(path)
    assert w.num_records == 3
    w.append(records[3])
    with pytest.raises(ValueError, match="duplicate"):
        w.append(records[0])
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.append(rec(9, [1], [2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = read_records(path)
    assert all(a.same_as(b) for a, b in zip(records, back))
    # the reopened writer delta-encodes against records written before the restart
    assert payload(lines(path)[3])["base"] == [1, 11]
    assert load_tree(path).digest() == live_tree(records).digest()


def test_corrupt_middle_line_raises(tmp_path):
    path = tmp_path / "e.jsonl"
    with RecordWriter(path) as w:
        for r in agent_records():
            w.append(r)
    ls = lines(path)
    bad = ls[1].replace(b'"engine-0"', b'"engine-9"')  # valid JSON, wrong CRC
    path.write_bytes(b"\n".join([ls[0], bad, *ls[2:]]) + b"\n")
    with pytest.raises(StoreCorruptError, match=r"e\.jsonl:2: corrupt record line \(crc mismatch\)"):
        read_records(path)
    with pytest.raises(StoreCorruptError):
        RecordWriter(path)


def test_missing_base_is_corruption(tmp_path):
    path = tmp_path / "e.jsonl"
    with RecordWriter(path) as w:
        for r in agent_records():
            w.append(r)
    ls = lines(path)
    # drop line 0: line 1's base and seq are now dangling
    path.write_bytes(b"\n".join(ls[1:]) + b"\n")
    with pytest.raises(StoreCorruptError, match=":1: bad record"):
        read_records(path)


@pytest.mark.parametrize("every, expected", [(1, 4 + 1), (3, 1 + 1), (0, 1)])
def test_fsync_policy(tmp_path, monkeypatch, every, expected):
    calls = []
    real = os.fsync
    monkeypatch.setattr(store_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    w = RecordWriter(tmp_path / "e.jsonl", fsync_every=every)
    for r in agent_records():
        w.append(r)
        # every append is flushed to the OS: another reader sees it before close
        assert len(read_records(tmp_path / "e.jsonl")) == w.num_records
    w.close()
    assert len(calls) == expected


def test_writer_errors(tmp_path):
    with pytest.raises(ValueError):
        RecordWriter(tmp_path / "e.jsonl", fsync_every=-1)
    w = RecordWriter(tmp_path / "e.jsonl")
    w.append(rec(0, [1], [2]))
    with pytest.raises(ValueError, match="appended to file of"):
        w.append(rec(1, [1], [2], eid="other"))
    w.close()


def test_trajectory_store_per_execution_files(tmp_path):
    store = TrajectoryStore(tmp_path / "store", max_open=1)
    ra = agent_records()
    rb = [rec(i, [7, i], [8], eid="exec-2") for i in range(3)]
    for a, b in zip(ra, rb):  # interleaved executions; max_open=1 suspends/reopens writers
        store.append(a)
        store.append(b)
    store.append(ra[3])
    assert store.execution_ids() == ["exec-1", "exec-2"]
    assert store.load_tree("exec-1").digest() == live_tree(ra).digest()
    assert all(x.same_as(y) for x, y in zip(store.read_records("exec-2"), rb))
    store.close_execution("exec-2")
    store.close()
    with pytest.raises(ValueError):
        store.path("../evil")


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data(), st.integers(1, 14), st.integers(1, 4))
def test_round_trip_property(tmp_path_factory, data, n_records, ring):
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    records = random_execution(draw_int, n_records)
    path = tmp_path_factory.mktemp("st") / "exec-1.jsonl"
    with RecordWriter(path, ring_size=ring, fsync_every=0) as w:
        for r in records:
            w.append(r)
    back = read_records(path, ring_size=ring)
    assert len(back) == len(records) and all(a.same_as(b) for a, b in zip(records, back))
    assert load_tree(path, ring_size=ring).digest() == live_tree(records).digest()
    # a torn copy of the last line never changes the earlier records
    data_ = path.read_bytes()
    cut = data_.rstrip(b"\n").rfind(b"\n") + 1 + draw_int(0, 5)
    path.write_bytes(data_[:cut])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornTailWarning)
        assert load_tree(path, ring_size=ring).digest() == live_tree(records[:-1]).digest()


def test_store_file_is_compact_for_growing_contexts(tmp_path):
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 1000, 2000).tolist()
    records = []
    for i in range(20):
        out = rng.integers(0, 1000, 50).tolist()
        records.append(rec(i, ctx, out))
        ctx = ctx + out + rng.integers(0, 1000, 100).tolist()
    path = tmp_path / "e.jsonl"
    with RecordWriter(path, fsync_every=0) as w:
        for r in records:
            w.append(r)
    tree = live_tree(records)
    # ~4/3 * (4 bytes id + 1 byte provenance) per stored token + log-probs of outputs + header
    assert path.stat().st_size < 12 * tree.num_tokens
    # storing each full context would take > 5 bytes per input token: 14x more tokens here
    assert sum(r.num_input_tokens for r in records) > 10 * tree.num_tokens


def _marked_execution():
    """r1 repeats r0 (same input, same sampled tokens) undelivered; r2 extends that path while
    r0 alone is delivered (so it extends r0); then r1 is marked delivered; r3 extends the path
    again (now r1, the newer of two delivered matches)."""
    return [rec(0, [1, 2], [3, 4]), rec(1, [1, 2], [3, 4], delivered=False),
            rec(2, [1, 2, 3, 4, 5], [6]), rec(3, [1, 2, 3, 4, 7], [8])]


def test_a_delivery_mark_applies_where_it_stands(tmp_path):
    r0, r1, r2, r3 = _marked_execution()
    live = TrajectoryTree()
    path = tmp_path / "exec-1.jsonl"
    with RecordWriter(path) as w:
        for r in (r0, r1, r2):
            w.append(r)
            live.insert(r)
        w.mark_delivered(1)
        live.mark_delivered(1)
        w.append(r3)
        live.insert(r3)
    assert payload(lines(path)[3]) == {"v": 1, "mark": "delivered", "execution_id": r1.execution_id, "call_index": 1}
    assert [live.owner(live.nodes[live.record_node(c)].parent).call_index for c in (2, 3)] == [0, 1]
    assert [r.delivered for r in live.records] == [True] * 4 and live.num_entries == 5
    back = read_records(path)
    assert [r.call_index for r in back] == [0, 1, 2, 3] and [r.delivered for r in back] == [True] * 4
    assert load_tree(path).digest() == live.digest()
    # applying the mark at the record (as a reader of final states would) builds another tree
    assert live_tree(back).digest() != live.digest()
    # a prefix of the file: the tree as it stood after that many lines
    before = TrajectoryTree()
    for r in (r0, r1, r2):
        before.insert(r)
    assert load_tree(path, lines=3).digest() == before.digest()
    before.mark_delivered(1)
    assert load_tree(path, lines=4).digest() == before.digest() and before.num_entries == 4
    with pytest.raises(ValueError, match="delivered already"):
        before.mark_delivered(1)


def test_delivery_mark_errors_reopen_and_torn_tail(tmp_path):
    r0, r1, r2, r3 = _marked_execution()
    path = tmp_path / "exec-1.jsonl"
    with RecordWriter(path) as w:
        w.append(r0)
        w.append(r1)
        with pytest.raises(ValueError, match="no record 7"):
            w.mark_delivered(7)
        w.mark_delivered(1)
    with RecordWriter(path) as w:  # reopening: the mark takes no seq, records go on numbering
        assert w.num_records == 2
        assert w.append(r2) == 2
    assert [payload(x).get("seq") for x in lines(path)] == [0, 1, None, 2]
    assert [r.delivered for r in read_records(path)] == [True, True, True]
    with open(path, "ab") as f:  # a torn mark at the end is skipped
        f.write(store_mod.encode_delivery_mark(r0.execution_id, 2)[:-9])
    with pytest.warns(TornTailWarning):
        assert [r.delivered for r in read_records(path)] == [True, True, True]
    bad = tmp_path / "exec-2.jsonl"  # a mark of a call no earlier line recorded is corruption
    bad.write_bytes(store_mod.encode_delivery_mark(r0.execution_id, 0) + store_mod.encode_record(r0, 0, None))
    with pytest.raises(StoreCorruptError, match="bad delivery mark"):
        read_records(bad)
    store = TrajectoryStore(tmp_path / "store")
    store.append(r0)
    store.append(r1)
    store.mark_delivered(r1.execution_id, 1)
    assert [r.delivered for r in store.read_records(r1.execution_id)] == [True, True]
    store.close()
