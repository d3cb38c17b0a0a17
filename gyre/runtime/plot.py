"""PNGs of a real run: the reward curve, the training curves and the per-cell role timeline
(``tools/plot_run.py``).

Reads ``metrics.jsonl`` (one ``kind: metrics`` row per optimizer step: ``reward_mean``, ``loss``,
``grad_norm``, ``clip_fraction``, ``token_clip_fraction``) and ``timeline.json`` (per cell
``(start_s, stop_s, state)`` from the scheduler's role log) from a run directory; colours match
the simulator's (:mod:`gyre.sim.plot`). Steps on the x axes are the ``step`` of ``metrics.jsonl``
(1-based: the number of optimizer updates done after that step) with integer ticks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gyre.sim.plot import _STATE_CLASS, COLOURS

#: Panels of ``training.png``: (title, y label, [(metrics key, line label), ...]).
TRAINING_PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("loss", "loss", (("loss", "loss"),)),
    ("grad norm", "grad norm", (("grad_norm", "grad norm (before clipping)"),)),
    ("clip fraction", "fraction clipped",
     (("clip_fraction", "executions (gspo)"), ("token_clip_fraction", "tokens (ppo/grpo)"))),
)


def step_series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over metrics rows, in step order.

    Rows without ``key``, with ``None`` or a non-finite value are skipped; ``steps`` are the rows'
    ``step`` as ints.  A step logged more than once (a resumed run repeats the steps after its
    checkpoint) keeps its last row.
    """
    last: dict[int, float] = {}
    for r in rows:
        if "step" in r and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
            last[int(r["step"])] = float(r[key])
    steps = sorted(last)
    return steps, [last[s] for s in steps]


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``timeline.png``, ``reward.png`` and ``training.png`` into ``run_dir``; returns the
    written paths (a PNG is skipped when its data is absent).

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
        steps, rewards = step_series(rows, "reward_mean")
        if steps:
            fig, ax = plt.subplots(figsize=(6, 3.2))
            ax.plot(steps, rewards, marker="o", color=COLOURS["training"])
            _integer_steps(ax)
            ax.set_ylabel("mean training reward")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
            ax.set_title(f"{run.name}: reward", fontsize=9, loc="left")
            fig.tight_layout()
            fig.savefig(run / "reward.png", dpi=110)
            plt.close(fig)
            out.append(run / "reward.png")
        fig = training_figure(rows, title=f"{run.name}: training")
        if fig is not None:
            fig.savefig(run / "training.png", dpi=110)
            plt.close(fig)
            out.append(run / "training.png")
    return out


def training_figure(rows: list[dict], title: str = "training"):
    """A matplotlib figure of :data:`TRAINING_PANELS` (one panel each, shared integer step axis)
    from metrics rows, or ``None`` when no row has any of their keys. The caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [[(label, *step_series(rows, key)) for key, label in lines] for _, _, lines in TRAINING_PANELS]
    if not any(steps for panel in series for _, steps, _ in panel):
        return None
    fig, axes = plt.subplots(len(TRAINING_PANELS), 1, figsize=(6, 2.2 * len(TRAINING_PANELS)), sharex=True)
    for ax, (name, ylabel, _), panel in zip(axes, TRAINING_PANELS, series):
        for (label, steps, values), colour in zip(panel, (COLOURS["training"], COLOURS["rollout"])):
            if steps:
                ax.plot(steps, values, marker="o", color=colour, label=label)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_title(name, fontsize=9, loc="left")
        if len(panel) > 1:
            ax.legend(fontsize=7, frameon=False)
    _integer_steps(axes[-1])
    fig.suptitle(title, fontsize=9, x=0.02, ha="left")
    fig.tight_layout()
    return fig
