"""What stream packing produces (:mod:`gyre.buffer.packing`): :class:`MicroStep` (one micro-step of
training input, its targets and its attention), with :class:`PackingConfig`,
:class:`PackingStats` and :class:`PackResult`."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LAYOUTS", "MicroStep", "PackResult", "PackingConfig", "PackingStats"]

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
