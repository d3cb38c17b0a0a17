"""PNGs of a real run: the reward curve and the per-cell role timeline (``tools/plot_run.py``).

Reads ``metrics.jsonl`` (``reward_mean`` per step) and ``timeline.json`` (per cell
``(start_s, stop_s, state)`` from the scheduler's role log) from a run directory; colours match
the simulator's (:mod:`gyre.sim.plot`).
"""

from __future__ import annotations

import json
from pathlib import Path

from gyre.sim.plot import _STATE_CLASS, COLOURS


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``timeline.png`` and ``reward.png`` into ``run_dir``; returns the written paths.

    Raises:
        FileNotFoundError: ``run_dir`` has neither ``timeline.json`` nor ``metrics.jsonl``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from gyre.metrics import read_metrics

    run = Path(run_dir)
    out: list[Path] = []
    tl_path, m_path = run / "timeline.json", run / "metrics.jsonl"
    if not tl_path.exists() and not m_path.exists():
        raise FileNotFoundError(f"{run}: no timeline.json or metrics.jsonl (not a Gyre run directory?)")
    if tl_path.exists():
        data = json.loads(tl_path.read_text())
        timeline = data["timeline"]
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.4 * len(timeline)))
        for cell, intervals in enumerate(timeline):
            by_class: dict[str, list[tuple[float, float]]] = {}
            for a, b, state in intervals:
                by_class.setdefault(_STATE_CLASS[state], []).append((a, b - a))
            for cls, bars in by_class.items():
                ax.broken_barh(bars, (cell - 0.4, 0.8), facecolors=COLOURS[cls], linewidth=0)
        ax.set_yticks(range(len(timeline)))
        ax.set_yticklabels([f"cell {c}" for c in range(len(timeline))], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(f"{run.name}: cell roles ({data.get('placement', '?')})", fontsize=9, loc="left")
        fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", ncol=3,
                   fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.92))
        fig.savefig(run / "timeline.png", dpi=110)
        plt.close(fig)
        out.append(run / "timeline.png")
    if m_path.exists():
        rows, _ = read_metrics(m_path)
        pts = [(r["step"], r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
        if pts:
            fig, ax = plt.subplots(figsize=(6, 3.2))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=COLOURS["training"])
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("mean training reward")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
            ax.set_title(f"{run.name}: reward", fontsize=9, loc="left")
            fig.tight_layout()
            fig.savefig(run / "reward.png", dpi=110)
            plt.close(fig)
            out.append(run / "reward.png")
    return out
