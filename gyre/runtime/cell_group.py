"""The ranks of one cell: layout, the leader's orders to the other ranks, and their agreement.

Layout: ``WORLD_SIZE = num_cells x ranks_per_cell`` with ``ranks_per_cell = TP x PP``; cell ``c``
owns the contiguous global ranks ``c * R .. c * R + R - 1`` and a rank's *shard* is its offset in
its cell (the same TP/PP coordinates in every cell, so shard ``s`` of every cell holds the same
slice of the model).  The cell's **leader** (shard 0) alone talks to rank 0's controller: it
receives the control messages, owns the cell's engine and replies.  Every operation that needs the
cell's other ranks -- a training micro-step, the TP gather of a publication, offloading or restoring
the training state -- is an *order*: the leader stores ``(name, args)`` once in the run's TCPStore,
under the cell's next order number, which every other rank reads in turn, and runs the same
operation itself, so all ranks of the cell run it in the same
order (their collectives inside the model meet).  Orders travel through the store, not a
collective, so a rank may wait for the next one as long as the cell is idle.  ``agree_*`` are
small collectives over the cell's process group, for decisions every rank must share.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CellLayout:
    """Where global rank ``rank`` sits: ``cell``, ``shard`` and the cell's ``ranks``."""

    rank: int
    num_cells: int
    ranks_per_cell: int

    @property
    def cell(self) -> int:
        return self.rank // self.ranks_per_cell

    @property
    def shard(self) -> int:
        return self.rank % self.ranks_per_cell

    @property
    def ranks(self) -> list[int]:
        return [self.cell * self.ranks_per_cell + s for s in range(self.ranks_per_cell)]

    @property
    def leader(self) -> int:
        return self.cell * self.ranks_per_cell

    @property
    def is_leader(self) -> bool:
        return self.shard == 0

    def leaders(self) -> list[int]:
        """Global rank of every cell's leader, by cell."""
        return [c * self.ranks_per_cell for c in range(self.num_cells)]


class CellGroup:
    """This rank's view of its cell (module docstring).

    Args:
        layout: where this rank sits.
        store: the run's ``torch.distributed`` store (a client this thread may block on).
        group: the cell's process group (``None`` with one rank per cell).
        poll_s: first polling interval while waiting for an order.
    """

    def __init__(self, layout: CellLayout, store=None, group=None, poll_s: float = 0.002):
        self.layout, self.store, self.group, self.poll_s = layout, store, group, poll_s
        self._sent = 0
        self._received = 0

    @classmethod
    def alone(cls, cell: int) -> "CellGroup":
        """A cell of one rank (no orders, no collectives)."""
        return cls(CellLayout(cell, cell + 1, 1))

    @classmethod
    def build(cls, rank: int, num_cells: int, ranks_per_cell: int, store) -> "CellGroup":
        """Create every cell's process group (a collective: every rank calls it) and return this rank's."""
        import torch.distributed as dist

        layout = CellLayout(rank, num_cells, ranks_per_cell)
        mine = None
        if ranks_per_cell > 1:
            for c in range(num_cells):
                g = dist.new_group([c * ranks_per_cell + s for s in range(ranks_per_cell)])
                if c == layout.cell:
                    mine = g
        return cls(layout, store, mine)

    @property
    def size(self) -> int:
        return self.layout.ranks_per_cell

    @property
    def is_leader(self) -> bool:
        return self.layout.is_leader

    def _key(self, i: int) -> str:
        return f"cellorder/{self.layout.cell}/{i}"

    def order(self, name: str, *args: Any) -> None:
        """Leader: send order ``name(*args)`` to every other rank of the cell (no-op when alone).
        It is stored once; the last rank to read it deletes it."""
        if self.size == 1:
            return
        self.store.set(self._key(self._sent), pickle.dumps((name, args)))
        self._sent += 1

    def next_order(self, timeout_s: float = 6 * 3600) -> tuple[str, tuple]:
        """Another rank: block for the leader's next order ``(name, args)``.

        Raises:
            TimeoutError: none within ``timeout_s``.
        """
        key = self._key(self._received)
        deadline = time.monotonic() + timeout_s
        delay = self.poll_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell {self.layout.cell} shard {self.layout.shard}: no order from the leader "
                                   f"within {timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        name, args = pickle.loads(self.store.get(key))
        if self.store.add(key + "/read", 1) == self.size - 1:  # every other rank has it
            self.store.delete_key(key)
            self.store.delete_key(key + "/read")
        self._received += 1
        return name, args

    def agree_min_max(self, value: int) -> tuple[int, int]:
        """``(min, max)`` of ``value`` over the cell's ranks (every rank calls it)."""
        if self.group is None:
            return value, value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0]), int(-t[1])

    def agree_all(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank of the cell (every rank calls it)."""
        return self.agree_min_max(int(bool(flag)))[0] == 1

    def share(self, value: Any) -> Any:
        """The leader's ``value`` on every rank of the cell (every rank calls it)."""
        if self.group is None:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=self.layout.leader, group=self.group)
        return box[0]
