"""The paper's Table 1 ablations as simulator configurations (``tools/simulate.py --table1``).

Each entry of :data:`TABLE1` is a :class:`Ablation`: a placement, its ``(phi, mu)``, the
streaming switch, the cell size and standalone nodes (:func:`gyre.sim.compare.regroup`), and for
Async the training nodes.  All run at ``E[d] = phi + (mu - 1)/2 = 1.5`` on the preset's nodes
(32 on ``paper-nl2repo``).  :func:`run_table1` simulates them over several seeds (in worker
processes) and reports each one's mean hours with a 95 % interval, its time relative to ``E0``,
every pairwise ratio with its interval, and the figures of :mod:`gyre.sim.mechanisms` that show
what each ablation changes.

Choices the paper's table leaves open (fixed here):

* ``A1`` moves one 4-node group from training to rollout (2 of 8 cells train instead of 3);
* ``A2``'s longer bursts are ``(0.5, 3)``, elastic's shape;
* ``C1``'s extra dispatch is ``(0.5, 3)``: with 4 standalone nodes the 7 colocated cells switch
  together once the unfinished executions fit on the standalone pool (``standalone_handoff``)
  and, without streaming, once the burst's ``mu * B`` groups are ready; ``C2`` drops the second
  condition, so it trains on the groups already complete while the rest arrive;
* ``C3`` has 8 standalone nodes (6 colocated cells).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from scipy import stats

from .cluster import ClusterSim
from .compare import regroup
from .mechanisms import mechanism_figures
from .presets import Preset

#: Mean staleness every Table 1 configuration runs at.
TABLE1_MEAN_STALENESS = 1.5


@dataclass(slots=True, frozen=True)
class Ablation:
    """One Table 1 configuration (see the module doc)."""

    placement: str
    phi: float
    mu: int
    streaming: bool
    description: str
    nodes_per_cell: int | None = None      # None: the preset's
    standalone_nodes: int = 0
    train_nodes: int | None = None         # async: nodes fixed in training (None: the preset's split)

    def preset(self, base: Preset) -> Preset:
        """``base`` regrouped and configured for this ablation (``max_steps`` left as is)."""
        p = regroup(base, self.nodes_per_cell, self.standalone_nodes)
        sched = replace(p.scheduler, placement=self.placement, phi=self.phi, mu=self.mu, streaming=self.streaming,
                        standalone_handoff=self.placement == "colocate" and self.standalone_nodes > 0)
        if self.train_nodes is not None:
            sched = replace(sched, train_cells=self.train_nodes // p.nodes_per_cell)
        return replace(p, scheduler=sched)


TABLE1: dict[str, Ablation] = {
    "A0": Ablation("async", 1.5, 1, False, "Async base: fixed split, 3 of 8 cells train"),
    "A1": Ablation("async", 1.5, 1, False, "A0 with 4 nodes moved from training to rollout", train_nodes=8),
    "A2": Ablation("async", 0.5, 3, False, "A0 with 3-step bursts"),
    "A3": Ablation("async", 1.5, 1, True, "A0 + streaming training"),
    "C0": Ablation("colocate", 0.0, 4, False, "Colocate base: the whole pool switches"),
    "C1": Ablation("colocate", 0.5, 3, False, "C0 with 4 standalone nodes, 28 colocated", standalone_nodes=4),
    "C2": Ablation("colocate", 0.5, 3, True, "C1 + streaming training", standalone_nodes=4),
    "C3": Ablation("colocate", 0.5, 3, True, "C2 with 8 standalone nodes", standalone_nodes=8),
    "E0": Ablation("elastic", 0.5, 3, True, "elastic base: 8 cells x 4 nodes, streaming"),
    "E1": Ablation("elastic", 1.5, 1, True, "E0 with (phi, mu) = (1.5, 1)"),
    "E2": Ablation("elastic", 0.5, 3, True, "E0 regrouped as 4 cells x 8 nodes", nodes_per_cell=8),
}


def table1_sim(base: Preset, name: str, steps: int, seed: int = 0, check: bool = False) -> ClusterSim:
    """The :class:`ClusterSim` of configuration ``name`` for ``steps`` steps (not yet run)."""
    p = TABLE1[name].preset(base)
    return ClusterSim(replace(p.scheduler, max_steps=steps), p.sim, p.workload, seed=seed, check=check)


def simulate_config(base: Preset, name: str, steps: int, seed: int) -> dict:
    """One configuration, one seed: ``hours``, ``phi``, ``mu``, ``mean_staleness``,
    ``staleness_after_warmup`` (the steps fed by the start-up dispatch left out: their staleness
    is their step number), ``switches`` and :func:`~gyre.sim.mechanisms.mechanism_figures`."""
    sim = table1_sim(base, name, steps, seed)
    r = sim.run()
    warm = math.ceil((r.phi + r.mu) / r.mu) * r.mu  # steps whose groups still come from the start-up dispatch
    late = [d for _, step, d in sim.sched.queue.staleness_log if step >= warm]
    return {"hours": r.hours, "phi": r.phi, "mu": r.mu, "mean_staleness": r.mean_staleness,
            "staleness_after_warmup": sum(late) / len(late) if late else None, "switches": r.switches,
            "mechanisms": mechanism_figures(sim)}


def mean_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, list[float] | None]:
    """Mean of ``xs`` and its Student-t ``level`` interval (``None`` with fewer than 2 values)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return m, [m - half, m + half]


def _rounded(ci: list[float] | None, digits: int) -> list[float] | None:
    return None if ci is None else [round(x, digits) for x in ci]


def _run_one(job: tuple[Preset, str, int, int]) -> dict:
    return simulate_config(*job)


def run_table1(base: Preset, steps: int, seeds: Sequence[int] = (0,), names: Sequence[str] | None = None,
               workers: int | None = None, on_done: Callable[[], None] | None = None) -> dict:
    """Simulate the Table 1 configurations over ``seeds``; return the ``--table1 --json`` object.

    ``{"steps", "seeds", "configs": {name: {"hours", "hours_ci", "time_vs_E0", "time_vs_E0_ci",
    "phi", "mu", "mean_staleness", "staleness_after_warmup", "switches", "mechanisms"}},
    "ratios": {"X/Y": {"mean", "ci", "within_noise"}}, "within_noise": ["X/Y", ...]}``.
    ``hours`` and the other figures are means over the seeds; the intervals are 95 % Student-t
    intervals over the seeds (``None`` for one seed).  A ratio is taken seed by seed (the
    configurations share each seed's workload stream) for every pair in table order;
    ``within_noise`` lists the pairs whose interval contains 1.  ``time_vs_E0`` is ``None`` when
    ``E0`` is not among ``names``.  ``workers`` processes run the simulations (default: one per
    core; 1 runs them here); the result does not depend on it.  ``on_done()`` is called after
    each simulation.
    """
    names = list(TABLE1) if names is None else list(names)
    seeds = list(seeds)
    jobs = [(base, n, steps, s) for n in names for s in seeds]
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    if workers <= 1:
        runs = []
        for job in jobs:
            runs.append(_run_one(job))
            if on_done:
                on_done()
    else:
        with ProcessPoolExecutor(workers) as pool:
            runs = []
            for r in pool.map(_run_one, jobs):
                runs.append(r)
                if on_done:
                    on_done()
    by = {n: runs[i * len(seeds):(i + 1) * len(seeds)] for i, n in enumerate(names)}
    hours = {n: [r["hours"] for r in rs] for n, rs in by.items()}

    def ratio(a: str, b: str) -> dict:
        m, ci = mean_interval([x / y for x, y in zip(hours[a], hours[b])])
        return {"mean": round(m, 4), "ci": _rounded(ci, 4), "within_noise": ci is not None and ci[0] <= 1.0 <= ci[1]}

    configs = {}
    for n, rs in by.items():
        h, h_ci = mean_interval(hours[n])
        vs = ratio(n, "E0") if "E0" in by else None
        warm = [r["staleness_after_warmup"] for r in rs if r["staleness_after_warmup"] is not None]
        configs[n] = {
            "hours": round(h, 3), "hours_ci": _rounded(h_ci, 3),
            "time_vs_E0": None if vs is None else vs["mean"], "time_vs_E0_ci": None if vs is None else vs["ci"],
            "phi": rs[0]["phi"], "mu": rs[0]["mu"],
            "mean_staleness": round(sum(r["mean_staleness"] for r in rs) / len(rs), 4),
            "staleness_after_warmup": round(sum(warm) / len(warm), 4) if warm else None,
            "switches": round(sum(r["switches"] for r in rs) / len(rs), 1),
            "mechanisms": {k: round(sum(r["mechanisms"][k] for r in rs) / len(rs), 4) for k in rs[0]["mechanisms"]},
        }
    ratios = {f"{a}/{b}": ratio(a, b) for i, a in enumerate(names) for b in names[i + 1:]}
    return {"steps": steps, "seeds": seeds, "configs": configs, "ratios": ratios,
            "within_noise": [k for k, v in ratios.items() if v["within_noise"]]}
