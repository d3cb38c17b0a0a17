"""Radix-tree prefix cache keyed by token ids, with an opaque per-token payload (the KV).

The same idea as SGLang's ``RadixCache`` (``python/sglang/srt/mem_cache/radix_cache.py``):
edges are runs of token ids; a node's payload holds the state of exactly its edge's tokens
(for the embedded engine: the K/V of those positions, a tensor ``[layers, 2, kv_heads, n,
head_dim]``).  The KV of position ``i`` depends only on tokens ``0..i``, so any stored path
that shares a prefix with a new request gives reusable KV for that shared prefix.

Pure and deterministic: the payload type is opaque (``slice_fn(payload, a, b)`` cuts it) and
recency is a logical clock, not wall time.  Eviction removes least-recently-used leaves while
more than ``capacity_tokens`` are stored.  ``flush`` drops everything and bumps ``epoch`` so a
caller can refuse to insert state computed before the flush (e.g. under old weights).
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

from gyre.common_prefix import common_prefix_len

P = TypeVar("P")


def _slice_seq(payload: Any, a: int, b: int) -> Any:
    return payload[a:b]


class _Node(Generic[P]):
    __slots__ = ("key", "payload", "children", "parent", "last_access")

    def __init__(self, key: tuple[int, ...], payload: P | None, parent: "_Node[P] | None", t: int):
        self.key = key
        self.payload = payload
        self.children: dict[int, _Node[P]] = {}
        self.parent = parent
        self.last_access = t


class RadixPrefixCache(Generic[P]):
    """Longest-prefix KV reuse over token sequences.

    Args:
        capacity_tokens: most tokens stored (sum of edge lengths); ``0`` disables storing.
        slice_fn: ``slice_fn(payload, a, b)`` returns the payload of edge tokens ``[a, b)``.
    """

    def __init__(self, capacity_tokens: int, slice_fn: Callable[[P, int, int], P] = _slice_seq):
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity_tokens = capacity_tokens
        self._slice = slice_fn
        self._clock = 0
        self.epoch = 0
        self.total_tokens = 0
        self.hit_tokens = 0
        self.queried_tokens = 0
        self._root: _Node[P] = _Node((), None, None, 0)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _descend(self, tokens: Sequence[int]) -> Iterator[tuple[_Node[P], int, int]]:
        """Follow ``tokens`` down from the root, stamping each edge entered with a new clock tick.

        Yields ``(child, start, k)``: the edge entered at token position ``start`` and the
        ``k >= 1`` leading tokens of its key that match; stops after an edge matched only in part.
        """
        t = self._tick()
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return
            k = common_prefix_len(child.key, tokens, i)
            child.last_access = t
            partial = k < len(child.key)
            yield child, i, k
            if partial:
                return
            i += k
            node = child

    def match(self, tokens: Sequence[int], count: bool = True) -> tuple[int, list[P]]:
        """Longest stored prefix of ``tokens`` (``count``: include it in the hit statistics).

        Returns:
            ``(m, pieces)``: ``m`` tokens matched and the payload pieces covering positions
            ``[0, m)`` in order (the last may be a slice of an edge).
        """
        i, pieces = 0, []
        for child, start, k in self._descend(tokens):
            pieces.append(child.payload if k == len(child.key) else self._slice(child.payload, 0, k))
            i = start + k
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += i
        return i, pieces

    def _split(self, child: _Node[P], k: int) -> _Node[P]:
        """Cut ``child``'s edge after ``k`` tokens; return the new upper node."""
        parent = child.parent
        upper = _Node(child.key[:k], self._slice(child.payload, 0, k), parent, child.last_access)
        child.payload = self._slice(child.payload, k, len(child.key))
        child.key = child.key[k:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper

    def insert(self, tokens: Sequence[int], payload_fn: Callable[[int, int], P]) -> int:
        """Store ``tokens``; ``payload_fn(a, b)`` is called once for the missing range ``[a, b)``.

        Returns:
            Number of newly stored tokens (0 when the whole sequence was present).
        """
        if self.capacity_tokens == 0 or not tokens:
            return 0
        node, i = self._root, 0
        for child, start, k in self._descend(tokens):
            if k < len(child.key):
                child = self._split(child, k)
            node, i = child, start + k
        t = self._clock  # the tick _descend stamped on this walk
        if i == len(tokens):
            return 0
        leaf = _Node(tuple(tokens[i:]), payload_fn(i, len(tokens)), node, t)
        node.children[leaf.key[0]] = leaf
        added = len(tokens) - i
        self.total_tokens += added
        if self.total_tokens > self.capacity_tokens:
            self.evict(self.total_tokens - self.capacity_tokens)
        return added

    def evict(self, num_tokens: int) -> int:
        """Remove least-recently-used leaves until ``num_tokens`` were freed; return freed tokens."""
        heap: list[tuple[int, int, _Node[P]]] = []
        counter = 0
        stack = [self._root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self._root:
                heap.append((n.last_access, counter, n))
                counter += 1
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.total_tokens -= len(leaf.key)
            if parent is not self._root and not parent.children:
                counter += 1
                heapq.heappush(heap, (parent.last_access, counter, parent))
        return freed

    def flush(self) -> None:
        """Drop every entry and bump :attr:`epoch`."""
        self._root = _Node((), None, None, 0)
        self.total_tokens = 0
        self.epoch += 1

    def num_nodes(self) -> int:
        """Number of stored edges (for tests and stats)."""
        count, stack = 0, [self._root]
        while stack:
            n = stack.pop()
            count += len(n.children)
            stack.extend(n.children.values())
        return count
