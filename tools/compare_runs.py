#!/usr/bin/env python
"""Compare finished Gyre runs side by side: ``python tools/compare_runs.py RUN_DIR [RUN_DIR ...]``.

Prints one row per run from its ``summary.json``: placement, steps, wall time, training/rollout
overlap, role changes, mean switch latency, staleness and the last step's mean reward.  Exit 2
with one line when a directory holds no ``summary.json``.
"""

import argparse
import json
import sys
from pathlib import Path

COLUMNS = ("run", "placement", "steps", "wall_s", "train_rollout_overlap_s", "role_changes", "switch_s",
           "staleness", "last_reward")


def row(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    rewards = s.get("reward_mean_by_step") or {}
    last = rewards[max(rewards, key=int)] if rewards else None
    return {"run": run.name, "placement": s["placement"], "steps": s["steps"], "wall_s": s["wall_s"],
            "train_rollout_overlap_s": s["train_rollout_overlap_s"], "role_changes": s["role_changes"],
            "switch_s": s["switch_latency_s"]["mean"], "staleness": s["staleness_mean"], "last_reward": last}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="compare_runs", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    a = p.parse_args(argv)
    rows = []
    for r in map(Path, a.runs):
        if not (r / "summary.json").exists():
            print(f"compare_runs: error: {r}: no summary.json (not a finished Gyre run)", file=sys.stderr)
            return 2
        rows.append(row(r))

    def fmt(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = {c: max(len(c), *(len(fmt(x[c])) for x in rows)) for c in COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in COLUMNS))
    for x in rows:
        print("  ".join(fmt(x[c]).ljust(widths[c]) for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
