"""Trajectory tree: one prefix-sharing tree of request records per execution.

The tree is a token trie (radix tree) whose nodes are runs of tokens *owned by one record*:
each node's tokens are ``[new input tokens | output tokens]`` (``n_input`` tells where the
output starts).  Inserting a :class:`~gyre.trajectory.records.RequestRecord` finds the longest
stored path that its ``input_ids`` extend and appends one node there (splitting a node when the
input diverges inside it); :meth:`TrajectoryTree.insert` gives the rules.  Only inputs are
matched against stored paths: two records with the same input give two sibling output nodes.

Output tokens carry behaviour log-probs and provenance ``POLICY`` (``EVALUATOR`` for evaluator
calls); input tokens carry the record's input provenance.  On the shared (matched) part the
stored path is authoritative.  A tree rebuilt from its records in order is bit-identical
(:meth:`TrajectoryTree.digest`, :mod:`gyre.trajectory.store`).

Not thread-safe: one writer per tree (the proxy serialises the calls of one execution).
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterator

import numpy as np

from gyre.trajectory.records import RequestRecord
from gyre.trajectory.tree_index import PrefixIndex
from gyre.trajectory.tree_nodes import ROOT, InsertResult, Node, PrefixMatch, RecordInfo
from gyre.trajectory.tree_sharing import share_input_views, view_base

__all__ = ["ROOT", "Node", "RecordInfo", "InsertResult", "PrefixMatch", "TrajectoryTree"]

_EMPTY_I32 = np.zeros(0, np.int32)
_EMPTY_I8 = np.zeros(0, np.int8)
_EMPTY_F32 = np.zeros(0, np.float32)

class TrajectoryTree:
    """The trajectory tree of one execution.

    Finding where an input continues (:meth:`match`, :meth:`insert`) costs O(1) anchors plus
    the nodes visited past the reused prefix (:class:`~gyre.trajectory.tree_index.PrefixIndex`,
    :attr:`index`): the anchors are the token paths of the most recently extended records, one
    per active thread; among equally long matches the one ending in a delivered record's node
    wins, then the most recent record; the result does not depend on the anchors.

    Args:
        execution_id: the execution; if ``None`` it is taken from the first record.
        anchor_slots: how many recent record paths the insert index keeps (≥ 1). Memory:
            each anchor references its record's ``input_ids``/``output_ids`` arrays. It
            affects speed only: the tree is the same for any value.

    Raises:
        ValueError: ``anchor_slots < 1``.
    """

    def __init__(self, execution_id: str | None = None, *, anchor_slots: int = 8) -> None:
        if anchor_slots < 1:
            raise ValueError("anchor_slots must be >= 1")
        self.execution_id = execution_id
        self.anchor_slots = int(anchor_slots)
        self.nodes: list[Node] = [
            Node(ROOT, -1, -1, 0, _EMPTY_I32, _EMPTY_I8, _EMPTY_F32, 0)
        ]
        self.records: list[RecordInfo] = []
        self._by_call: dict[int, int] = {}
        #: where an input continues (anchors and the longest-match search)
        self.index = PrefixIndex(self.nodes, self.records, self.anchor_slots)
        self._num_tokens = 0
        #: delivery marks applied (:meth:`mark_delivered`)
        self.delivery_marks = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Number of nodes, root excluded."""
        return len(self.nodes) - 1

    @property
    def num_nodes(self) -> int:
        """Number of nodes, root excluded."""
        return len(self.nodes) - 1

    @property
    def num_tokens(self) -> int:
        """Unique tokens stored (sum of node lengths)."""
        return self._num_tokens

    def node(self, node_id: int) -> Node:
        """The node with id ``node_id``. Raises ``IndexError`` for an unknown id."""
        if node_id < 0:
            raise IndexError(node_id)
        return self.nodes[node_id]

    def record_info(self, call_index: int) -> RecordInfo:
        """Metadata of the record with ``call_index``. Raises ``KeyError`` if absent."""
        return self.records[self._by_call[call_index]]

    @property
    def num_entries(self) -> int:
        """Records inserted plus delivery marks applied: how many lines of the execution's
        record file this tree reflects (:func:`~gyre.trajectory.store.load_tree`'s ``lines``)."""
        return len(self.records) + self.delivery_marks

    def record_node(self, call_index: int) -> int:
        """Node at whose end the record's ``input ++ output`` path ends."""
        return self.record_info(call_index).node

    def role(self, node_id: int) -> str:
        """Role of the record that owns ``node_id`` (``""`` for the root)."""
        rec = self.nodes[node_id].record
        return self.records[rec].role if rec >= 0 else ""

    def owner(self, node_id: int) -> RecordInfo:
        """The record that owns ``node_id``. Raises ``ValueError`` for the root."""
        rec = self.nodes[node_id].record
        if rec < 0:
            raise ValueError("the root has no owner")
        return self.records[rec]

    def children(self, node_id: int) -> list[int]:
        """Child node ids of ``node_id`` in insertion order."""
        return list(self.nodes[node_id].children)

    def leaves(self) -> list[int]:
        """Node ids without children, ascending (empty list for an empty tree)."""
        return [n.node_id for n in self.nodes[1:] if not n.children]

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root's child down to ``node_id`` (root excluded)."""
        out: list[int] = []
        nid = node_id
        while nid != ROOT:
            out.append(nid)
            nid = self.nodes[nid].parent
        out.reverse()
        return out

    def path_tokens(self, node_id: int) -> np.ndarray:
        """``int32[depth]``: token ids of the root-to-``node_id`` path (original context)."""
        return self._concat(node_id, "tokens", _EMPTY_I32)

    def path_provenance(self, node_id: int) -> np.ndarray:
        """``int8[depth]``: per-token :class:`Provenance` along the path."""
        return self._concat(node_id, "provenance", _EMPTY_I8)

    def path_output_mask(self, node_id: int) -> np.ndarray:
        """``bool[depth]``: True where the token is a node's output (has a behaviour log-prob)."""
        parts = []
        for nid in self.path(node_id):
            nd = self.nodes[nid]
            m = np.zeros(nd.num_tokens, bool)
            m[nd.n_input:] = True
            parts.append(m)
        return np.concatenate(parts) if parts else np.zeros(0, bool)

    def path_logprobs(self, node_id: int) -> np.ndarray:
        """``float32[depth]``: behaviour log-probs along the path, 0.0 at input tokens."""
        parts = []
        for nid in self.path(node_id):
            nd = self.nodes[nid]
            lp = np.zeros(nd.num_tokens, np.float32)
            lp[nd.n_input:] = nd.logprobs
            parts.append(lp)
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def view_base(self, node_id: int) -> np.ndarray | None:
        """The array that the deepest view on the path to ``node_id`` shows (see
        :meth:`insert`'s ``share_input``), or ``None`` if the path holds only the tree's own."""
        return view_base(self.nodes, node_id)

    def _concat(self, node_id: int, attr: str, empty: np.ndarray) -> np.ndarray:
        parts = [getattr(self.nodes[n], attr) for n in self.path(node_id)]
        return np.concatenate(parts) if parts else empty.copy()

    def iter_preorder(self) -> Iterator[tuple[int, int]]:
        """Yield ``(node_id, depth_in_nodes)`` in depth-first pre-order, children in insertion order (root excluded)."""
        stack = [(c, 1) for c in reversed(self.nodes[ROOT].children)]
        while stack:
            nid, d = stack.pop()
            yield nid, d
            stack.extend((c, d + 1) for c in reversed(self.nodes[nid].children))

    def nbytes(self) -> int:
        """Bytes of the arrays the nodes keep alive (tokens, provenance, log-probs): each
        underlying array once, whole (a shared context buffer with its spare room), anchors
        excluded."""
        seen: set[int] = set()
        total = 0
        for nd in self.nodes:
            for arr in (nd.tokens, nd.provenance, nd.logprobs):
                base = arr.base if arr.base is not None else arr
                if id(base) not in seen:
                    seen.add(id(base))
                    total += base.nbytes
        return total

    def anchor_nbytes(self) -> int:
        """Bytes of record arrays kept alive by the insert index (≤ ``anchor_slots`` records)."""
        return self.index.nbytes()

    def digest(self) -> str:
        """SHA-256 hex digest of the tree's full content (nodes, arrays, records).

        Two trees have equal digests iff they are bit-identical (up to hash collisions).
        """
        h = hashlib.sha256()
        for nd in self.nodes:
            h.update(
                np.array(
                    [nd.node_id, nd.parent, nd.record, nd.start, nd.n_input, nd.num_tokens, len(nd.children)],
                    np.int64,
                ).tobytes()
            )
            h.update(np.asarray(nd.children, np.int64).tobytes())
            h.update(np.ascontiguousarray(nd.tokens).tobytes())
            h.update(np.ascontiguousarray(nd.provenance).tobytes())
            h.update(np.ascontiguousarray(nd.logprobs).tobytes())
        for r in self.records:
            h.update(
                json.dumps(
                    [r.call_index, r.role, r.policy_version, r.engine_id, r.delivered, r.finish_reason,
                     r.timings, r.metadata, r.num_input_tokens, r.num_output_tokens, r.node, r.matched_tokens],
                    sort_keys=True,
                ).encode()
            )
        return h.hexdigest()

    # ------------------------------------------------------------------ matching
    def match(self, input_ids: np.ndarray) -> PrefixMatch:
        """Longest stored path that ``input_ids`` (``int32[n]``) extends; does not modify the tree.

        The proxy can use this to reuse stored token ids (token-in / token-out).
        """
        x = np.asarray(input_ids, dtype=np.int32)
        node, off, depth, _ = self.index.find(x)
        return PrefixMatch(node, off, depth)

    # ------------------------------------------------------------------ insertion
    def insert(
        self, record: RequestRecord, *, share_input: bool = False, replaces: np.ndarray | None = None
    ) -> InsertResult:
        """Insert one request record as one new node holding its new input tokens and its output.

        The longest stored path its ``input_ids`` extend (inputs *and* outputs of earlier nodes
        count) decides where:

        * the input ends exactly at a node boundary -> the new node is a child of that node;
        * the input diverges (or ends) *inside* a node -> that node is split at the exact token
          (a new *head* node takes the shared tokens, the original node keeps the rest, its
          children and its identity) and the new node becomes a sibling of the remainder;
        * nothing matches -> the new node is a child of the root.

        Outputs are never matched against each other, so a retried identical request gives a
        sibling output node even when the sampled tokens coincide.  Cost: O(new tokens)
        Python-level work plus one vectorised comparison of the reused prefix.

        The new node's arrays are the tree's own. With ``share_input`` the nodes on the reused
        prefix may instead keep read-only views of ``record.input_ids`` (the same tokens), so a
        thread whose every input is a prefix of one buffer (see
        :mod:`gyre.proxy.context_buffer`) holds its tokens once:
        :func:`~gyre.trajectory.tree_sharing.share_input_views` gives the rule.
        The caller must then never modify that array. ``replaces``: an array whose views on this
        path may be moved to ``record.input_ids`` (the buffer it was copied from).

        Raises:
            ValueError: the record belongs to another execution, or its ``call_index`` is
                already in the tree.
        """
        self._check_insert(record)
        x = record.input_ids
        nid, off, depth, anchor_pos = self.index.find(x)
        split: int | None = None
        if off < self.nodes[nid].num_tokens:
            split = self._split(nid, off)
            nid = split
        rec_idx = len(self.records)
        node = self._append_node(record, nid, depth, rec_idx)
        self.records.append(_record_info(record, node.node_id, depth))
        self._by_call[record.call_index] = rec_idx
        if share_input and depth:
            share_input_views(self.nodes, self.records, nid, x, replaces)
        # the record replaces the anchor it extended (same thread), else the oldest is evicted
        self.index.add(rec_idx, x, record.output_ids, record.delivered, anchor_pos)
        return InsertResult(node.node_id, nid, depth, node.num_tokens, split)

    def _check_insert(self, record: RequestRecord) -> None:
        """Adopt the first record's execution; refuse another execution's record or a repeated
        ``call_index`` (``ValueError``)."""
        if self.execution_id is None:
            self.execution_id = record.execution_id
        elif record.execution_id != self.execution_id:
            raise ValueError(
                f"record of execution {record.execution_id!r} inserted into tree of {self.execution_id!r}"
            )
        if record.call_index in self._by_call:
            raise ValueError(f"duplicate call_index {record.call_index} in execution {self.execution_id!r}")

    def _append_node(self, record: RequestRecord, nid: int, depth: int, rec_idx: int) -> Node:
        """Append the node of ``record`` (its input past ``depth`` and its output, in arrays of
        the tree's own) as the last child of node ``nid``, which ends at ``depth``; index it by its
        first token, marking the group ambiguous when a sibling starts with the same token."""
        x, out = record.input_ids, record.output_ids
        n_new_in = x.shape[0] - depth
        tokens = np.concatenate([x[depth:], out]) if n_new_in else out.copy()
        prov = np.empty(tokens.shape[0], np.int8)
        prov[:n_new_in] = record.input_provenance[depth:]
        prov[n_new_in:] = record.output_provenance_value()
        new_id = len(self.nodes)
        node = Node(new_id, nid, rec_idx, depth, tokens, prov, record.output_logprobs.copy(), n_new_in)
        self.nodes.append(node)
        parent = self.nodes[nid]
        parent.children.append(new_id)
        node.amb_parent, node.amb_child = parent.amb_parent, parent.amb_child
        if tokens.shape[0]:
            group = parent.index.setdefault(int(tokens[0]), [])
            group.append(new_id)
            if len(group) > 1:  # an independent sibling output sharing the first token
                node.amb_parent, node.amb_child = nid, new_id
                if len(group) == 2:
                    self._mark_ambiguous(nid, group[0])
        self._num_tokens += tokens.shape[0]
        return node

    def mark_delivered(self, call_index: int) -> None:
        """Record that the answer of record ``call_index``, inserted as undelivered, reached the
        harness after all (a client retry got it): its :class:`RecordInfo` (and its insert-index
        anchor) say ``delivered`` from now on, so later matches prefer it as they prefer any
        delivered record. The nodes do not change.

        Raises:
            KeyError: no record ``call_index``.
            ValueError: the record is delivered already.
        """
        idx = self._by_call[call_index]
        info = self.records[idx]
        if info.delivered:
            raise ValueError(f"record {call_index} of {self.execution_id!r} is delivered already")
        info.delivered = True
        self.index.mark_delivered(idx)
        self.delivery_marks += 1

    def _split(self, node_id: int, k: int) -> int:
        """Split ``node_id`` after ``k`` tokens (0 < k < n); return the new head's id.

        The original node keeps its identity (end, children, record end) and becomes the
        head's only child; array halves are views (no copy).
        """
        nodes = self.nodes
        nd = nodes[node_id]
        assert 0 < k < nd.num_tokens
        head_id = len(nodes)
        n_in = nd.n_input
        if k <= n_in:
            head_lp, tail_lp = _EMPTY_F32, nd.logprobs
        else:
            head_lp, tail_lp = nd.logprobs[: k - n_in], nd.logprobs[k - n_in:]
        head = Node(
            head_id, nd.parent, nd.record, nd.start, nd.tokens[:k], nd.provenance[:k], head_lp, min(k, n_in),
            children=[node_id], index={int(nd.tokens[k]): [node_id]}, shared=nd.shared,
        )
        nodes.append(head)
        parent = nodes[nd.parent]
        parent.children[parent.children.index(node_id)] = head_id
        lst = parent.index[int(nd.tokens[0])]
        lst[lst.index(node_id)] = head_id
        nd.parent = head_id
        nd.start += k
        nd.tokens = nd.tokens[k:]
        nd.provenance = nd.provenance[k:]
        nd.logprobs = tail_lp
        nd.n_input = max(0, n_in - k)
        head.amb_parent, head.amb_child = nd.amb_parent, nd.amb_child
        if nd.amb_child == node_id:  # the head takes the node's place in an ambiguous group
            head.amb_child = head_id
            self._repoint(node_id, (nd.amb_parent, node_id), (nd.amb_parent, head_id))
        return head_id

    def _repoint(self, top: int, old: tuple[int, int], new: tuple[int, int]) -> None:
        """Set ``amb`` to ``new`` on ``top`` and the descendants that inherit ``old`` from it."""
        nodes = self.nodes
        stack = [top]
        while stack:
            d = nodes[stack.pop()]
            if (d.amb_parent, d.amb_child) != old:
                continue  # this subtree has a deeper ambiguous point
            d.amb_parent, d.amb_child = new
            stack.extend(d.children)

    def _mark_ambiguous(self, parent: int, member: int) -> None:
        """``member``'s first-token group under ``parent`` just became ambiguous."""
        m = self.nodes[member]
        self._repoint(member, (m.amb_parent, m.amb_child), (parent, member))


def _record_info(record: RequestRecord, node_id: int, matched_tokens: int) -> RecordInfo:
    """What the tree keeps of ``record`` (its arrays live in the nodes)."""
    return RecordInfo(
        call_index=record.call_index,
        role=record.role,
        policy_version=record.policy_version,
        engine_id=record.engine_id,
        delivered=record.delivered,
        finish_reason=record.finish_reason,
        timings=dict(record.timings),
        metadata=dict(record.metadata),
        num_input_tokens=int(record.input_ids.shape[0]),
        num_output_tokens=int(record.output_ids.shape[0]),
        node=node_id,
        matched_tokens=matched_tokens,
    )
