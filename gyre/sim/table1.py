"""The paper's Table 1 ablations as simulator configurations (``tools/simulate.py --table1``).

Each entry of :data:`TABLE1` is a :class:`Ablation`: a placement, its ``(phi, mu)``, the
streaming switch, the cell size and standalone nodes (:func:`gyre.sim.compare.regroup`), and for
Async the training nodes.  All run at ``E[d] = phi + (mu - 1)/2 = 1.5`` on the preset's nodes
(32 on ``paper-nl2repo``).  :func:`run_table1` simulates them with one seed and reports each
one's hours relative to ``E0``.

Choices the paper's table leaves open (fixed here):

* ``A1`` moves one 4-node group from training to rollout (2 of 8 cells train instead of 3);
* ``A2``'s longer bursts are ``(0.5, 3)``, elastic's shape;
* ``C1``'s extra dispatch is ``(0.5, 3)``: with 4 standalone nodes the 7 colocated cells switch
  once the unfinished executions fit on the standalone pool (``standalone_handoff``);
* ``C3`` has 8 standalone nodes (6 colocated cells).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .cluster import ClusterSim, SimResult
from .compare import regroup
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


def run_table1(base: Preset, steps: int, seed: int = 0, names: Sequence[str] | None = None,
               on_step: Callable[[int], None] | None = None) -> dict:
    """Simulate the Table 1 configurations; return the ``--table1 --json`` object.

    ``{"configs": {name: {"hours", "time_vs_E0", "phi", "mu", "mean_staleness",
    "staleness_after_warmup"}}}``; the last leaves out the first steps, whose groups come from the
    start-up dispatch and so have staleness below ``phi + (mu - 1)/2`` by construction;
    ``time_vs_E0`` is ``None`` when ``E0`` is not among ``names``.  The full results are under
    the private key ``"_results"``.
    """
    names = list(TABLE1) if names is None else list(names)
    results: dict[str, SimResult] = {}
    steady: dict[str, float | None] = {}
    for n in names:
        sim = table1_sim(base, n, steps, seed)
        results[n] = r = sim.run(on_step=on_step)
        warm = math.ceil((r.phi + r.mu) / r.mu) * r.mu  # steps whose groups still come from the start-up dispatch
        late = [d for _, step, d in sim.sched.queue.staleness_log if step >= warm]
        steady[n] = round(sum(late) / len(late), 4) if late else None
    e0 = results["E0"].hours if "E0" in results else None
    configs = {n: {"hours": round(r.hours, 3), "time_vs_E0": None if e0 is None else round(r.hours / e0, 4),
                   "phi": r.phi, "mu": r.mu, "mean_staleness": round(r.mean_staleness, 4),
                   "staleness_after_warmup": steady[n]}
               for n, r in results.items()}
    return {"configs": configs, "_results": results}
