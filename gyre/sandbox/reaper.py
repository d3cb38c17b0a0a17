"""Removes a run's sandboxes once their launcher is gone, however it ended (``SIGKILL`` included).

A backend that leaves something behind its launcher's death -- containers started detached, the
cgroups of bwrap sandboxes -- starts one reaper per run label (:func:`start_reaper`): a small
process in a session of its own, which the launcher's process-group kill does not reach. It checks
every half second that the launcher (its pid and start time) still runs; once it does not, it calls
the backend's :meth:`~gyre.sandbox.base.ExecutionBackend.sweep` for the label, removes the given
directories (gateway sockets, mount skeletons) and exits. A launcher that closes its backend
normally ends its reapers first.

Usage: python -m gyre.sandbox.reaper --pid PID --backend NAME --label LABEL [--host URL] [--remove DIR ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
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
    argv = [sys.executable, "-m", "gyre.sandbox.reaper", "--pid", str(os.getpid()), "--start-time",
            process_start_time(os.getpid()) or "", "--backend", backend_name, "--label", label]
    if host:
        argv += ["--host", host]
    for d in remove:
        argv += ["--remove", d]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre.sandbox.reaper")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--start-time", default="")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--host", default=None)
    parser.add_argument("--remove", action="append", default=[])
    parser.add_argument("--poll-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    start = args.start_time or process_start_time(args.pid)
    while start is not None and process_start_time(args.pid) == start:
        time.sleep(args.poll_s)
    from gyre.sandbox.registry import BACKENDS

    backend = BACKENDS[args.backend](**({"host": args.host} if args.host else {}))
    try:
        backend.sweep(args.label)
    finally:
        backend.close()
        for d in args.remove:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
