"""The proxy process's garbage-collector policy (gyre/proxy/gc_policy.py): pause accounting, the
freeze after a long full collection, the periodic unfreeze (clock injected)."""

from __future__ import annotations

import gc
import time

from gyre.proxy.gc_policy import CollectorPolicy


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
