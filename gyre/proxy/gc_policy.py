"""Python's cyclic garbage collector in a process that serves the proxy.

A full collection (generation 2) walks every container object the process holds and stops
every thread meanwhile, the proxy's event loop included. With a thousand live executions the
proxy holds their message tries, trees and sessions: a full collection then took 0.3-0.5 s on
the development machine (``bench/scale.py``), and every model call in flight waited for it.

:class:`CollectorPolicy` records each collection's pause by generation (``GET /gyre/stats``)
and, after a full collection that took ``freeze_after_ms`` or longer, moves every object that
survived it to the collector's permanent generation (``gc.freeze``): later full collections walk
only what was allocated since. Objects frozen while alive and later dropped are still freed by
reference counting; only garbage *cycles* among them wait, so every ``unfreeze_interval_s`` the
permanent generation is handed back (``gc.unfreeze``) and the next full collection walks it once.
An execution's own state has no cycles once it is released at its end
(:meth:`gyre.proxy.tito.TitoSession.release`), so it is freed at once either way.

The first server's start freezes what the process holds then (imports, tokenizer, model). The freeze
and the unfreeze run on the proxy's event loop (:meth:`CollectorPolicy.tick`), never
inside the collector's callback.
"""

from __future__ import annotations

import gc
import time

__all__ = ["CollectorPolicy"]


class CollectorPolicy:
    """Pause accounting and the freeze policy of this process (module docstring); one per process."""

    _installed: "CollectorPolicy | None" = None

    def __init__(self, freeze_after_ms: float | None = 20.0, unfreeze_interval_s: float = 1800.0,
                 clock=time.monotonic) -> None:
        self.freeze_after_ms, self.unfreeze_interval_s, self.clock = freeze_after_ms, unfreeze_interval_s, clock
        self.count = [0, 0, 0]
        self.total = [0.0, 0.0, 0.0]
        self.max = [0.0, 0.0, 0.0]
        self.freezes = self.unfreezes = self.frozen_objects = 0
        self._t0 = 0.0
        self._freeze_pending = False
        self._started = False
        self._last_unfreeze = clock()

    @classmethod
    def install(cls, freeze_after_ms: float | None = 20.0, unfreeze_interval_s: float = 1800.0) -> "CollectorPolicy":
        """This process's policy (the first call installs it and sets its parameters)."""
        if cls._installed is None:
            cls._installed = cls(freeze_after_ms, unfreeze_interval_s)
            gc.callbacks.append(cls._installed._callback)
        return cls._installed

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g, dt = int(info.get("generation", 0)), time.perf_counter() - self._t0
        self.count[g] += 1
        self.total[g] += dt
        self.max[g] = max(self.max[g], dt)
        if g == 2 and self.freeze_after_ms is not None and dt * 1e3 >= self.freeze_after_ms:
            self._freeze_pending = True

    def freeze_now(self) -> None:
        """Freeze what the process holds now, once per process (at the first server's start:
        imports, tokenizer, model)."""
        if not self._started:
            self._started = True
            self._freeze()

    def tick(self) -> None:
        """Freeze after a long full collection; unfreeze every ``unfreeze_interval_s`` (call it
        periodically from the event loop)."""
        if self._freeze_pending:
            self._freeze_pending = False
            self._freeze()
        if self.freezes and self.clock() - self._last_unfreeze >= self.unfreeze_interval_s:
            self._last_unfreeze = self.clock()
            gc.unfreeze()
            self.unfreezes += 1
            self.frozen_objects = 0

    def _freeze(self) -> None:
        gc.freeze()
        self.freezes += 1
        self.frozen_objects = gc.get_freeze_count()  # walks the permanent generation: counted once here

    def snapshot(self) -> dict[str, object]:
        return {"collections": list(self.count), "total_s": [round(t, 4) for t in self.total],
                "max_ms": [round(1e3 * m, 2) for m in self.max], "freezes": self.freezes,
                "unfreezes": self.unfreezes, "frozen_objects": self.frozen_objects}
