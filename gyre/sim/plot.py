"""Per-cell role timelines, one panel per placement (the shape of the paper's Figure 6)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from .cluster import SimResult

COLOURS = {"rollout": "#4C78A8", "training": "#F58518", "switching": "#9D9D9D"}
_STATE_CLASS = {"rollout": "rollout", "training": "training", "to_training": "switching",
                "to_rollout": "switching"}


def plot_timelines(results: Mapping[str, SimResult], path: str | Path, title: str | None = None) -> Path:
    """Draw each placement's per-cell timeline (rollout / training / switching) into a PNG.

    Uses matplotlib's Agg backend (no display needed).  Returns the written path.

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(results)
    n_cells = max(len(r.timeline) for r in results.values())
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.1 + 0.32 * n_cells * len(names) + 0.6 * len(names)),
                             sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        r = results[name]
        for cell, intervals in enumerate(r.timeline):
            by_class: dict[str, list[tuple[float, float]]] = {}
            for a, b, state in intervals:
                by_class.setdefault(_STATE_CLASS[state], []).append((a / 3600.0, (b - a) / 3600.0))
            for cls, bars in by_class.items():
                ax.broken_barh(bars, (cell - 0.4, 0.8), facecolors=COLOURS[cls], linewidth=0)
        ax.set_yticks(range(len(r.timeline)))
        ax.set_yticklabels([f"cell {c}" for c in range(len(r.timeline))], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}  (phi={r.phi:g}, mu={r.mu}; {r.hours:.1f} h for {r.steps} steps, "
                     f"mean staleness {r.mean_staleness:.2f})", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("hours")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", ncol=3,
               fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
