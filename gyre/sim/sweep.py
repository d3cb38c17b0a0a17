"""How the Table 1 ratios move with the three inputs the ablations' reasoning turns on.

``tools/simulate.py --table1 --sweep`` varies one input at a time around ``paper-nl2repo`` and
reruns :func:`gyre.sim.table1.run_table1` at each value:

* ``duration_spread`` -- the within-query log-sd ``s`` of the execution durations, as a factor
  of the fitted one (wider: more stragglers, longer queries);
* ``timeout_share`` -- the share of executions that reach the 4 h harness timeout, moved by
  the share of hard queries ``pi`` (the timeouts cluster in hard queries);
* ``train_step_h`` -- the training cost of one step on one 4-node cell, in hours.

Each point reports every configuration's time relative to ``E0`` (mean over the seeds) and its
interval; :func:`plot_sweep` draws one panel per input, :func:`sweep_markdown` the tables of
``docs/simulator.md``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from .presets import Preset
from .table1 import TABLE1, run_table1
from .workload import MixtureLognormalWorkload, mixture_statistics

#: Values per input (the middle one of the first two is the fitted workload).
SWEEP_VALUES: dict[str, tuple[float, ...]] = {
    "duration_spread": (0.5, 0.75, 1.0, 1.5, 2.0),
    "timeout_share": (0.02, 0.04, 0.0625, 0.09, 0.12),
    "train_step_h": (0.5, 1.5, 3.0, 6.0, 9.0),
}

LABELS = {
    "duration_spread": "duration spread (x fitted log-sd)",
    "timeout_share": "timeout share",
    "train_step_h": "training step on one cell (h)",
}


def _hard_share_for_timeouts(w: MixtureLognormalWorkload, share: float) -> float:
    """The hard-query probability that gives timeout rate ``share`` (linear in it)."""
    easy = mixture_statistics(0.0, w.m_easy, w.m_hard, w.s, w.timeout_h)["timeout_rate"]
    hard = mixture_statistics(1.0, w.m_easy, w.m_hard, w.s, w.timeout_h)["timeout_rate"]
    pi = (share - easy) / (hard - easy)
    if not 0.0 <= pi <= 1.0:
        raise ValueError(f"timeout share {share} is out of reach of this workload ({easy:.4f}..{hard:.4f})")
    return pi


def swept_preset(base: Preset, name: str, value: float) -> Preset:
    """``base`` with input ``name`` set to ``value`` (see the module doc).

    Raises:
        ValueError: an unknown input, or a workload input on a workload that is not the
            ``paper-nl2repo`` mixture (a trace has no spread or timeout share to set).
    """
    if name == "train_step_h":
        return replace(base, sim=replace(base.sim, train_step_cell_s=value * 3600.0))
    if name not in SWEEP_VALUES:
        raise ValueError(f"unknown sweep input {name!r} (expected one of {', '.join(SWEEP_VALUES)})")
    w = base.workload
    if not isinstance(w, MixtureLognormalWorkload):
        raise ValueError(f"--sweep varies the paper-nl2repo mixture's spread and timeouts; {base.name} is not one")
    if name == "duration_spread":
        w = replace(w, s=w.s * value)
    else:
        w = replace(w, pi=_hard_share_for_timeouts(w, value))
    return replace(base, workload=w)


def run_sweep(base: Preset, steps: int, seeds: Sequence[int], inputs: Sequence[str] | None = None,
              values: dict[str, Sequence[float]] | None = None, names: Sequence[str] | None = None,
              workers: int | None = None, on_done: Callable[[], None] | None = None) -> dict:
    """``{"steps", "seeds", "inputs": {input: [{"value", "workload", "hours", "time_vs_E0",
    "time_vs_E0_ci"}, ...]}}``: per value of each input, the workload's mean execution (h) and
    timeout rate, each configuration's mean hours, its time relative to ``E0`` and that ratio's
    interval (``E0`` must be among ``names``)."""
    names = list(TABLE1) if names is None else list(names)
    if "E0" not in names:
        raise ValueError("the sweep reports ratios to E0: E0 must be among the configurations")
    out: dict = {"steps": steps, "seeds": list(seeds), "inputs": {}}
    for name in inputs or SWEEP_VALUES:
        rows = []
        for v in (values or {}).get(name, SWEEP_VALUES[name]):
            preset = swept_preset(base, name, v)
            t = run_table1(preset, steps, seeds=seeds, names=names, workers=workers, on_done=on_done)
            w = preset.workload
            st = w.statistics() if isinstance(w, MixtureLognormalWorkload) else {}
            rows.append({"value": v,
                         "workload": {"mean_h": round(st.get("mean_h", float("nan")), 3),
                                      "timeout_rate": round(st.get("timeout_rate", float("nan")), 4)},
                         "hours": {n: c["hours"] for n, c in t["configs"].items()},
                         "time_vs_E0": {n: c["time_vs_E0"] for n, c in t["configs"].items()},
                         "time_vs_E0_ci": {n: c["time_vs_E0_ci"] for n, c in t["configs"].items()}})
        out["inputs"][name] = rows
    return out


def sweep_markdown(out: dict) -> str:
    """One markdown table per input: a row per value, a column per configuration (time vs E0)."""
    parts = []
    for name, rows in out["inputs"].items():
        configs = [n for n in rows[0]["time_vs_E0"] if n != "E0"]
        parts.append(f"**{LABELS[name]}** (mean execution h, timeout rate; E0 hours; time vs E0)\n")
        parts.append("| value | mean h | timeouts | E0 h | " + " | ".join(configs) + " |")
        parts.append("| --- " * (4 + len(configs)) + "|")
        for r in rows:
            cells = " | ".join(f"{r['time_vs_E0'][n]:.2f}" for n in configs)
            parts.append(f"| {r['value']:g} | {r['workload']['mean_h']:.2f} | {r['workload']['timeout_rate']:.3f} "
                         f"| {r['hours']['E0']:.2f} | {cells} |")
        parts.append("")
    return "\n".join(parts)


def plot_sweep(out: dict, path: str) -> None:
    """One panel per input: each configuration's time relative to E0 against the input."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs = list(out["inputs"])
    fig, axes = plt.subplots(1, len(inputs), figsize=(5.2 * len(inputs), 4.2), squeeze=False)
    for ax, name in zip(axes[0], inputs):
        rows = out["inputs"][name]
        xs = [r["value"] for r in rows]
        for n in rows[0]["time_vs_E0"]:
            if n == "E0":
                continue
            style = {"A": "-", "C": "--", "E": ":"}[n[0]]
            ax.plot(xs, [r["time_vs_E0"][n] for r in rows], style, marker="o", ms=3, label=n)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xlabel(LABELS[name])
        ax.set_ylabel("time relative to E0")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2, loc="best")
    fig.suptitle(f"Table 1 ratios vs the workload and training cost ({out['steps']} steps, "
                 f"seeds {out['seeds'][0]}..{out['seeds'][-1]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
