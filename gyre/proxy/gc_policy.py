"""Memory policy of a process that serves the proxy: Python's cyclic garbage collector, and the C
heap's free pages.

A full collection (generation 2) walks every container object the process holds and stops
every thread meanwhile, the proxy's event loop included. With a thousand live executions the
proxy holds their message tries, trees and sessions: a full collection then takes a long pause
(``bench/scale.py``'s measurement is in docs/proxy.md), and every model call in flight waits for it.

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

:class:`HeapTrimmer`: every request body (up to megabytes), its parsed strings and its token
arrays are freed when the call is recorded, but the C allocator keeps the freed pages between
the blocks still in use, so the process's resident memory only grows. Every ``interval_s`` the
trimmer hands those pages back to the operating system (glibc's ``malloc_trim``; nothing where the
C library is not glibc), off the event loop. Not much more often: pages handed back and soon
reused are faulted in again (docs/proxy.md gives ``bench/scale.py``'s CPU per call at both
intervals).

:func:`limit_malloc_arenas`: glibc gives each thread that allocates its own heap (an *arena*), up to
eight per core, and memory freed in one arena serves only that arena's threads. A request rendered
and encoded on a worker thread whose arena is new grows the resident memory by the request's whole
working memory even when the process holds that much freed memory elsewhere. Capping the arenas
(``mallopt(M_ARENA_MAX)``) makes threads started afterwards share the existing ones; threads whose
arena already exists keep it. Nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time
from typing import Any, Callable

__all__ = ["CollectorPolicy", "HeapTrimmer", "limit_malloc_arenas", "install_arena_limit"]


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


def _glibc(name: str) -> Any:
    """glibc's function ``name`` (ctypes), or ``None`` (another C library, or no C library found).
    ``malloc_trim`` and ``mallopt`` exist only in glibc, so finding them is the test for it."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` (another C library, or no C library found)."""
    fn = _glibc("malloc_trim")
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


#: glibc's ``mallopt`` parameter for the most arenas (malloc.h)
M_ARENA_MAX = -8


def limit_malloc_arenas(n: int | None, *, mallopt: Callable[[int, int], int] | None = None) -> bool:
    """Cap glibc's malloc arenas at ``n`` for the threads that start allocating from now on (module
    docstring); ``None`` leaves them. Returns whether the cap was set: ``False`` for ``None``, where
    the C library is not glibc, or where ``mallopt`` refused. ``mallopt``: injected for tests."""
    if n is None:
        return False
    if n < 1:
        raise ValueError(f"malloc arenas must be at least 1, got {n}")
    if mallopt is None:
        mallopt = _glibc("mallopt")
        if mallopt is None:
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, int(n)) == 1


_arena_limit: list[bool] = []  # the first install's result


def install_arena_limit(n: int | None) -> bool:
    """:func:`limit_malloc_arenas` once per process (the first call sets it); whether it was set."""
    if not _arena_limit:
        _arena_limit.append(limit_malloc_arenas(n))
    return _arena_limit[0]


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class HeapTrimmer:
    """Hands the C heap's free pages back to the operating system every ``interval_s`` seconds
    (module docstring); one per process. :meth:`due` is asked on the event loop, :meth:`trim`
    runs in a thread (ctypes releases the GIL; the heap walk takes milliseconds).

    Args:
        interval_s: seconds between trims; ``None`` never trims.
        clock, trim, rss: injected for tests (``trim(0)`` is ``malloc_trim``; ``rss()`` bytes).
    """

    _installed: "HeapTrimmer | None" = None

    def __init__(self, interval_s: float | None = 60.0, *, clock=time.monotonic,
                 trim: Callable[[int], int] | None = None, rss: Callable[[], int] = _rss_bytes) -> None:
        self.interval_s, self.clock, self._rss = interval_s, clock, rss
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._last = clock()
        self.trims = 0
        self.max_ms = 0.0
        self.released_bytes = 0

    @classmethod
    def install(cls, interval_s: float | None = 60.0) -> "HeapTrimmer":
        """This process's trimmer (the first call installs it and sets its interval)."""
        if cls._installed is None:
            cls._installed = cls(interval_s)
        return cls._installed

    def due(self) -> bool:
        """A trim is due (the interval has passed since the last one)."""
        return (self._trim is not None and self.interval_s is not None
                and self.clock() - self._last >= self.interval_s)

    def trim(self) -> None:
        """Trim now; count the time it took and the resident bytes it released."""
        if self._trim is None:
            return
        self._last = self.clock()
        before, t0 = self._rss(), time.perf_counter()
        self._trim(0)
        self.max_ms = max(self.max_ms, 1e3 * (time.perf_counter() - t0))
        self.released_bytes += max(0, before - self._rss())
        self.trims += 1

    def snapshot(self) -> dict[str, object]:
        return {"trims": self.trims, "max_ms": round(self.max_ms, 2), "released_bytes": self.released_bytes}
