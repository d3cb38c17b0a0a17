"""Units of stream packing (:mod:`gyre.buffer.packing`): one execution's rows laid out for a micro-step.

A row is first cut after its last target's predecessor (:func:`prepare_row`: token ``t`` is
predicted from position ``t - 1``, so tokens from the last target on are never an input). A
*unit* is what the packer places: one row, or with ``--tree-packed-forward`` the rows of one
execution merged into a token trie whose attention and position ids give every target exactly
its original context (:func:`build_unit`); :func:`execution_units` cuts an execution's trie into
tries that fit the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.buffer.micro_step import PackingConfig
from gyre.common_prefix import common_prefix_len

__all__ = ["PreparedRow", "Unit", "build_unit", "layout_cost", "prepare_row", "execution_units"]


@dataclass(slots=True)
class PreparedRow:
    """A row cut after its last target's predecessor, with its targets (positions, ids,
    behaviour log-probs)."""

    tokens: np.ndarray  # int64, cut
    target_pos: np.ndarray  # int64 positions t (>= 1) of targets in the row
    target_ids: np.ndarray
    blp: np.ndarray  # float32


@dataclass(slots=True)
class Unit:
    """Rows of one execution laid out as one trie (a single row = one root segment)."""

    execution: int
    tokens: np.ndarray
    positions: np.ndarray
    seg_start: list[int]
    seg_len: list[int]
    seg_parent: list[int]
    seg_parent_off: list[int]
    t_src: np.ndarray
    t_ids: np.ndarray
    t_blp: np.ndarray
    row_tokens: int
    rows: int
    order: int = 0

    @property
    def length(self) -> int:
        """Tokens of the unit (its trie's, or its row's)."""
        return int(self.tokens.shape[0])


def build_unit(execution: int, rows: list[PreparedRow], tree: bool) -> Unit:
    """Lay ``rows`` (of one execution) out as a trie (``tree``) -- or as one row if ``len(rows) == 1``.

    Each row's longest common prefix with an earlier row of the execution is not repeated; the
    rest becomes a *segment* whose parent is the last shared token.  Attention follows the trie
    (a token sees its own segment causally and, in each ancestor segment, the tokens up to the
    branching point); position ids are the depth along the row, so the logits equal the per-row
    forward.  Forward tokens saved = row tokens - trie tokens.
    """
    if not tree and len(rows) != 1:
        raise AssertionError("non-tree units hold one row")
    seg_start: list[int] = []
    seg_len: list[int] = []
    seg_depth: list[int] = []
    seg_parent: list[int] = []
    seg_off: list[int] = []
    toks: list[np.ndarray] = []
    chains: list[list[tuple[int, int, int]]] = []  # per row: (segment, row_start, length)
    srcs, ids, blps = [], [], []
    flat = 0
    for r, row in enumerate(rows):
        best, best_j = 0, -1
        for j in range(r):
            lcp = common_prefix_len(rows[j].tokens, row.tokens)
            if lcp > best:
                best, best_j = lcp, j
        chain: list[tuple[int, int, int]] = []
        if best > 0:
            for sg, rs, ln in chains[best_j]:
                if rs >= best:
                    break
                chain.append((sg, rs, min(ln, best - rs)))
        t = row.tokens.shape[0]
        if t > best:
            parent, poff = (chain[-1][0], chain[-1][2] - 1) if chain else (-1, 0)
            seg_start.append(flat)
            seg_len.append(t - best)
            seg_depth.append(best)
            seg_parent.append(parent)
            seg_off.append(poff)
            toks.append(row.tokens[best:])
            chain.append((len(seg_start) - 1, best, t - best))
            flat += t - best
        chains.append(chain)
        src_pos = row.target_pos - 1
        src = np.empty_like(src_pos)
        for sg, rs, ln in chain:
            sel = (src_pos >= rs) & (src_pos < rs + ln)
            src[sel] = seg_start[sg] + (src_pos[sel] - rs)
        srcs.append(src)
        ids.append(row.target_ids)
        blps.append(row.blp)
    tokens = np.concatenate(toks) if toks else np.zeros(0, np.int64)
    positions = (np.concatenate([d + np.arange(n, dtype=np.int64) for d, n in zip(seg_depth, seg_len)])
                 if seg_len else np.zeros(0, np.int64))
    return Unit(execution, tokens, positions, seg_start, seg_len, seg_parent, seg_off,
                np.concatenate(srcs), np.concatenate(ids), np.concatenate(blps),
                row_tokens=sum(int(r.tokens.shape[0]) for r in rows), rows=len(rows))


def layout_cost(layout: str, lengths: list[int]) -> int:
    """Tokens a micro-step of units of ``lengths`` costs: their sum (``pack``) or ``b * s`` (``pad``)."""
    if not lengths:
        return 0
    return sum(lengths) if layout == "pack" else len(lengths) * max(lengths)


def prepare_row(row) -> PreparedRow | None:
    """``row`` (a :class:`~gyre.trajectory.materialize.TrajectoryRow`) cut after its last
    target's predecessor, with its targets; ``None`` when it has no target.

    Raises:
        ValueError: its arrays disagree in length, or a target at position 0 (no context).
    """
    ids = np.asarray(row.input_ids)
    mask = np.asarray(row.target_mask, dtype=bool)
    blp = np.asarray(row.behaviour_logprobs, dtype=np.float32)
    if ids.ndim != 1 or mask.shape != ids.shape or blp.shape != ids.shape:
        raise ValueError(f"row of execution {row.execution_id}: input_ids, target_mask and "
                         "behaviour_logprobs must be 1-D of equal length")
    pos = np.flatnonzero(mask).astype(np.int64)
    if pos.size == 0:
        return None
    if pos[0] == 0:
        raise ValueError(f"row of execution {row.execution_id}: a target at position 0 has no context")
    last = int(pos[-1])
    return PreparedRow(tokens=ids[:last].astype(np.int64), target_pos=pos,
                       target_ids=ids[pos].astype(np.int64), blp=blp[pos])



def execution_units(e: int, prepared: list[PreparedRow], cfg: PackingConfig) -> list[Unit]:
    """The units of execution ``e``'s prepared rows: one per row, or (``cfg.tree``) its rows' trie,
    cut into consecutive tries that each fit the budget when the whole does not.

    Raises:
        ValueError: a row longer than ``cfg.token_budget``.
    """
    budget = cfg.token_budget
    for p in prepared:
        if p.tokens.shape[0] > budget:
            raise ValueError(f"a row needs {p.tokens.shape[0]} input tokens, more than the micro-step "
                             f"budget of {budget} (raise --micro-step-tokens)")
    if not cfg.tree:
        return [build_unit(e, [p], False) for p in prepared]
    whole = build_unit(e, prepared, True)
    if whole.length <= budget:
        return [whole]
    units: list[Unit] = []
    cur: list[PreparedRow] = []
    cur_unit: Unit | None = None
    for p in prepared:
        trial = build_unit(e, cur + [p], True)
        if cur and trial.length > budget:
            units.append(cur_unit)
            cur, cur_unit = [p], build_unit(e, [p], True)
        else:
            cur, cur_unit = cur + [p], trial
    units.append(cur_unit)
    return units
