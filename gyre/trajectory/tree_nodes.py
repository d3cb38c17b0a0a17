"""The pieces of a trajectory tree (:mod:`gyre.trajectory.tree`): its nodes, the records it
keeps, and what an insertion or a match reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ROOT", "Node", "RecordInfo", "InsertResult", "PrefixMatch"]

#: Node id of the root (an empty node, no record).
ROOT = 0

@dataclass(slots=True)
class Node:
    """One node: a run of tokens owned by one record.

    * ``tokens`` -- ``int32[n]``; ``provenance`` -- ``int8[n]`` (:class:`Provenance`);
    * ``logprobs`` -- ``float32[n - n_input]``: behaviour log-probs of the output part;
    * ``n_input`` -- leading tokens that are (new) input of the owning record;
    * ``start`` -- path depth before the first token (tokens), so the path to this node's
      end has ``start + n`` tokens;
    * ``record`` -- index into :attr:`TrajectoryTree.records` of the owner (-1 for root);
    * ``children`` -- child node ids in insertion order; ``index`` maps a child's first
      token to the child ids starting with it (empty children are not indexed);
    * ``amb_parent``/``amb_child`` -- the deepest *ambiguous branching point* on the path
      above this node's first token: a node ``amb_parent`` with several children starting
      with the same token (independent sibling outputs), ``amb_child`` being the one on this
      path; ``-1`` if none. The insert index uses this chain to stay exact.
    * ``shared`` -- ``tokens`` is a read-only view of a record's input array (see
      :meth:`TrajectoryTree.insert`'s ``share_input``), not an array of the tree's own.
    """

    node_id: int
    parent: int
    record: int
    start: int
    tokens: np.ndarray
    provenance: np.ndarray
    logprobs: np.ndarray
    n_input: int
    children: list[int] = field(default_factory=list)
    index: dict[int, list[int]] = field(default_factory=dict)
    amb_parent: int = -1
    amb_child: int = -1
    shared: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens held by this node."""
        return int(self.tokens.shape[0])

    @property
    def end(self) -> int:
        """Path depth (tokens) at the end of this node."""
        return self.start + int(self.tokens.shape[0])

    @property
    def num_output(self) -> int:
        """Output tokens (those with behaviour log-probs) held by this node."""
        return int(self.tokens.shape[0]) - self.n_input


@dataclass(slots=True)
class RecordInfo:
    """A record's metadata as kept by the tree (token arrays live in the nodes).

    ``node`` is the node at whose end the record's ``input ++ output`` path ends (stable
    across later splits); ``matched_tokens`` the input prefix reused from the tree at
    insertion; ``num_input_tokens``/``num_output_tokens`` the record's lengths.
    """

    call_index: int
    role: str
    policy_version: int
    engine_id: str
    delivered: bool
    finish_reason: str
    timings: dict[str, float]
    metadata: dict[str, Any]
    num_input_tokens: int
    num_output_tokens: int
    node: int
    matched_tokens: int


@dataclass(slots=True)
class InsertResult:
    """What :meth:`TrajectoryTree.insert` did.

    ``node`` -- the new node; ``parent`` -- its parent; ``matched_tokens`` -- length of the
    reused input prefix (= branch point depth, tokens); ``new_tokens`` -- tokens stored in the
    new node (new input + output); ``split`` -- id of the head node created by splitting an
    existing node at the branch point, or ``None``.
    """

    node: int
    parent: int
    matched_tokens: int
    new_tokens: int
    split: int | None


@dataclass(slots=True)
class PrefixMatch:
    """Longest stored path that a token sequence extends.

    ``node``/``offset``: the match ends after ``offset`` tokens of ``node`` (``offset ==``
    the node's length means at its end; ``node == ROOT`` and ``offset == 0`` means no match);
    ``depth``: matched tokens.
    """

    node: int
    offset: int
    depth: int
