"""The main job's console progress bar (rank 0)."""

from __future__ import annotations

import time


class Progress:
    """A tqdm bar over optimizer steps with executions running and the waterlevel."""

    def __init__(self, total: int, initial: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc="gyre", unit="step", dynamic_ncols=True)
        self.last = 0.0

    def update(self, c) -> None:
        now = time.monotonic()
        if now - self.last < 0.5:
            return
        self.last = now
        s = c.sched
        self.bar.n = s.steps_done
        self.bar.set_postfix(running=s.counters.running, waterlevel=s.counters.waterlevel,
                             training=s.cells_in([type(s.cell_states[0]).TRAINING]), refresh=True)

    def close(self, steps_done: int | None = None) -> None:
        if steps_done is not None:  # the last update may have been skipped by the 0.5 s throttle
            self.bar.n = steps_done
            self.bar.refresh()
        self.bar.close()


def progress_bar(args, start_step: int) -> Progress | None:
    """The console bar of rank 0, from ``start_step`` to ``--train-steps`` (``None`` with ``--no-progress``)."""
    if args.no_progress:
        return None
    return Progress(args.train_steps, start_step)
