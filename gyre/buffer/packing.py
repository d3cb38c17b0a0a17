"""Stream packing: admitted trajectory rows -> micro-steps under a token budget.

Input: :class:`~gyre.trajectory.materialize.TrajectoryRow` s of one batch (all admitted rows of
its executions, advantages filled in).  Output: :class:`MicroStep` s, each a self-contained unit
of training input with its targets and the per-execution numbers the objective needs
(:mod:`gyre.rl.objective`).  :class:`MicroStepPacker` gives the placement rules.

Layouts (``--packing``, :data:`LAYOUTS`): ``pack`` concatenates rows into one sequence per
micro-step (position ids restart per row, block-diagonal causal attention; cost = tokens);
``pad`` puts one row per batch entry, right-padded to the longest (cost = ``b * s``).
With ``--tree-packed-forward`` the rows of one execution that share a token prefix are merged
into a token trie whose attention and position ids give every target exactly its original
context (:func:`_build_unit`).  Segments are contiguous column spans of one batch row;
:meth:`MicroStep.attention_mask` derives the ``[b, s, s]`` mask.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gyre.common_prefix import common_prefix_len

__all__ = [
    "LAYOUTS",
    "MicroStep",
    "MicroStepPacker",
    "PackResult",
    "PackingConfig",
    "PackingStats",
    "pack_rows",
]

#: ``--packing`` values.  On CPU, ``pad`` of similar-length rows can beat one long packed
#: sequence, since attention is ``O(s^2)`` per sequence; ``bench/train.py`` measures both.
LAYOUTS = ("pack", "pad")


@dataclass(frozen=True, slots=True)
class PackingConfig:
    """Packing settings.

    * ``token_budget`` -- tokens per micro-step (``--micro-step-tokens``): ``pack``: sequence
      length; ``pad``: ``b * s``. A single row (``tree``: a single row's trie) longer than this
      is an error.
    * ``layout`` -- ``pack`` | ``pad`` (``--packing``).
    * ``tree`` -- tree-packed forward of rows of one execution (``--tree-packed-forward``).
    * ``pad_token_id`` -- id written into padding (never attended by real tokens).

    Raises:
        ValueError: ``token_budget < 1`` or unknown ``layout``.
    """

    token_budget: int = 4096
    layout: str = "pack"
    tree: bool = False
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if int(self.token_budget) != self.token_budget or self.token_budget < 1:
            raise ValueError(f"token_budget must be a positive int, got {self.token_budget!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PackingConfig":
        """From ``--micro-step-tokens``, ``--packing``, ``--tree-packed-forward``."""
        return cls(token_budget=int(args.micro_step_tokens), layout=args.packing, tree=bool(args.tree_packed_forward))


@dataclass(slots=True)
class MicroStep:
    """One micro-step: model input, targets and per-execution objective inputs.

    Model input (``b`` sequences of ``s`` columns; ``pack``: ``b = 1``):

    * ``input_ids`` -- ``int64 [b, s]``; ``position_ids`` -- ``int64 [b, s]`` (depth in the row;
      0 in padding).
    * ``segment_ids`` -- ``int32 [b, s]``: segment of each column, ``-1`` = padding.
    * ``segment_row`` / ``segment_start`` / ``segment_length`` -- ``int64 [n_seg]``: batch row,
      first column and length of each segment.
    * ``segment_parent`` -- ``int64 [n_seg]``: parent segment (``-1`` = root);
      ``segment_parent_offset`` -- ``int64 [n_seg]``: last visible offset inside the parent.

    Targets (``N``):

    * ``target_index`` -- ``int64 [N]``: flat column ``row * s + col`` whose logits predict the
      target (repeats allowed); ``target_ids`` -- ``int64 [N]``;
      ``behaviour_logprobs`` -- ``float32 [N]``; ``target_execution`` -- ``int64 [N]`` into the
      execution arrays below.

    Executions present (``E_m``): ``execution_ids`` (``list[str]``), ``num_execution_targets``
    (``int64``, ``L_i``), ``advantages`` (``float64``), ``counted`` (``bool``: counted in
    ``|E|`` here), ``split`` (``bool``: rows also in other micro-steps), ``log_ratio_sum``
    (``float64``, NaN until the forward-only pass fills it for split executions).

    Accounting (tokens): ``row_tokens`` -- tokens of the (cut) rows it represents;
    ``token_budget``.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    segment_row: np.ndarray
    segment_start: np.ndarray
    segment_length: np.ndarray
    segment_parent: np.ndarray
    segment_parent_offset: np.ndarray
    target_index: np.ndarray
    target_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    target_execution: np.ndarray
    execution_ids: list[str]
    num_execution_targets: np.ndarray
    advantages: np.ndarray
    counted: np.ndarray
    split: np.ndarray
    log_ratio_sum: np.ndarray
    row_tokens: int
    token_budget: int
    num_rows: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """``(b, s)``."""
        return int(self.input_ids.shape[0]), int(self.input_ids.shape[1])

    @property
    def real_tokens(self) -> int:
        """Non-padding columns (tokens run through the model that are not padding)."""
        return int(self.segment_length.sum())

    @property
    def forward_tokens(self) -> int:
        """``b * s``: columns the model computes, padding included."""
        b, s = self.shape
        return b * s

    @property
    def num_targets(self) -> int:
        """``N``."""
        return int(self.target_ids.shape[0])

    @property
    def is_causal(self) -> bool:
        """Every batch row holds one sequence from column 0 (``pad`` without tree sharing): a plain
        causal mask gives real tokens exactly their context (right padding is never attended by
        real tokens), so the model can use its causal kernel instead of :meth:`attention_mask`."""
        return bool((self.segment_parent < 0).all() and (self.segment_start == 0).all())

    def attention_mask(self) -> np.ndarray:
        """``bool [b, s, s]``: True where query column ``q`` may attend key column ``k``.

        A column sees its own segment up to itself and, in every ancestor segment, the tokens up
        to the branching point. Padding columns see only themselves (keeps softmax finite).
        Megatron wants the complement (True = masked) as ``[b, 1, s, s]``.
        """
        b, s = self.shape
        allowed = np.zeros((b, s, s), dtype=bool)
        tri_cache: dict[int, np.ndarray] = {}
        for g in range(len(self.segment_start)):
            r, a, n = int(self.segment_row[g]), int(self.segment_start[g]), int(self.segment_length[g])
            tri = tri_cache.get(n)
            if tri is None:
                tri = tri_cache[n] = np.tril(np.ones((n, n), dtype=bool))
            allowed[r, a:a + n, a:a + n] = tri
            p, off = int(self.segment_parent[g]), int(self.segment_parent_offset[g])
            while p >= 0:
                pa = int(self.segment_start[p])
                allowed[r, a:a + n, pa:pa + off + 1] = True
                p, off = int(self.segment_parent[p]), int(self.segment_parent_offset[p])
        pad_r, pad_c = np.nonzero(self.segment_ids < 0)
        allowed[pad_r, pad_c, pad_c] = True
        return allowed

    def ancestor_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """The attention pattern of :meth:`attention_mask` in ``O(s)``: ``(enter, exit)``, ``int64
        [b, s]``, such that column ``q`` may attend column ``k`` (same row) iff
        ``enter[k] <= enter[q] <= exit[k]``.

        Columns form a tree per row: a column's parent is the previous column of its segment, and
        a segment's first column hangs under its parent segment's branching point (``start +
        parent_offset``); a column sees exactly its ancestors and itself.  ``enter`` is a column's
        pre-order number in that tree and ``exit`` the largest pre-order number below it (padding
        columns are roots of their own).  This is what a kernel that never builds the ``[s, s]``
        mask needs (e.g. a FlexAttention ``mask_mod``).
        """
        b, s = self.shape
        parent = np.full((b, s), -1, dtype=np.int64)
        for g in range(len(self.segment_start)):
            r, a, n = int(self.segment_row[g]), int(self.segment_start[g]), int(self.segment_length[g])
            parent[r, a + 1:a + n] = np.arange(a, a + n - 1)
            p = int(self.segment_parent[g])
            if p >= 0:
                parent[r, a] = int(self.segment_start[p]) + int(self.segment_parent_offset[g])
        enter = np.zeros((b, s), dtype=np.int64)
        exit_ = np.zeros((b, s), dtype=np.int64)
        for r in range(b):
            children: list[list[int]] = [[] for _ in range(s)]
            roots = []
            for c in range(s):
                (children[parent[r, c]] if parent[r, c] >= 0 else roots).append(c)
            counter = 0
            for root in roots:
                stack = [(root, False)]
                while stack:
                    c, done = stack.pop()
                    if done:
                        exit_[r, c] = counter - 1
                        continue
                    enter[r, c] = counter
                    counter += 1
                    stack.append((c, True))
                    stack.extend((k, False) for k in reversed(children[c]))
        return enter, exit_


@dataclass(slots=True)
class PackingStats:
    """Token accounting of one :meth:`MicroStepPacker.pack` call (counts in tokens).

    * ``row_tokens`` -- tokens of the rows after cutting after the last target;
    * ``input_row_tokens`` -- tokens of the rows as given (materialised);
    * ``real_tokens`` -- non-padding tokens the model runs (``< row_tokens`` with ``tree``);
    * ``forward_tokens`` -- ``sum b * s`` (padding included);
    * ``budget_tokens`` -- ``micro_steps * token_budget``;
    * ``efficiency`` -- ``real_tokens / budget_tokens`` (packing efficiency);
    * ``padding_fraction`` -- ``1 - real_tokens / forward_tokens``;
    * ``forward_token_ratio`` -- ``real_tokens / row_tokens`` (tree-packed forward saving; 1
      without ``tree``); ``tokens_saved`` -- ``row_tokens - real_tokens``.
    """

    rows: int = 0
    dropped_rows: int = 0
    executions: int = 0
    split_executions: int = 0
    micro_steps: int = 0
    targets: int = 0
    input_row_tokens: int = 0
    row_tokens: int = 0
    real_tokens: int = 0
    forward_tokens: int = 0
    budget_tokens: int = 0

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.budget_tokens if self.budget_tokens else math.nan

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.forward_tokens if self.forward_tokens else math.nan

    @property
    def forward_token_ratio(self) -> float:
        return self.real_tokens / self.row_tokens if self.row_tokens else math.nan

    @property
    def tokens_saved(self) -> int:
        return self.row_tokens - self.real_tokens

    def as_dict(self) -> dict[str, float]:
        """Every field and derived ratio."""
        d = {k: getattr(self, k) for k in self.__slots__}
        d.update(efficiency=self.efficiency, padding_fraction=self.padding_fraction,
                 forward_token_ratio=self.forward_token_ratio, tokens_saved=self.tokens_saved)
        return d


@dataclass(slots=True)
class PackResult:
    """``micro_steps`` in order, and their :class:`PackingStats`."""

    micro_steps: list[MicroStep]
    stats: PackingStats = field(default_factory=PackingStats)


# --------------------------------------------------------------------------- units


@dataclass(slots=True)
class _Row:
    tokens: np.ndarray  # int64, cut
    target_pos: np.ndarray  # int64 positions t (>= 1) of targets in the row
    target_ids: np.ndarray
    blp: np.ndarray  # float32


@dataclass(slots=True)
class _Unit:
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
        return int(self.tokens.shape[0])


def _build_unit(execution: int, rows: list[_Row], tree: bool) -> _Unit:
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
    return _Unit(execution, tokens, positions, seg_start, seg_len, seg_parent, seg_off,
                 np.concatenate(srcs), np.concatenate(ids), np.concatenate(blps),
                 row_tokens=sum(int(r.tokens.shape[0]) for r in rows), rows=len(rows))


def _cost(layout: str, lengths: list[int]) -> int:
    if not lengths:
        return 0
    return sum(lengths) if layout == "pack" else len(lengths) * max(lengths)


# --------------------------------------------------------------------------- packer


class MicroStepPacker:
    """Rows of admitted trajectories -> micro-steps.

    * Rows without targets are dropped; each row is cut after its last target's *predecessor*
      (token ``t`` is predicted from position ``t - 1``, so tokens from the last target on are
      never an input).  An execution whose rows carry no target (``L_i = 0``) is not in ``E``.
    * An execution's rows stay in one micro-step when they fit the budget.  Otherwise its rows
      (or tries) are placed separately, the execution is marked ``split`` and its ``s_i`` must
      come from a forward-only pass first (``log_ratio_sum``;
      :func:`gyre.training.step.precompute_log_ratio_sums`).  Exactly one micro-step (the first
      holding the execution) counts it in ``|E|``.
    * Placement is first-fit decreasing by cost (ties in input order).

    Pure and deterministic: the same rows in the same order give the same micro-steps.
    """

    def __init__(self, config: PackingConfig | None = None) -> None:
        self.config = config or PackingConfig()

    def pack(self, rows: Sequence) -> PackResult:
        """Pack ``rows`` (:class:`~gyre.trajectory.materialize.TrajectoryRow`) into micro-steps.

        Raises:
            ValueError: a row's arrays disagree in length, a target at position 0 (no context),
                rows of one execution disagree on ``L_i`` or ``A_i``, an execution's row targets
                do not add up to ``L_i`` (a row is missing from the batch), a non-finite
                advantage, or a row (tree: a row's trie) longer than ``token_budget``.
        """
        cfg = self.config
        stats = PackingStats()
        exec_ids: list[str] = []
        by_exec: dict[str, list] = {}
        for row in rows:
            if row.execution_id not in by_exec:
                by_exec[row.execution_id] = []
                exec_ids.append(row.execution_id)
            by_exec[row.execution_id].append(row)
        stats.rows = len(rows)
        stats.input_row_tokens = sum(int(np.asarray(r.input_ids).shape[0]) for r in rows)

        exec_L: list[int] = []
        exec_adv: list[float] = []
        exec_rows: list[list[_Row]] = []
        kept_ids: list[str] = []
        for eid in exec_ids:
            erows = by_exec[eid]
            L = {int(r.num_execution_targets) for r in erows}
            if len(L) != 1:
                raise ValueError(f"execution {eid}: rows disagree on L_i {sorted(L)}")
            adv = {float(r.advantage) for r in erows}
            L_i = L.pop()
            prepared = [p for p in (self._prepare(r) for r in erows) if p is not None]
            stats.dropped_rows += len(erows) - len(prepared)
            n_targets = sum(int(p.target_pos.shape[0]) for p in prepared)
            if n_targets != L_i:
                raise ValueError(f"execution {eid}: rows hold {n_targets} targets but L_i = {L_i} "
                                 "(a row of the execution is missing from the batch?)")
            if L_i == 0:
                continue
            if len(adv) != 1 or not math.isfinite(next(iter(adv))):
                raise ValueError(f"execution {eid}: advantage must be one finite value, got {sorted(adv)}")
            kept_ids.append(eid)
            exec_L.append(L_i)
            exec_adv.append(adv.pop())
            exec_rows.append(prepared)
            stats.row_tokens += sum(int(p.tokens.shape[0]) for p in prepared)
            stats.targets += L_i
        stats.executions = len(kept_ids)

        # items: (units, cost, order); one item per execution when it fits
        budget = cfg.token_budget
        items: list[list[_Unit]] = []
        order = 0
        for e, prepared in enumerate(exec_rows):
            units = self._units(e, prepared)
            if _cost(cfg.layout, [u.length for u in units]) <= budget:
                groups = [units]
            else:
                groups = [[u] for u in units]
            for g in groups:
                for u in g:
                    u.order = order
                    order += 1
                items.append(g)
        keyed = sorted(range(len(items)),
                       key=lambda i: (-_cost(cfg.layout, [u.length for u in items[i]]), items[i][0].order))
        bins: list[list[_Unit]] = []
        bin_lengths: list[list[int]] = []
        for i in keyed:
            lens = [u.length for u in items[i]]
            for k, bl in enumerate(bin_lengths):
                if _cost(cfg.layout, bl + lens) <= budget:
                    bins[k].extend(items[i])
                    bl.extend(lens)
                    break
            else:
                bins.append(list(items[i]))
                bin_lengths.append(list(lens))

        first_bin: dict[int, int] = {}
        bins_of: dict[int, set[int]] = {}
        for k, units in enumerate(bins):
            units.sort(key=lambda u: u.order)
            for u in units:
                first_bin.setdefault(u.execution, k)
                bins_of.setdefault(u.execution, set()).add(k)
        split = {e for e, ks in bins_of.items() if len(ks) > 1}
        stats.split_executions = len(split)
        micro_steps = []
        for k, units in enumerate(bins):
            ms = self._materialise(units, k, first_bin, split, kept_ids, exec_L, exec_adv)
            micro_steps.append(ms)
            stats.real_tokens += ms.real_tokens
            stats.forward_tokens += ms.forward_tokens
        stats.micro_steps = len(micro_steps)
        stats.budget_tokens = stats.micro_steps * budget
        return PackResult(micro_steps, stats)

    # ----------------------------------------------------------------- helpers

    @staticmethod
    def _prepare(row) -> _Row | None:
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
        return _Row(tokens=ids[:last].astype(np.int64), target_pos=pos,
                    target_ids=ids[pos].astype(np.int64), blp=blp[pos])

    def _units(self, e: int, prepared: list[_Row]) -> list[_Unit]:
        cfg = self.config
        budget = cfg.token_budget
        for p in prepared:
            if p.tokens.shape[0] > budget:
                raise ValueError(f"a row needs {p.tokens.shape[0]} input tokens, more than the micro-step "
                                 f"budget of {budget} (raise --micro-step-tokens)")
        if not cfg.tree:
            return [_build_unit(e, [p], False) for p in prepared]
        whole = _build_unit(e, prepared, True)
        if whole.length <= budget:
            return [whole]
        units: list[_Unit] = []
        cur: list[_Row] = []
        cur_unit: _Unit | None = None
        for p in prepared:
            trial = _build_unit(e, cur + [p], True)
            if cur and trial.length > budget:
                units.append(cur_unit)
                cur, cur_unit = [p], _build_unit(e, [p], True)
            else:
                cur, cur_unit = cur + [p], trial
        units.append(cur_unit)
        return units

    def _materialise(self, units: list[_Unit], k: int, first_bin: dict[int, int], split: set[int],
                     kept_ids: list[str], exec_L: list[int], exec_adv: list[float]) -> MicroStep:
        cfg = self.config
        if cfg.layout == "pack":
            b, s = 1, sum(u.length for u in units)
            places = []
            col = 0
            for u in units:
                places.append((0, col))
                col += u.length
        else:
            b, s = len(units), max(u.length for u in units)
            places = [(i, 0) for i in range(len(units))]
        input_ids = np.full((b, s), cfg.pad_token_id, np.int64)
        position_ids = np.zeros((b, s), np.int64)
        segment_ids = np.full((b, s), -1, np.int32)
        seg_row, seg_start, seg_len, seg_parent, seg_off = [], [], [], [], []
        t_idx, t_ids, t_blp, t_exec = [], [], [], []
        local: dict[int, int] = {}
        for u, (r, c) in zip(units, places):
            n = u.length
            input_ids[r, c:c + n] = u.tokens
            position_ids[r, c:c + n] = u.positions
            base = len(seg_start)
            for g in range(len(u.seg_start)):
                a = c + u.seg_start[g]
                segment_ids[r, a:a + u.seg_len[g]] = base + g
                seg_row.append(r)
                seg_start.append(a)
                seg_len.append(u.seg_len[g])
                seg_parent.append(-1 if u.seg_parent[g] < 0 else base + u.seg_parent[g])
                seg_off.append(u.seg_parent_off[g])
            le = local.setdefault(u.execution, len(local))
            t_idx.append(r * s + c + u.t_src)
            t_ids.append(u.t_ids)
            t_blp.append(u.t_blp)
            t_exec.append(np.full(u.t_src.shape[0], le, np.int64))
        execs = sorted(local, key=local.get)
        return MicroStep(
            input_ids=input_ids,
            position_ids=position_ids,
            segment_ids=segment_ids,
            segment_row=np.asarray(seg_row, np.int64),
            segment_start=np.asarray(seg_start, np.int64),
            segment_length=np.asarray(seg_len, np.int64),
            segment_parent=np.asarray(seg_parent, np.int64),
            segment_parent_offset=np.asarray(seg_off, np.int64),
            target_index=np.concatenate(t_idx).astype(np.int64),
            target_ids=np.concatenate(t_ids).astype(np.int64),
            behaviour_logprobs=np.concatenate(t_blp).astype(np.float32),
            target_execution=np.concatenate(t_exec),
            execution_ids=[kept_ids[e] for e in execs],
            num_execution_targets=np.asarray([exec_L[e] for e in execs], np.int64),
            advantages=np.asarray([exec_adv[e] for e in execs], np.float64),
            counted=np.asarray([first_bin[e] == k for e in execs], bool),
            split=np.asarray([e in split for e in execs], bool),
            log_ratio_sum=np.full(len(execs), np.nan, np.float64),
            row_tokens=sum(u.row_tokens for u in units),
            token_budget=cfg.token_budget,
            num_rows=sum(u.rows for u in units),
        )


def pack_rows(rows: Sequence, config: PackingConfig | None = None) -> PackResult:
    """Shorthand for ``MicroStepPacker(config).pack(rows)``."""
    return MicroStepPacker(config).pack(rows)
