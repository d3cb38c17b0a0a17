"""Nodes of a trajectory tree as views of the records' input arrays.

A thread whose every input is a prefix of one buffer (:mod:`gyre.proxy.context_buffer`) can
have the tree's nodes on its path show that buffer instead of a copy of the same tokens, so the
thread's tokens are held once. :func:`share_input_views` moves the nodes after an insert
(``TrajectoryTree.insert(..., share_input=True)``); a moved node's ``tokens`` is a read-only view
and its ``shared`` flag is set. Content never changes: a node is only pointed at positions of
the input that matched it token for token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gyre.trajectory.tree import Node, RecordInfo

__all__ = ["share_input_views", "view_base"]

_ROOT = 0


def share_input_views(nodes: list["Node"], records: list["RecordInfo"], node_id: int, x: np.ndarray,
                      replaces: np.ndarray | None) -> None:
    """Point the tokens of the nodes on the path to ``node_id`` (which ends within ``x``'s
    matched prefix) at read-only views of ``x``, walking up from ``node_id``.

    The walk moves views of ``replaces``, and the tree's own arrays of nodes whose record's
    whole input ``x`` continues (the same thread; not the head of another thread's node that
    ``x`` forked from). It stops at the root, at a node that already views ``x``'s memory, or at
    any other node, which stays as it is (a shared system prompt, the context a branch forked
    from). Where that node ends more than a quarter into ``x`` (a branch forked deep in a long
    context), nothing is moved, so that ``x``'s copy of that long prefix is not kept alive by
    the tree for a few tokens of its own. O(nodes moved); once a thread's path views its
    buffer, a call moves one or two nodes.
    """
    xb = x if x.base is None else x.base
    depth = nodes[node_id].end
    todo = []
    nid = node_id
    while nid != _ROOT:
        nd = nodes[nid]
        b = nd.tokens.base
        if b is xb:
            break
        movable = (replaces is not None and b is replaces) or (
            not nd.shared and records[nd.record].num_input_tokens <= depth)
        if not movable:
            if 4 * nd.end > x.shape[0]:
                return
            break
        todo.append(nd)
        nid = nd.parent
    for nd in todo:
        nd.tokens = x[nd.start:nd.end]
        nd.tokens.flags.writeable = False
        nd.shared = True


def view_base(nodes: list["Node"], node_id: int) -> np.ndarray | None:
    """The array that the deepest view on the path to ``node_id`` shows, or ``None``."""
    nid = node_id
    while nid != _ROOT:
        nd = nodes[nid]
        if nd.shared:
            return nd.tokens.base
        nid = nd.parent
    return None
