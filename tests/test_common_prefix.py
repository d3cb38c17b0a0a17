"""common_prefix_len against a brute-force reference, for arrays, tuples, lists and offsets."""

import numpy as np
import pytest

from gyre.common_prefix import common_prefix_len


def brute(a, b, start=0):
    b = list(b)[start:]
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def _pairs(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        base = rng.integers(0, 3, size=int(rng.integers(0, 12)))
        a = np.concatenate([base, rng.integers(0, 3, size=int(rng.integers(0, 6)))])
        b = np.concatenate([base, rng.integers(0, 3, size=int(rng.integers(0, 6)))])
        yield a, b


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8])
def test_arrays_match_brute_force(dtype):
    for a, b in _pairs(0, 2000):
        a, b = a.astype(dtype), b.astype(dtype)
        assert common_prefix_len(a, b) == brute(a, b)
        assert common_prefix_len(b, a) == brute(b, a)


def test_python_sequences_and_mixed_match_brute_force():
    for a, b in _pairs(1, 2000):
        ta, lb = tuple(int(x) for x in a), [int(x) for x in b]
        want = brute(a, b)
        assert common_prefix_len(ta, lb) == want
        assert common_prefix_len(a, lb) == want
        assert common_prefix_len(ta, b) == want


def test_start_offset_matches_brute_force():
    rng = np.random.default_rng(2)
    for a, b in _pairs(3, 1000):
        start = int(rng.integers(0, b.shape[0] + 1))
        want = brute(a, b, start)
        assert common_prefix_len(a, b, start) == want
        assert common_prefix_len(tuple(a.tolist()), b.tolist(), start) == want


def test_edge_cases():
    empty = np.zeros(0, np.int32)
    assert common_prefix_len(empty, empty) == 0
    assert common_prefix_len(empty, np.array([1])) == 0
    assert common_prefix_len(np.array([1, 2]), np.array([1, 2])) == 2
    assert common_prefix_len(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix_len(np.array([5]), np.array([4])) == 0
    assert common_prefix_len((1, 2, 3), [9, 1, 2], start=1) == 2
    assert common_prefix_len((1,), [1], start=1) == 0
    # a constant run: compare against a broadcast view
    prov = np.array([3, 3, 3, 1], np.int8)
    assert common_prefix_len(prov, np.broadcast_to(np.int8(3), prov.shape)) == 3
