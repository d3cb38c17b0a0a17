"""Route table: which execution is pinned to which engine, and the capacity left.

Routes are the standalone pool (:data:`~gyre.scheduler.events.STANDALONE`, capacity ``c_s``) and
the cells ``0..K-1`` (capacity ``c`` each while in rollout).  The table only stores occupancy;
which routes may take work is the scheduler's decision (cells in rollout, plus the standalone
pool).  Destination order, for launches and for reroutes alike: standalone first, then rollout
cells in *descending* cell order -- they stay in rollout longest, since cells enter training in
ascending order.
"""

from __future__ import annotations

from typing import Iterable

from .events import STANDALONE


class RouteTable:
    """Occupancy per route; the concurrency limits are enforced by :meth:`assign`.

    Args:
        num_cells: ``K``.
        concurrency_per_cell: ``c``.
        standalone_concurrency: ``c_s`` (0: no standalone pool).
    """

    def __init__(self, num_cells: int, concurrency_per_cell: int, standalone_concurrency: int) -> None:
        self.capacity: dict[int, int] = {cell: concurrency_per_cell for cell in range(num_cells)}
        self.capacity[STANDALONE] = standalone_concurrency
        # insertion-ordered dicts used as ordered sets: deterministic reroute order
        self._occupants: dict[int, dict[int, None]] = {route: {} for route in self.capacity}

    def occupancy(self, route: int) -> int:
        """Executions currently pinned to ``route``."""
        return len(self._occupants[route])

    def occupants(self, route: int) -> list[int]:
        """Execution ids on ``route``, in the order they were assigned."""
        return list(self._occupants[route])

    def free(self, route: int) -> int:
        """Slots left on ``route`` (capacity minus occupancy)."""
        return self.capacity[route] - len(self._occupants[route])

    def assign(self, execution_id: int, route: int) -> None:
        """Pin ``execution_id`` to ``route``; raise ``RuntimeError`` if it is full."""
        occ = self._occupants[route]
        if len(occ) >= self.capacity[route]:
            raise RuntimeError(f"route {route} is full ({self.capacity[route]} executions)")
        occ[execution_id] = None

    def release(self, execution_id: int, route: int) -> None:
        """Unpin ``execution_id`` from ``route`` (it finished)."""
        del self._occupants[route][execution_id]

    @staticmethod
    def destination_order(rollout_cells: Iterable[int], has_standalone: bool) -> list[int]:
        """Standalone first (if any), then the given rollout cells in descending order."""
        order = sorted(rollout_cells, reverse=True)
        return ([STANDALONE] if has_standalone else []) + order

    def plan_evacuation(self, source: int, destinations: list[int]) -> list[tuple[int, list[int]]]:
        """Split ``source``'s executions over ``destinations`` (in order, up to their free slots).

        Returns ``[(dest, execution_ids), ...]`` without changing the table.

        Raises:
            RuntimeError: the destinations cannot hold every execution (the capacity check
                that precedes a cell's departure makes this unreachable).
        """
        pending = self.occupants(source)
        plan: list[tuple[int, list[int]]] = []
        for dest in destinations:
            if not pending:
                break
            if dest == source:
                continue
            take = min(self.free(dest), len(pending))
            if take > 0:
                plan.append((dest, pending[:take]))
                pending = pending[take:]
        if pending:
            raise RuntimeError(f"no capacity to reroute {len(pending)} executions off route {source}")
        return plan

    def move(self, execution_ids: list[int], source: int, dest: int) -> None:
        """Re-pin executions from ``source`` to ``dest``."""
        for eid in execution_ids:
            self.release(eid, source)
            self.assign(eid, dest)
