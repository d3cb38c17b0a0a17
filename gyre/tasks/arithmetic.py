"""A generated task family: small sums answered in one reply, with a seeded held-out split.

Each task asks "What is a+b? Reply with only the number." for ``a`` in 0..19 and ``b`` in 0..9
(200 problems) and is scored by the rule :func:`gyre.tasks.rules:final_message_last_number`: 1.0
when the last integer of the harness's final message is ``a + b``.  The model answers in its final
reply (no tool call, no workspace).

Splits: the problems are grouped by their unordered pair (``3+5`` and ``5+3`` are one group, so a
commuted held-out problem never appears in training), the groups are shuffled with ``seed``, and
the first groups holding at least ``heldout_size`` problems are the held-out split; every other
problem is in the train split.  The same seed gives the same splits::

    python -m gyre.tasks.arithmetic --split heldout --seed 0 --out heldout.tasks.jsonl
    python -m gyre.tasks.arithmetic --split train --seed 0 --out train.tasks.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

__all__ = ["A_MAX", "B_MAX", "HELDOUT_SIZE", "instruction", "problems", "splits", "task", "tasks", "write_tasks"]

A_MAX, B_MAX = 19, 9
#: Default number of held-out problems (a group of two commuted problems may add one more).
HELDOUT_SIZE = 64
RULE = "gyre.tasks.rules:final_message_last_number"


def instruction(a: int, b: int) -> str:
    """The instruction of the problem ``a + b``."""
    return f"What is {a}+{b}? Reply with only the number."


def problems() -> list[tuple[int, int]]:
    """Every ``(a, b)`` of the family, in order: ``a`` in 0..19, ``b`` in 0..9."""
    return [(a, b) for a in range(A_MAX + 1) for b in range(B_MAX + 1)]


def splits(seed: int, heldout_size: int = HELDOUT_SIZE) -> dict[str, list[tuple[int, int]]]:
    """``{"train": [...], "heldout": [...]}``: disjoint lists of ``(a, b)`` covering the family,
    each sorted; commuted problems share a split.

    Raises:
        ValueError: ``heldout_size`` is not in 1 .. the number of problems - 1.
    """
    all_problems = problems()
    if not 0 < heldout_size < len(all_problems):
        raise ValueError(f"heldout_size must be in 1..{len(all_problems) - 1}, got {heldout_size}")
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a, b in all_problems:
        groups.setdefault((min(a, b), max(a, b)), []).append((a, b))
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    heldout: list[tuple[int, int]] = []
    for k in keys:
        if len(heldout) >= heldout_size:
            break
        heldout += groups[k]
    held = set(heldout)
    return {"train": [p for p in all_problems if p not in held], "heldout": sorted(heldout)}


def task(a: int, b: int, split: str = "") -> dict[str, Any]:
    """The task mapping of ``a + b`` in Gyre's task format.  Its evaluator's command does nothing
    (``python -c pass``); the score is the scoring rule's, on the harness's final message."""
    return {
        "id": f"arith-add-{a}-{b}",
        "instruction": instruction(a, b),
        "evaluator": {"type": "executable", "command": ["{python}", "-c", "pass"], "scoring": RULE, "timeout_s": 30},
        "hidden": ["."],
        "timeout_s": 120,
        "metadata": {"set": "arith", "split": split, "answer": str(a + b)},
    }


def tasks(split: str, seed: int, heldout_size: int = HELDOUT_SIZE) -> list[dict[str, Any]]:
    """The task mappings of ``split`` (``"train"`` or ``"heldout"``) for ``seed``.

    Raises:
        ValueError: an unknown split, or a bad ``heldout_size``.
    """
    chosen = splits(seed, heldout_size)
    if split not in chosen:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return [task(a, b, split) for a, b in chosen[split]]


def write_tasks(path: str | Path, split: str, seed: int, heldout_size: int = HELDOUT_SIZE) -> Path:
    """Write ``split``'s tasks to ``path`` as JSONL (one task a line); returns the path.  The file
    must sit in a directory of its own or beside other task files: ``hidden: ["."]`` hides its
    directory from the harness."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks(split, seed, heldout_size)))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyre.tasks.arithmetic", description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=("train", "heldout"), required=True)
    p.add_argument("--seed", type=int, default=0, help="Seed of the split (default 0).")
    p.add_argument("--heldout-size", type=int, default=HELDOUT_SIZE)
    p.add_argument("--out", default="-", help="JSONL file to write (default: stdout).")
    a = p.parse_args(argv)
    if a.out == "-":
        for t in tasks(a.split, a.seed, a.heldout_size):
            print(json.dumps(t))
    else:
        write_tasks(a.out, a.split, a.seed, a.heldout_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
