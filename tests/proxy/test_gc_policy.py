"""The proxy process's memory policy (gyre/proxy/gc_policy.py): pause accounting, the freeze
after a long full collection, the periodic unfreeze (clock injected); the heap trimmer, with a
fake clock and on glibc for real."""

from __future__ import annotations

import gc
import time

import pytest

from gyre.proxy.gc_policy import CollectorPolicy, HeapTrimmer, _glibc_malloc_trim


def _collection(policy: CollectorPolicy, generation: int, seconds: float) -> None:
    policy._callback("start", {"generation": generation})
    time.sleep(seconds)
    policy._callback("stop", {"generation": generation, "collected": 0, "uncollectable": 0})


def test_a_long_full_collection_freezes_survivors_until_the_unfreeze_interval():
    now = [0.0]
    policy = CollectorPolicy(freeze_after_ms=20.0, unfreeze_interval_s=60.0, clock=lambda: now[0])
    gc.unfreeze()
    try:
        _collection(policy, 1, 0.03)                  # a young collection never freezes
        _collection(policy, 2, 0.001)                 # a short full one neither
        policy.tick()
        assert gc.get_freeze_count() == 0 and policy.freezes == 0
        _collection(policy, 2, 0.03)
        policy.tick()
        assert gc.get_freeze_count() > 0 and policy.freezes == 1
        assert policy.snapshot()["frozen_objects"] == gc.get_freeze_count()
        now[0] = 59.0
        policy.tick()
        assert gc.get_freeze_count() > 0 and policy.unfreezes == 0
        now[0] = 61.0
        policy.tick()
        assert gc.get_freeze_count() == 0 and policy.unfreezes == 1
        snap = policy.snapshot()
        assert snap["frozen_objects"] == 0
        assert snap["collections"] == [0, 1, 2] and snap["max_ms"][2] >= 30.0 and snap["max_ms"][1] >= 30.0
    finally:
        gc.unfreeze()


def test_no_freeze_when_turned_off():
    policy = CollectorPolicy(freeze_after_ms=None)
    gc.unfreeze()
    _collection(policy, 2, 0.03)
    policy.tick()
    assert gc.get_freeze_count() == 0 and policy.snapshot()["freezes"] == 0


def test_the_heap_trimmer_trims_once_per_interval_and_counts_what_it_released():
    now, calls, rss = [0.0], [], [1000]

    def trim(pad):
        calls.append(pad)
        rss[0] -= 300
        return 1

    t = HeapTrimmer(10.0, clock=lambda: now[0], trim=trim, rss=lambda: rss[0])
    assert not t.due()
    now[0] = 10.0
    assert t.due()
    t.trim()
    assert calls == [0] and not t.due() and t.snapshot()["trims"] == 1 and t.snapshot()["released_bytes"] == 300
    now[0] = 19.0
    assert not t.due()
    assert not HeapTrimmer(None, clock=lambda: 1e9, trim=trim).due()


@pytest.mark.skipif(_glibc_malloc_trim() is None, reason="glibc's malloc_trim only")
def test_malloc_trim_gives_freed_heap_pages_back():
    """Blocks below glibc's mmap threshold come from the heap; freeing all but the last leaves the
    pages resident (the last block pins the heap's top) until the trim hands them back."""
    blocks = [bytearray(b"x" * 100_000) for _ in range(600)]  # 60 MB on the heap, pages touched
    keep = blocks[-1]
    del blocks
    t = HeapTrimmer(0.0)
    before = t._rss()
    t.trim()
    assert t.released_bytes > 20 << 20, (before, t.released_bytes)
    assert len(keep) == 100_000
