"""One metrics sink for a run: JSONL always, TensorBoard when configured.

``metrics.jsonl`` under the run directory gets one JSON object per :meth:`MetricsSink.log` call
(``{"kind": "metrics", "step": s, "time": unix_s, ...scalars}``) and per
:meth:`MetricsSink.event` call (``{"kind": "event", "event": name, "time": unix_s, ...fields}``:
role changes, publications, failures -- what ``tools/plot_run.py`` draws the timeline from).
Each line is flushed as written, so a killed run keeps everything logged before the kill.

With ``tensorboard_dir`` set, every numeric scalar of :meth:`log` is also written as a
TensorBoard scalar (``torch.utils.tensorboard``; tag = metric name, global step = ``step``).
With ``wandb`` settings (``--wandb-project``), the same scalars go to Weights & Biases; mode
``offline`` (the default without ``WANDB_API_KEY``) writes ``wandb/offline-run-*`` under the
save directory with no network, to ``wandb sync`` later.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping


def _scalar(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(float(v)):
        return float(v)
    return None


class MetricsSink:
    """Thread-safe writer of ``metrics.jsonl`` (+ TensorBoard scalars).

    Args:
        run_dir: the run directory (created); the file is ``run_dir/metrics.jsonl``, appended to.
        tensorboard_dir: also write TensorBoard events here (``None``: off).
        clock: wall clock in seconds (``time.time``), injectable for tests.
        wandb: ``{"project", "name", "dir", "mode", "config"}`` for ``wandb.init`` (``None``: off);
            ``mode`` ``None`` means ``online`` with ``WANDB_API_KEY`` set, else ``offline``.

    Raises:
        ImportError: ``tensorboard_dir`` set but the ``tensorboard`` package is missing.
    """

    def __init__(self, run_dir: str | Path, tensorboard_dir: str | Path | None = None,
                 clock: Callable[[], float] = time.time, wandb: Mapping[str, Any] | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)
        self._lock = threading.Lock()
        self.clock = clock
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))
        self._wandb = None
        if wandb is not None:
            import os

            import wandb as wb

            mode = wandb.get("mode") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            save = Path(wandb.get("dir") or self.path.parent)
            save.mkdir(parents=True, exist_ok=True)
            self._wandb = wb.init(project=wandb["project"], name=wandb.get("name"), dir=str(save), mode=mode,
                                  config=dict(wandb.get("config") or {}), reinit="finish_previous")

    def _write(self, obj: Mapping[str, Any]) -> None:
        line = json.dumps(obj, sort_keys=True, default=str, allow_nan=False)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the metrics of optimizer step ``step`` (non-finite floats are stored as null)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._write({"kind": "metrics", "step": int(step), "time": self.clock(), **clean})
        if self._tb is not None:
            for k, v in metrics.items():
                s = _scalar(v)
                if s is not None:
                    self._tb.add_scalar(k, s, global_step=int(step))
        if self._wandb is not None:
            self._wandb.log({k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}, step=int(step))

    def event(self, name: str, **fields: Any) -> None:
        """Record a timeline event (``role_change``, ``publish``, ``cell_dead``, ...)."""
        self._write({"kind": "event", "event": name, "time": fields.pop("time", None) or self.clock(), **fields})

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """``(metrics rows, events)`` of a ``metrics.jsonl``; a torn last line is skipped."""
    rows, events = [], []
    for line in Path(path).read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        (rows if obj.get("kind") == "metrics" else events).append(obj)
    return rows, events
