"""Group commit of request records to the trajectory store, off the event loop.

The proxy must not send a response before its record is stored, and must not block its event
loop on disk I/O. :class:`RecordSink` runs one writer thread (the store's writers are not
thread-safe) that takes every record queued so far, appends them
(:meth:`TrajectoryStore.append`: one ``write`` + flush each), then -- with ``fsync=True`` --
fsyncs each touched file *once* for the whole batch before resolving the waiting calls. Under
load the fsync cost is shared by all calls of a batch (group commit) instead of being paid per
record in series. With ``fsync=False`` a record counts as stored once it is written and flushed
to the operating system (it survives a crash of the process); the thread then fsyncs the touched
files every ``fsync_interval_s`` seconds in the
background (machine-crash window: that interval). Use a store built with ``fsync_every=0`` so
that the store does not fsync each record itself (a store with ``fsync_every=1`` still works,
just without the batching gain).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from typing import Any

from gyre.trajectory.records import RequestRecord

__all__ = ["RecordSink"]

logger = logging.getLogger(__name__)
_STOP = object()


class RecordSink:
    """A writer thread appending records to ``store`` in batches (see the module docstring).

    Args:
        store: a :class:`~gyre.trajectory.store.TrajectoryStore` (or anything with ``append(rec)``,
            ``mark_delivered(execution_id, call_index)``, ``path(execution_id)``,
            ``close_execution(execution_id)`` and ``close()``).
        fsync: fsync each touched file once per batch before reporting the records stored.
        fsync_interval_s: with ``fsync=False``, background fsync period of written files
            (seconds; ``None``: never, the store's own policy only).
        max_batch: records per batch at most.
    """

    def __init__(self, store: Any, *, fsync: bool = True, fsync_interval_s: float | None = 1.0,
                 max_batch: int = 1024) -> None:
        self.store = store
        self.fsync = bool(fsync)
        self.fsync_interval_s = fsync_interval_s
        self.max_batch = int(max_batch)
        self._dirty: set[str] = set()
        self._last_sync = time.monotonic()
        self.batches = 0
        self.records = 0
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="gyre-record-writer", daemon=True)
        self._thread.start()

    def submit(self, record: RequestRecord) -> concurrent.futures.Future:
        """Queue ``record``; the future resolves (to its seq) once it is written (and fsync'd)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(("append", record, fut))
        return fut

    def mark_delivered(self, execution_id: str, call_index: int) -> concurrent.futures.Future:
        """Queue a delivery mark of record ``call_index`` (``store.mark_delivered``); the future
        resolves once it is written (and fsync'd), after the records queued before it."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(("mark", (execution_id, call_index), fut))
        return fut

    def close_execution(self, execution_id: str) -> concurrent.futures.Future:
        """Close one execution's file after the records queued before this call."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(("close", execution_id, fut))
        return fut

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, close the store and stop the thread."""
        self._q.put(_STOP)
        self._thread.join(timeout)

    def _background_sync(self, force: bool = False) -> None:
        if self.fsync or self.fsync_interval_s is None or not self._dirty:
            return
        if force or time.monotonic() - self._last_sync >= self.fsync_interval_s:
            dirty, self._dirty = self._dirty, set()
            try:
                self._sync(dirty, force=True)
            except OSError:
                logger.exception("background fsync of the record store failed")
            self._last_sync = time.monotonic()

    def _run(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=self.fsync_interval_s if (not self.fsync and self._dirty) else None)
            except queue.Empty:
                self._background_sync()
                continue
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = False
            done: list[tuple[concurrent.futures.Future, Any]] = []
            touched: set[str] = set()
            for it in batch:
                if it is _STOP:
                    stop = True
                    continue
                op, arg, fut = it
                try:
                    if op == "append":
                        done.append((fut, self.store.append(arg)))
                        touched.add(arg.execution_id)
                        self._dirty.add(arg.execution_id)
                    elif op == "mark":
                        self.store.mark_delivered(*arg)
                        done.append((fut, None))
                        touched.add(arg[0])
                        self._dirty.add(arg[0])
                    else:
                        self._sync(touched)
                        touched.clear()
                        self.store.close_execution(arg)  # closing fsyncs
                        self._dirty.discard(arg)
                        done.append((fut, None))
                except Exception as exc:  # report to the waiting call
                    logger.exception("record store operation %s failed", op)
                    fut.set_exception(exc)
            try:
                self._sync(touched)
            except OSError as exc:
                logger.exception("fsync of the record store failed")
                for fut, _ in done:
                    fut.set_exception(exc)
                done = []
            for fut, res in done:
                fut.set_result(res)
            self.batches += 1
            self.records += sum(1 for it in batch if it is not _STOP and it[0] == "append")
            self._background_sync()
            if stop:
                try:
                    self.store.close()
                finally:
                    return

    def _sync(self, execution_ids: set[str], force: bool = False) -> None:
        if not (self.fsync or force):
            return
        for eid in execution_ids:
            # fsync flushes the file's (inode's) dirty pages whichever descriptor wrote them
            fd = os.open(self.store.path(eid), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
