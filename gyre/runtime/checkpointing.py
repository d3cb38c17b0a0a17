"""Checkpoints of the main job and resuming from them.

A checkpoint is ``RUN/checkpoints/iter_N/`` (Megatron's naming): ``hf/`` (the policy, servable),
the core cell's optimizer state (:func:`optimizer_file`: ``optimizer.pt``, and one
``optimizer_shard{s}.pt`` per further rank of a cell that spans ranks), ``parallel_layout.json``
(the cell's TP and PP sizes) and ``controller.json`` (:class:`ControllerState`,
written by rank 0 once the core reported the save).  ``latest_checkpointed_iteration.txt`` beside
them names the newest complete one; it is replaced atomically, last.  With ``--keep-checkpoints N``
the writer then deletes what :func:`checkpoints_to_delete` names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


def optimizer_file(checkpoint: str | os.PathLike, shard: int) -> Path:
    """Where shard ``shard`` of the core cell keeps its optimizer state in ``checkpoint``."""
    return Path(checkpoint) / ("optimizer.pt" if shard == 0 else f"optimizer_shard{shard}.pt")


@dataclass
class ControllerState:
    """Rank 0's part of a checkpoint: ``iteration`` steps done of the run's ``train_steps``, the
    resume ``attempt`` it ran under, execution ids already trained, the controller's RNG, the
    reward history, and what a resumed run continues from: the summary of the whole run so far
    and the cells' role timeline (``elapsed_s`` seconds of run time so far)."""

    iteration: int = 0
    attempt: int = -1
    trained: list[str] = field(default_factory=list)
    rng_state: dict | None = None
    history: dict | None = None
    training_backend: str = "hf"
    saved_at: float = 0.0
    train_steps: int | None = None
    summary: dict | None = None
    timeline: list | None = None
    elapsed_s: float = 0.0

    def rng(self, seed: int) -> np.random.Generator:
        """The controller's generator: seeded with ``seed``, in the saved state when there is one."""
        rng = np.random.default_rng(seed)
        if self.rng_state is not None:
            rng.bit_generator.state = self.rng_state
        return rng

    @classmethod
    def load(cls, checkpoint: Path) -> "ControllerState":
        data = json.loads((Path(checkpoint) / "controller.json").read_text())
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def checkpoint_dir(root: str | os.PathLike, iteration: int) -> Path:
    """``root/iter_N`` (Megatron's naming, seven digits at least)."""
    return Path(root) / f"iter_{iteration:07d}"


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``path`` (a run dir, its ``checkpoints/`` or an
    ``iter_N`` dir), or ``None``."""
    p = Path(path)
    if (p / "controller.json").exists():
        return p
    for root in (p / "checkpoints", p):
        tracker = root / "latest_checkpointed_iteration.txt"
        if tracker.exists():
            d = checkpoint_dir(root, int(tracker.read_text().strip()))
            if (d / "controller.json").exists():
                return d
    return None


def should_save(iteration: int, *, save_interval: int, train_steps: int) -> bool:
    """Save after the last step and every ``save_interval`` steps (``0``: only the last)."""
    return iteration >= train_steps or (save_interval > 0 and iteration % save_interval == 0)


_ITER_DIR = re.compile(r"iter_(\d{7,})")


def checkpoints_to_delete(complete: list[int], incomplete: list[int], *, newest: int, keep: int) -> list[int]:
    """The iterations whose directories go once ``newest`` is complete, keeping ``keep`` (``0``: all):
    the complete ones older than the ``keep`` newest, and every incomplete one older than ``newest``
    (a save that failed or was cut short).  Nothing newer than ``newest`` (a save being written) and
    never ``newest`` itself."""
    if keep <= 0:
        return []
    older = sorted({i for i in complete if i < newest})
    kept = set(older[max(0, len(older) - (keep - 1)):])
    return sorted(i for i in {*complete, *incomplete} if i < newest and i not in kept)


class CheckpointWriter:
    """Rank 0's half of saving: remember the controller state of a requested save and complete
    the checkpoint once the core has written the policy and optimizer state; with ``keep`` > 0,
    delete older checkpoints of this run (:func:`checkpoints_to_delete`) once one is complete."""

    def __init__(self, run_dir: Path, keep: int = 0):
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.pending: dict[int, tuple[str, ControllerState]] = {}

    def prune(self, newest: int) -> list[int]:
        """Delete what :func:`checkpoints_to_delete` names under ``checkpoints/``; returns those iterations."""
        root = self.run_dir / "checkpoints"
        complete, incomplete = [], []
        for d in root.iterdir() if root.is_dir() else ():
            m = _ITER_DIR.fullmatch(d.name)
            if m and d.is_dir() and int(m.group(1)) not in self.pending:
                (complete if (d / "controller.json").exists() else incomplete).append(int(m.group(1)))
        gone = checkpoints_to_delete(complete, incomplete, newest=newest, keep=self.keep)
        for it in gone:
            shutil.rmtree(checkpoint_dir(root, it), ignore_errors=True)
        return gone

    def request(self, iteration: int, state: ControllerState) -> str:
        """Register the save of ``iteration``; returns the directory the core is to write."""
        directory = str(checkpoint_dir(self.run_dir / "checkpoints", iteration))
        state.saved_at = time.time()
        self.pending[iteration] = (directory, state)
        return directory

    def refresh_summary(self, iteration: int, summary: dict) -> None:
        """The core's statistics of the step a pending save follows arrived: its summary takes them."""
        if iteration in self.pending:
            self.pending[iteration][1].summary = summary

    def complete(self, directory: str) -> list[int]:
        """The core wrote ``directory``: add ``controller.json``, move the tracker, then delete older
        checkpoints (:meth:`prune`); returns the iterations completed."""
        done = []
        for it, (d, state) in list(self.pending.items()):
            if d == directory:
                (Path(d) / "controller.json").write_text(json.dumps(asdict(state)))
                tracker = Path(d).parent / "latest_checkpointed_iteration.txt"
                tmp = tracker.with_suffix(".tmp")
                tmp.write_text(str(it))
                tmp.replace(tracker)
                del self.pending[it]
                done.append(it)
                self.prune(it)
        return done

