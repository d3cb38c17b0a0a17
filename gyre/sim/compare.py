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
