"""Where an input continues in a trajectory tree: the tree's insert index (:mod:`gyre.trajectory.tree`).

Finding where an input continues costs O(1) anchors plus the nodes visited past the reused
prefix; the reused prefix itself is verified once by a vectorised comparison. The *anchors* are
the full token paths (``input_ids ++ output_ids``) of the most recently extended records, one per
active thread (main agent, each sub-agent, ...). A new input is checked against them deepest
first: (1) full match of an anchor's path; (2) match of an anchor's input only (e.g. the harness
stripped ``<think>`` from the previous output); (3) the longest common prefix with any anchor;
else the root. From there the walk follows child edges by first token. Where independent sibling
outputs start with the same token (*ambiguous branching points*, chained by ``Node.amb_parent``)
every such child is followed, and a match found from an anchor is made exact by revisiting the
ambiguous points above it. Among equally long matches the one ending in a delivered record's node
wins, then the most recent record; the result does not depend on the anchors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.common_prefix import common_prefix_len
from gyre.trajectory.tree_nodes import ROOT, Node, RecordInfo

__all__ = ["Anchor", "PrefixIndex"]


@dataclass(slots=True)
class Anchor:
    """The full token path of a recently extended record (``input_ids ++ output_ids``)."""

    record: int
    input_ids: np.ndarray
    output_ids: np.ndarray
    n_input: int
    length: int
    delivered: bool


class PrefixIndex:
    """The insert index of one tree: its anchors and the exact longest-match search.

    Args:
        nodes: the tree's node list (read, never changed here).
        records: the tree's record list (read, never changed here).
        anchor_slots: how many recent record paths are kept (>= 1).
    """

    def __init__(self, nodes: list[Node], records: list[RecordInfo], anchor_slots: int) -> None:
        self.nodes = nodes
        self.records = records
        self.anchor_slots = anchor_slots
        self.anchors: list[Anchor] = []  # most recent last

    def add(self, rec_idx: int, input_ids: np.ndarray, output_ids: np.ndarray, delivered: bool,
            anchor_pos: int) -> None:
        """Record ``rec_idx``'s path becomes an anchor: it replaces the anchor at ``anchor_pos``
        that it extended (same thread; ``-1``: none), else the least recently added anchor is
        evicted when all slots are taken."""
        if anchor_pos >= 0:
            del self.anchors[anchor_pos]
        n_in = int(input_ids.shape[0])
        self.anchors.append(Anchor(rec_idx, input_ids, output_ids, n_in, n_in + int(output_ids.shape[0]), delivered))
        if len(self.anchors) > self.anchor_slots:
            del self.anchors[0]

    def mark_delivered(self, rec_idx: int) -> None:
        """The anchor of record ``rec_idx`` (if any) says delivered from now on."""
        for a in self.anchors:
            if a.record == rec_idx:
                a.delivered = True

    def nbytes(self) -> int:
        """Bytes of record arrays the anchors keep alive."""
        return sum(a.input_ids.nbytes + a.output_ids.nbytes for a in self.anchors)

    def find(self, x: np.ndarray) -> tuple[int, int, int, int]:
        """Return ``(node, offset, depth, anchor_position_or_-1)`` of the longest match."""
        n = x.shape[0]
        if n == 0:
            return ROOT, 0, 0, -1
        anchors = self.anchors
        if anchors:
            start = self._anchor_start(x, anchors)
            if start is not None:
                nid, off, depth, used = start
                res = self._walk(x, nid, off, depth)
                return (*self._resolve(x, nid, res), used)
        return (*self._walk(x, ROOT, 0, 0), -1)

    def _anchor_start(self, x: np.ndarray, anchors: list[Anchor]) -> tuple[int, int, int, int] | None:
        """A verified position on an anchor's path that ``x`` reaches: ``(node, offset, depth,
        anchor index or -1)``, or ``None`` when no anchor shares a prefix with ``x``."""
        n = x.shape[0]
        # 1) full path of an anchor, deepest first (then delivered, then most recent).
        order = sorted(range(len(anchors)), key=lambda i: (anchors[i].length, anchors[i].delivered, i), reverse=True)
        for i in order:
            a = anchors[i]
            L, ni = a.length, a.n_input
            if L == 0 or L > n:
                continue
            last = a.output_ids[-1] if L > ni else a.input_ids[-1]
            if x[L - 1] != last:
                continue
            if np.array_equal(x[:ni], a.input_ids) and np.array_equal(x[ni:L], a.output_ids):
                return (*self._locate(self.records[a.record].node, L), L, i)
        # 2) input of an anchor (output edited by the harness), longest first.
        order = sorted(range(len(anchors)), key=lambda i: (anchors[i].n_input, anchors[i].delivered, i), reverse=True)
        for i in order:
            a = anchors[i]
            ni = a.n_input
            if ni == 0 or ni > n or x[ni - 1] != a.input_ids[-1]:
                continue
            if np.array_equal(x[:ni], a.input_ids):
                return (*self._locate(self.records[a.record].node, ni), ni, i)
        # 3) longest common prefix with any anchor.
        best, best_i = 0, -1
        for i in range(len(anchors) - 1, -1, -1):
            a = anchors[i]
            p = common_prefix_len(x, a.input_ids)
            if p == a.n_input and p < n:
                p += common_prefix_len(x[p:], a.output_ids)
            if p > best:
                best, best_i = p, i
        if best == 0:
            return None
        return (*self._locate(self.records[anchors[best_i].record].node, best), best, -1)

    def _locate(self, node_id: int, depth: int) -> tuple[int, int]:
        """On the path to ``node_id``, the node containing token position ``depth - 1`` and the offset."""
        nodes = self.nodes
        nid = node_id
        while nid != ROOT and nodes[nid].start >= depth:
            nid = nodes[nid].parent
        return nid, depth - nodes[nid].start

    def _key(self, res: tuple[int, int, int]) -> tuple[int, bool, int]:
        """Order of candidate matches: longer, then ending in a delivered record's node, then newer."""
        rec = self.nodes[res[0]].record
        if rec < 0:
            return (res[2], False, -1)
        return (res[2], self.records[rec].delivered, rec)

    def _walk(self, x: np.ndarray, nid: int, off: int, depth: int) -> tuple[int, int, int]:
        """Exact longest match of ``x`` below position ``(nid, off)`` (``x[:depth]`` already matched).

        Where several children start with the next token (independent sibling outputs), each
        is followed and the best by :meth:`_key` wins.
        """
        nodes = self.nodes
        n = x.shape[0]
        while True:
            nd = nodes[nid]
            ln = nd.tokens.shape[0]
            if off < ln:
                m = common_prefix_len(x[depth:], nd.tokens[off:])
                off += m
                depth += m
                if off < ln:
                    return nid, off, depth
            if depth == n:
                return nid, off, depth
            cands = nd.index.get(int(x[depth]))
            if not cands:
                return nid, off, depth
            if len(cands) == 1:
                nid, off = cands[0], 0
                continue
            return max((self._walk(x, c, 0, depth) for c in cands), key=self._key)

    def _resolve(self, x: np.ndarray, nid: int, res: tuple[int, int, int]) -> tuple[int, int, int]:
        """Make an anchor-derived match exact: at every ambiguous branching point above
        ``nid`` (a parent with several children starting with the path's token, chained by
        ``Node.amb_parent``/``amb_child``), follow the other children and keep the best."""
        nodes = self.nodes
        nd = nodes[nid]
        p, c = nd.amb_parent, nd.amb_child
        key = self._key(res)
        while p >= 0:
            pn = nodes[p]
            for alt in pn.index[int(x[pn.end])]:
                if alt != c:
                    r = self._walk(x, alt, 0, pn.end)
                    k = self._key(r)
                    if k > key:
                        res, key = r, k
            p, c = pn.amb_parent, pn.amb_child
        return res
