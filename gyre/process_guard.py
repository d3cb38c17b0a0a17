"""Keeping a job's processes tied together: no rank outlives its launcher, no child outlives its rank.

* :func:`popen_process_group` starts a command as a new process group and registers it
  (:func:`track_process_group`; :func:`untrack_process_group` once it is reaped): every group this
  process starts (harnesses, evaluation commands, engine servers) is registered while it runs.
  :func:`kill_tracked_process_groups` sends ``SIGKILL`` to all of them: it first waits (a few
  seconds at most) for groups other threads are starting, and a group registered afterwards is
  killed as it is registered, so a child started while the process ends does not outlive it.
* :func:`die_with_parent`: the kernel sends this process ``SIGTERM`` when its parent dies
  (``PR_SET_PDEATHSIG``, Linux), and a watchdog thread polls the parent process id: when the
  parent is gone it kills the tracked groups and ends the process itself. A rank thus ends when
  ``torchrun`` is killed, even by ``SIGKILL`` and even while its main thread sits in a native call
  (a collective) where Python signal handlers cannot run.
* :func:`exit_on_termination`: ``SIGTERM`` / ``SIGHUP`` kill the tracked groups, then end the
  process at once (exit status ``128 + signal``): nothing more is written to the run directory.
* :class:`RunDirectoryLock`: one job writes a run directory at a time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

_groups: set[int] = set()
_starting: dict[int, int] = {}  # thread id -> process groups it is starting now
_killing = False  # kill_tracked_process_groups was called: the process is ending
_cond = threading.Condition()
_PR_SET_PDEATHSIG = 1


def _killpg(pgid: int) -> bool:
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def track_process_group(pgid: int) -> None:
    """Register ``pgid``; once :func:`kill_tracked_process_groups` was called it is killed at once."""
    with _cond:
        _groups.add(pgid)
        killing = _killing
    if killing:
        _killpg(pgid)


def untrack_process_group(pgid: int) -> None:
    with _cond:
        _groups.discard(pgid)


def tracked_process_groups() -> set[int]:
    with _cond:
        return set(_groups)


def popen_process_group(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, start_new_session=True, **kwargs)``, its group registered.

    A :func:`kill_tracked_process_groups` that comes while the child is being started (between
    ``fork`` and the registration, which takes long on a loaded machine) waits for it and kills it
    too. Raises what ``Popen`` raises."""
    me = threading.get_ident()
    with _cond:
        _starting[me] = _starting.get(me, 0) + 1
    try:
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        track_process_group(proc.pid)  # a session leader: its group id is its pid
        return proc
    finally:
        with _cond:
            _starting[me] -= 1
            if not _starting[me]:
                del _starting[me]
            _cond.notify_all()


def kill_tracked_process_groups(wait_s: float = 5.0) -> int:
    """``SIGKILL`` every tracked process group; returns how many were signalled.

    For the end of the process: first waits up to ``wait_s`` seconds for the groups other threads
    are starting (:func:`popen_process_group`), and every group registered from now on is killed
    as it is registered."""
    global _killing
    me = threading.get_ident()
    with _cond:
        _killing = True
        _cond.wait_for(lambda: not (_starting.keys() - {me}), timeout=wait_s)
        groups = set(_groups)
    return sum(_killpg(pgid) for pgid in groups)


def die_with_parent(sig: int = signal.SIGTERM, poll_s: float = 0.5) -> bool:
    """End this process when its parent dies; returns whether the kernel request is in place.

    Asks the kernel for ``sig`` when the parent dies (Linux; sent at once if the parent already
    died), and starts a daemon thread that checks the parent process id every ``poll_s`` seconds:
    once the parent is gone it kills the tracked process groups and calls ``os._exit(128 + sig)``.
    The thread covers a main thread blocked in native code, where the ``sig`` handler would wait.
    """
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent, sig, poll_s), name="die-with-parent",
                     daemon=True).start()
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), sig)
    return True


def _exit_when_orphaned(parent: int, sig: int, poll_s: float) -> None:
    while os.getppid() == parent and parent != 1:
        time.sleep(poll_s)
    try:
        kill_tracked_process_groups()
    finally:
        os._exit(128 + int(sig))


def exit_on_termination(before_exit: Callable[[], None] | None = None) -> None:
    """On ``SIGTERM`` or ``SIGHUP``: kill the tracked process groups, call ``before_exit``, and
    end the process with status ``128 + signal`` without running further Python code.

    Handlers run in the main thread between bytecodes, so the main thread must not block in one
    long native call (wait in short slices instead)."""
    def handler(signum, _frame):
        try:
            kill_tracked_process_groups()
            if before_exit is not None:
                before_exit()
        finally:
            os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


class RunDirectoryLockedError(RuntimeError):
    """Another job holds the run directory."""


class RunDirectoryLock:
    """An exclusive lock on ``RUN/.lock`` held while a job writes ``RUN`` (released when the
    process ends, however it ends).

    Raises (from :meth:`acquire`):
        RunDirectoryLockedError: another process holds it.
    """

    def __init__(self, run_dir: str | os.PathLike[str]):
        from filelock import FileLock

        self.path = Path(run_dir) / ".lock"
        self._lock = FileLock(str(self.path), timeout=0)

    def acquire(self) -> "RunDirectoryLock":
        from filelock import Timeout

        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            raise RunDirectoryLockedError(f"{self.path.parent} is in use by another job") from None
        return self

    def release(self) -> None:
        self._lock.release()

    def is_free(self) -> bool:
        """Whether no job holds the lock now.  A shared, non-blocking test: several processes (a
        job's ranks checking their configuration at once) never see each other as the holder."""
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # drops the shared lock
        return True
