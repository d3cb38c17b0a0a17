"""Compare placements at matched mean staleness (paper §6).

Each placement gets the ``(phi, mu)`` whose App. A mean staleness ``phi + (mu - 1)/2`` equals the
requested ``E``: Async ``(E, 1)``, Colocate ``(0, 2E + 1)``, elastic ``(0, 3)`` at ``E = 1``,
``(0.5, 3)`` at ``E = 1.5`` and in general ``mu = 3, phi = E - 1`` for ``E >= 1`` (``(0, 2E + 1)``
below), or an explicit ``(phi, mu)``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from gyre.scheduler import SchedulerConfig

from .cluster import ClusterSim, SimResult
from .presets import Preset


def staleness_shape(placement: str, mean_staleness: float,
                    elastic: tuple[float, int] | None = None) -> tuple[float, int]:
    """``(phi, mu)`` of ``placement`` for mean staleness ``E`` (module doc).

    Raises:
        ValueError: ``E < 0``, a Colocate ``2E + 1`` that is not a whole number, an explicit
            elastic shape whose mean differs from ``E``, or an unknown placement.
    """
    e = float(mean_staleness)
    if not e >= 0:
        raise ValueError(f"mean staleness must be >= 0, got {mean_staleness}")

    def whole(x: float, what: str) -> int:
        if abs(x - round(x)) > 1e-9:
            raise ValueError(f"{what} = {x:g} is not a whole number of steps (use E in steps of 0.5)")
        return int(round(x))

    if placement == "async":
        return e, 1
    if placement == "colocate":
        return 0.0, whole(2 * e + 1, "colocate mu = 2E + 1")
    if placement == "elastic":
        if elastic is not None:
            phi, mu = float(elastic[0]), int(elastic[1])
            if abs(phi + (mu - 1) / 2 - e) > 1e-9:
                raise ValueError(f"elastic (phi={phi:g}, mu={mu}) has mean staleness {phi + (mu - 1) / 2:g}, not {e:g}")
            return phi, mu
        if e >= 1:
            return e - 1.0, 3
        return 0.0, whole(2 * e + 1, "elastic mu = 2E + 1")
    raise ValueError(f"unknown placement {placement!r}")


def placement_config(preset: Preset, placement: str, mean_staleness: float, steps: int,
                     elastic: tuple[float, int] | None = None, train_cells: int | None = None) -> SchedulerConfig:
    """The scheduler configuration of one placement on ``preset`` at mean staleness ``E``.

    Raises:
        ValueError: from :func:`staleness_shape` or :class:`SchedulerConfig` validation.
    """
    phi, mu = staleness_shape(placement, mean_staleness, elastic)
    return replace(preset.scheduler, placement=placement, phi=phi, mu=mu, max_steps=steps,
                   train_cells=preset.scheduler.train_cells if train_cells is None else train_cells)


def run_placement(preset: Preset, placement: str, mean_staleness: float, steps: int, seed: int = 0,
                  elastic: tuple[float, int] | None = None, train_cells: int | None = None,
                  on_step: Callable[[int], None] | None = None) -> SimResult:
    """Simulate ``steps`` optimizer steps of one placement on ``preset`` at mean staleness ``E``."""
    cfg = placement_config(preset, placement, mean_staleness, steps, elastic, train_cells)
    return ClusterSim(cfg, preset.sim, preset.workload, seed=seed).run(on_step=on_step)


def compare(preset: Preset, placements: Sequence[str], mean_staleness: float, steps: int, seed: int = 0,
            elastic: tuple[float, int] | None = None, train_cells: int | None = None,
            on_step: Callable[[int], None] | None = None) -> dict:
    """Run each placement (same seed) and return the ``tools/simulate.py --json`` object.

    ``{"placements": {name: SimResult.summary()}, "speedup_over": {baseline: hours(baseline) /
    hours(elastic)}}``; ``speedup_over`` is empty without an elastic run.  The full results are
    returned under the private key ``"_results"`` (not printed).
    """
    results: dict[str, SimResult] = {}
    for p in placements:
        results[p] = run_placement(preset, p, mean_staleness, steps, seed, elastic, train_cells, on_step)
    speedup = {}
    if "elastic" in results:
        for p, r in results.items():
            if p != "elastic":
                speedup[p] = round(r.hours / results["elastic"].hours, 4)
    return {"placements": {p: r.summary() for p, r in results.items()}, "speedup_over": speedup,
            "_results": results}


def regroup(preset: Preset, nodes_per_cell: int | None = None, standalone_nodes: int = 0) -> Preset:
    """``preset``'s nodes regrouped into cells of ``nodes_per_cell`` plus a standalone pool.

    The node count (``num_cells * preset.nodes_per_cell`` plus the nodes of an existing
    standalone pool) stays; per node, rollout concurrency (``rollout_concurrency_per_cell /
    nodes_per_cell``) and training speed are kept, so a cell of twice the nodes serves twice
    the executions and does a step's work in half the time (``train_step_cell_s`` scales by
    ``preset.nodes_per_cell / nodes_per_cell``).  Standalone nodes are taken from the cells and
    serve the same per-node concurrency.  Async's ``train_cells`` is kept as a node count
    (rounded down, at least 1).

    Raises:
        ValueError: the node counts do not divide, or no cell is left.
    """
    old = preset.nodes_per_cell
    per_node_c, rem = divmod(preset.scheduler.rollout_concurrency_per_cell, old)
    if rem:
        raise ValueError(f"rollout concurrency {preset.scheduler.rollout_concurrency_per_cell} is not a "
                         f"whole number per node for {old}-node cells")
    npc = old if nodes_per_cell is None else int(nodes_per_cell)
    if npc < 1 or standalone_nodes < 0:
        raise ValueError(f"need nodes_per_cell >= 1 and standalone_nodes >= 0, got {npc}, {standalone_nodes}")
    standalone_before = preset.scheduler.standalone_concurrency // per_node_c
    nodes = preset.scheduler.num_cells * old + standalone_before
    cells, rem = divmod(nodes - standalone_nodes, npc)
    if rem or cells < 1:
        raise ValueError(f"{nodes} nodes minus {standalone_nodes} standalone do not make whole {npc}-node cells")
    sched = replace(preset.scheduler, num_cells=cells, rollout_concurrency_per_cell=per_node_c * npc,
                    standalone_concurrency=per_node_c * standalone_nodes,
                    train_cells=min(cells, max(1, preset.scheduler.train_cells * old // npc)))
    sim = replace(preset.sim, train_step_cell_s=preset.sim.train_step_cell_s * old / npc)
    return replace(preset, scheduler=sched, sim=sim, nodes_per_cell=npc,
                   description=f"{preset.description}; regrouped as {cells} x {npc} nodes "
                               f"+ {standalone_nodes} standalone")
