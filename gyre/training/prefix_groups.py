"""Prefix communication groups for streaming training with dynamic membership (paper §4.4).

Cells join training in ascending order, so the participants of a step are always a prefix
``{0..k}`` of the cells.  At start-up, for every ``k = 1..K-1``, one set of process groups is built
that connects, for each model-shard position inside a cell (its TP x PP coordinate), the ranks
holding that shard in cells ``0..k``.  A gradient all-reduce over participants ``{0..k}`` then uses
the set for ``k``: no group has to be created while a batch is in progress (creating a group is a
collective over the whole world).

Rank layout: cell ``c`` owns global ranks ``c * R .. (c + 1) * R - 1`` (``R`` ranks per cell); the
shard position of a rank is its offset inside the cell.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def prefix_group_ranks(num_cells: int, ranks_per_cell: int) -> dict[int, list[list[int]]]:
    """Pure layout: ``{k: [ranks of shard position s in cells 0..k] for s in range(R)}``, ``k = 1..K-1``.

    Raises:
        ValueError: ``num_cells < 1`` or ``ranks_per_cell < 1``.

    >>> prefix_group_ranks(3, 2)
    {1: [[0, 2], [1, 3]], 2: [[0, 2, 4], [1, 3, 5]]}
    """
    if num_cells < 1 or ranks_per_cell < 1:
        raise ValueError(f"need num_cells >= 1 and ranks_per_cell >= 1, got {num_cells}, {ranks_per_cell}")
    return {k: [[c * ranks_per_cell + s for c in range(k + 1)] for s in range(ranks_per_cell)]
            for k in range(1, num_cells)}


@dataclass
class PrefixGroups:
    """The process groups of :func:`prefix_group_ranks`, built once on every rank.

    ``group(k)`` is this rank's group for participants ``{0..k}`` (``None`` if this rank's cell is
    not in the prefix, or ``k == 0``: a lone core needs no collective).
    """

    num_cells: int
    ranks_per_cell: int
    _groups: dict[int, object] = field(default_factory=dict)
    _members: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def build(cls, num_cells: int, ranks_per_cell: int, backend: str | None = None) -> "PrefixGroups":
        """Create every group with ``torch.distributed.new_group`` (a collective: all ranks call it)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        self = cls(num_cells, ranks_per_cell)
        for k, shard_sets in prefix_group_ranks(num_cells, ranks_per_cell).items():
            for ranks in shard_sets:
                g = dist.new_group(ranks, backend=backend)  # every rank takes part in every new_group
                if rank in ranks:
                    self._groups[k] = g
                    self._members[k] = ranks
        return self

    def cell_of(self, rank: int) -> int:
        return rank // self.ranks_per_cell

    def group(self, k: int):
        """Group for participants ``{0..k}`` containing this rank, or ``None``."""
        return self._groups.get(k)

    def members(self, k: int) -> list[int]:
        """Global ranks of this rank's group for ``{0..k}`` (empty if not a member)."""
        return list(self._members.get(k, []))
