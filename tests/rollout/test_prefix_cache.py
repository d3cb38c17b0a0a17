"""Radix prefix cache (gyre/rollout/embedded/prefix_cache.py); payloads are the tokens themselves, so a
match must return pieces that concatenate to exactly the matched prefix."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.rollout.embedded.prefix_cache import RadixPrefixCache


def flat(pieces):
    return [t for p in pieces for t in p]


def store(cache, seq):
    return cache.insert(seq, lambda a, b: list(seq[a:b]))


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_match_insert_split_and_payload_ranges():
    c = RadixPrefixCache(1000)
    assert c.match([1, 2, 3]) == (0, [])
    calls = []
    c.insert([1, 2, 3, 4], lambda a, b: calls.append((a, b)) or [1, 2, 3, 4][a:b])
    assert calls == [(0, 4)]
    m, pieces = c.match([1, 2, 9])
    assert m == 2 and flat(pieces) == [1, 2]
    calls.clear()
    seq = [1, 2, 5, 6]
    assert c.insert(seq, lambda a, b: calls.append((a, b)) or seq[a:b]) == 2
    assert calls == [(2, 4)]                     # only the missing suffix is computed
    assert c.num_nodes() == 3                    # [1,2] -> {[3,4], [5,6]}
    assert c.match([1, 2, 5, 6, 7])[0] == 4 and flat(c.match([1, 2, 3, 4])[1]) == [1, 2, 3, 4]
    assert store(c, [1, 2]) == 0 and c.total_tokens == 6


def test_lru_eviction_keeps_recent_paths_and_flush_bumps_epoch():
    c = RadixPrefixCache(8)
    store(c, [1, 1, 1, 1])
    store(c, [2, 2, 2, 2])
    c.match([1, 1, 1, 1])                        # touch path 1
    store(c, [3, 3, 3, 3])                       # over capacity: evict LRU leaf (path 2)
    assert c.total_tokens == 8
    assert c.match([2, 2])[0] == 0 and c.match([1, 1, 1, 1])[0] == 4 and c.match([3, 3])[0] == 2
    e = c.epoch
    c.flush()
    assert c.epoch == e + 1 and c.total_tokens == 0 and c.match([1])[0] == 0


def test_zero_capacity_stores_nothing():
    c = RadixPrefixCache(0)
    assert store(c, [1, 2]) == 0 and c.match([1, 2]) == (0, [])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), max_size=14))
def test_match_is_longest_common_prefix_with_any_stored_sequence(seqs, query):
    c = RadixPrefixCache(10_000)
    for s in seqs:
        store(c, s)
    m, pieces = c.match(query)
    assert m == max(lcp(s, query) for s in seqs)
    assert flat(pieces) == query[:m]
    assert c.total_tokens == sum(1 for _ in _all_prefixes(seqs))


def _all_prefixes(seqs):
    seen = set()
    for s in seqs:
        for i in range(1, len(s) + 1):
            seen.add(tuple(s[:i]))
    return seen


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=15),
       st.integers(1, 20))
def test_eviction_respects_capacity_and_matches_stay_consistent(seqs, cap):
    c = RadixPrefixCache(cap)
    for s in seqs:
        store(c, s)
        assert c.total_tokens <= cap
        for q in seqs:
            m, pieces = c.match(q)
            assert flat(pieces) == q[:m]
