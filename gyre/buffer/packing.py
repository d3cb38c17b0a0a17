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
context (:func:`~gyre.buffer.pack_units.build_unit`).  Segments are contiguous column spans of
one batch row; :meth:`MicroStep.attention_mask` derives the ``[b, s, s]`` mask.

The micro-step and its settings live in :mod:`gyre.buffer.micro_step` (imported here), the units
the packer places (rows, tries) in :mod:`gyre.buffer.pack_units`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gyre.buffer.micro_step import LAYOUTS, MicroStep, PackingConfig, PackingStats, PackResult
from gyre.buffer.pack_units import PreparedRow, Unit, execution_units, layout_cost, prepare_row

__all__ = [
    "LAYOUTS",
    "MicroStep",
    "MicroStepPacker",
    "PackResult",
    "PackingConfig",
    "PackingStats",
    "pack_rows",
]

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
        execs = self._executions(rows, stats)
        bins = self._place(execs)
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
            ms = self._materialise(units, k, first_bin, split, execs.ids, execs.L, execs.adv)
            micro_steps.append(ms)
            stats.real_tokens += ms.real_tokens
            stats.forward_tokens += ms.forward_tokens
        stats.micro_steps = len(micro_steps)
        stats.budget_tokens = stats.micro_steps * cfg.token_budget
        return PackResult(micro_steps, stats)

    # ----------------------------------------------------------------- helpers

    @staticmethod
    def _executions(rows: Sequence, stats: PackingStats) -> "_Executions":
        """The executions of ``rows`` that carry targets, in first-appearance order, with their
        prepared rows, ``L_i`` and ``A_i``; fills the row, token and target counts of ``stats``.
        Raises the :meth:`pack` errors about rows and executions."""
        exec_ids: list[str] = []
        by_exec: dict[str, list] = {}
        for row in rows:
            if row.execution_id not in by_exec:
                by_exec[row.execution_id] = []
                exec_ids.append(row.execution_id)
            by_exec[row.execution_id].append(row)
        stats.rows = len(rows)
        stats.input_row_tokens = sum(int(np.asarray(r.input_ids).shape[0]) for r in rows)
        out = _Executions([], [], [], [])
        for eid in exec_ids:
            erows = by_exec[eid]
            L = {int(r.num_execution_targets) for r in erows}
            if len(L) != 1:
                raise ValueError(f"execution {eid}: rows disagree on L_i {sorted(L)}")
            adv = {float(r.advantage) for r in erows}
            L_i = L.pop()
            prepared = [p for p in (prepare_row(r) for r in erows) if p is not None]
            stats.dropped_rows += len(erows) - len(prepared)
            n_targets = sum(int(p.target_pos.shape[0]) for p in prepared)
            if n_targets != L_i:
                raise ValueError(f"execution {eid}: rows hold {n_targets} targets but L_i = {L_i} "
                                 "(a row of the execution is missing from the batch?)")
            if L_i == 0:
                continue
            if len(adv) != 1 or not math.isfinite(next(iter(adv))):
                raise ValueError(f"execution {eid}: advantage must be one finite value, got {sorted(adv)}")
            out.ids.append(eid)
            out.L.append(L_i)
            out.adv.append(adv.pop())
            out.rows.append(prepared)
            stats.row_tokens += sum(int(p.tokens.shape[0]) for p in prepared)
            stats.targets += L_i
        stats.executions = len(out.ids)
        return out

    def _place(self, execs: "_Executions") -> list[list[Unit]]:
        """The micro-steps' units: one item per execution when its units fit the budget together,
        else one per unit; items placed first-fit decreasing by cost (ties in input order)."""
        cfg = self.config
        budget = cfg.token_budget
        items: list[list[Unit]] = []
        order = 0
        for e, prepared in enumerate(execs.rows):
            units = execution_units(e, prepared, cfg)
            if layout_cost(cfg.layout, [u.length for u in units]) <= budget:
                groups = [units]
            else:
                groups = [[u] for u in units]
            for g in groups:
                for u in g:
                    u.order = order
                    order += 1
                items.append(g)
        keyed = sorted(range(len(items)),
                       key=lambda i: (-layout_cost(cfg.layout, [u.length for u in items[i]]), items[i][0].order))
        bins: list[list[Unit]] = []
        bin_lengths: list[list[int]] = []
        for i in keyed:
            lens = [u.length for u in items[i]]
            for k, bl in enumerate(bin_lengths):
                if layout_cost(cfg.layout, bl + lens) <= budget:
                    bins[k].extend(items[i])
                    bl.extend(lens)
                    break
            else:
                bins.append(list(items[i]))
                bin_lengths.append(list(lens))
        return bins

    def _materialise(self, units: list[Unit], k: int, first_bin: dict[int, int], split: set[int],
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


@dataclass(slots=True)
class _Executions:
    """The executions a batch trains on: ids, prepared rows, ``L_i`` and ``A_i``, index-aligned."""

    ids: list[str]
    rows: list[list[PreparedRow]]
    L: list[int]
    adv: list[float]


def pack_rows(rows: Sequence, config: PackingConfig | None = None) -> PackResult:
    """Shorthand for ``MicroStepPacker(config).pack(rows)``."""
    return MicroStepPacker(config).pack(rows)
