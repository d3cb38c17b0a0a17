"""The proxy process's memory policy (gyre/proxy/gc_policy.py): pause accounting, the freeze
after a long full collection, the periodic unfreeze (clock injected); the heap trimmer, with a
fake clock and on glibc for real; the cap on the C heap's arenas (mallopt injected, and on glibc
for real)."""

from __future__ import annotations

import gc
import time

import pytest

from gyre.proxy import gc_policy
from gyre.proxy.gc_policy import (M_ARENA_MAX, CollectorPolicy, HeapTrimmer, _glibc_malloc_trim, install_arena_limit,
                                  limit_malloc_arenas)


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
        # counted at the freeze; frozen objects freed since (other threads' too) leave it, none join it
        recorded = policy.snapshot()["frozen_objects"]
        assert recorded - 1000 <= gc.get_freeze_count() <= recorded
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


def test_the_arena_cap_is_set_through_mallopt_and_only_when_asked():
    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 1

    assert limit_malloc_arenas(2, mallopt=mallopt) and calls == [(M_ARENA_MAX, 2)]
    assert not limit_malloc_arenas(None, mallopt=mallopt) and calls == [(M_ARENA_MAX, 2)]
    assert not limit_malloc_arenas(1, mallopt=lambda p, v: 0)  # mallopt refused it
    with pytest.raises(ValueError):
        limit_malloc_arenas(0, mallopt=mallopt)


def test_the_arena_cap_is_set_by_the_first_install_of_a_process(monkeypatch):
    monkeypatch.setattr(gc_policy, "_arena_limit", [])
    calls = []
    monkeypatch.setattr(gc_policy, "limit_malloc_arenas", lambda n: calls.append(n) or n is not None)
    assert install_arena_limit(1) and install_arena_limit(None) and calls == [1]


def test_the_arena_cap_takes_on_glibc_and_is_a_no_op_elsewhere(monkeypatch):
    # mallopt exists only in glibc: there the call succeeds, elsewhere nothing is called
    assert limit_malloc_arenas(8) == (gc_policy._glibc("mallopt") is not None)
    monkeypatch.setattr(gc_policy, "_glibc", lambda name: None)  # another C library
    assert not limit_malloc_arenas(8)
