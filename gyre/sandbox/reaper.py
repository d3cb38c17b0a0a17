"""Removes a run's sandboxes once their launcher is gone, however it ended (``SIGKILL`` included).

A backend that leaves something behind its launcher's death -- containers started detached, the
cgroups of bwrap sandboxes -- starts one reaper per run label (:func:`start_reaper`): a small
process in a session of its own, which the launcher's process-group kill does not reach. It checks
every half second that the launcher (its pid and start time) still runs; once it does not, it calls
the backend's :meth:`~gyre.sandbox.base.ExecutionBackend.sweep` for the label, removes the given
directories (gateway sockets, mount skeletons) and exits. A launcher that closes its backend
normally ends its reapers first. The reaper process itself is :mod:`gyre.sandbox.reaper_main`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["start_reaper", "process_start_time"]


def process_start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (the start time), ``None`` when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def start_reaper(backend_name: str, label: str, *, host: str | None = None,
                 remove: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start a reaper for this process and ``label`` (module docstring)."""
    argv = [sys.executable, "-m", "gyre.sandbox.reaper_main", "--pid", str(os.getpid()), "--start-time",
            process_start_time(os.getpid()) or "", "--backend", backend_name, "--label", label]
    if host:
        argv += ["--host", host]
    for d in remove:
        argv += ["--remove", d]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)
