"""What a simulated run did, read from its event log: the quantities the Table 1 ablations turn on.

Pure functions of a finished :class:`~gyre.sim.cluster.ClusterSim` (its ``event_log`` and its
scheduler's ``role_log``); nothing here changes a run.  :func:`burst_traces` cuts a run into
bursts (``mu`` steps between two publications) and times each one's milestones;
:func:`mechanism_figures` condenses them into the figures ``tools/simulate.py --table1 --json``
reports per configuration and the mechanism tests assert on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gyre.scheduler import STANDALONE, CellState

if TYPE_CHECKING:  # pragma: no cover
    from .cluster import ClusterSim

_TRAINING_SIDE = (CellState.TO_TRAINING, CellState.TRAINING)


@dataclass(slots=True, frozen=True)
class BurstTrace:
    """Milestones of one burst (seconds since the run started).

    Attributes:
        burst: index (0: the first).
        steps: the optimizer steps it trained.
        data_ready_s: the last of its consumed groups became ready.
        first_micro_s: its first micro-step started.
        publish_s: its weights were published.
        train_entries_s: when each cell that trained in it was commanded into training (sorted;
            empty for cells already training when the burst began, as under Async).
    """

    burst: int
    steps: tuple[int, ...]
    data_ready_s: float
    first_micro_s: float
    publish_s: float
    train_entries_s: tuple[float, ...]

    @property
    def streamed_s(self) -> float:
        """How long training ran before the burst's data was complete (0: it waited for all of it)."""
        return max(0.0, self.data_ready_s - self.first_micro_s)

    @property
    def training_s(self) -> float:
        """From the burst's first micro-step to its publication."""
        return self.publish_s - self.first_micro_s

    @property
    def exposed_s(self) -> float:
        """Training left on the critical path: from the burst's data being complete to its publication."""
        return self.publish_s - self.data_ready_s


def burst_traces(sim: "ClusterSim") -> list[BurstTrace]:
    """Each finished burst of ``sim`` (after :meth:`~gyre.sim.cluster.ClusterSim.run`)."""
    mu = sim.cfg.mu
    ready: dict[int, float] = {}
    step_groups: dict[int, list[int]] = {}
    first_micro: dict[int, float] = {}
    publish: list[float] = []
    for t, kind, a, b in sim.event_log:
        if kind == "ready":
            ready[a] = t
        elif kind == "enqueue":
            step_groups.setdefault(b, []).append(a)
        elif kind == "micro":
            first_micro.setdefault(b, t)
        elif kind == "publish":
            publish.append(t)
    entries = [(t, cell) for t, cell, state in sim.sched.role_log if state is CellState.TO_TRAINING]
    out: list[BurstTrace] = []
    start = 0.0
    for i, pub in enumerate(publish):
        steps = tuple(s for s in range(i * mu, (i + 1) * mu) if s in step_groups)
        if not steps:
            break
        out.append(BurstTrace(
            burst=i, steps=steps,
            data_ready_s=max(ready[g] for s in steps for g in step_groups[s]),
            first_micro_s=min(first_micro[s] for s in steps if s in first_micro),
            publish_s=pub,
            train_entries_s=tuple(sorted(t for t, _ in entries if start <= t < pub))))
        start = pub
    return out


def training_idle_share(sim: "ClusterSim") -> float:
    """Share of the cells' time in training (switches excluded) that ran no micro-step."""
    end = sim.env.now
    training = sum(b - a for cell in sim.sched.role_timeline(end) for a, b, st in cell if st is CellState.TRAINING)
    started: dict[int, float] = {}
    busy = 0.0
    for t, kind, cell, _ in sim.event_log:
        if kind == "micro":
            started[cell] = t
        elif kind == "micro_done":
            busy += t - started.pop(cell)
    return 1.0 - busy / training if training > 0 else 0.0


def finishes_while_training(sim: "ClusterSim") -> dict[str, int]:
    """Executions that closed while cells trained: ``standalone`` -- on the standalone pool while
    no cell was in rollout; ``cells`` -- on a cell in rollout while another cell was in training."""
    state = {c: CellState.ROLLOUT for c in range(sim.cfg.num_cells)}
    log = sorted([(t, 0, c, st) for t, c, st in sim.sched.role_log]
                 + [(t, 1, eid, route) for t, kind, eid, route in sim.event_log if kind == "finish"],
                 key=lambda e: (e[0], e[1]))
    out = {"standalone": 0, "cells": 0}
    for _t, kind, a, b in log:
        if kind == 0:
            state[a] = b
        elif b == STANDALONE:
            out["standalone"] += all(st is not CellState.ROLLOUT for st in state.values())
        elif state[b] is CellState.ROLLOUT:
            out["cells"] += any(st is CellState.TRAINING for st in state.values())
    return out


def mechanism_figures(sim: "ClusterSim", warmup_bursts: int = 1) -> dict:
    """Per-run figures behind the ablations, averaged over bursts after the first ``warmup_bursts``.

    ``exposed_training_h`` (data complete -> publication), ``streamed_h`` (training before the
    data was complete), ``train_entry_spread_h`` (first to last cell commanded into training
    within a burst: 0 when a pool switches together), ``training_idle_share`` (training time with
    no micro-step running), ``training_h`` (first micro-step -> publication),
    ``rerouted_executions`` and the two counts of :func:`finishes_while_training`.
    """
    bursts = burst_traces(sim)
    late = bursts[warmup_bursts:] or bursts

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs) / 3600.0, 4) if xs else 0.0

    return {
        "exposed_training_h": mean([b.exposed_s for b in late]),
        "streamed_h": mean([b.streamed_s for b in late]),
        "train_entry_spread_h": mean([b.train_entries_s[-1] - b.train_entries_s[0]
                                      for b in late if b.train_entries_s]),
        "training_h": mean([b.training_s for b in late]),
        "training_idle_share": round(training_idle_share(sim), 4),
        "rerouted_executions": sim.rerouted,
        **{f"finished_while_training_{k}": v for k, v in finishes_while_training(sim).items()},
    }
