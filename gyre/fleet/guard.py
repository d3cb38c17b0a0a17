"""A fleet slot's guard: when the slot's process is gone, however it ended (Ray kills the actors of a
driver that died, a node agent crashes), nothing it started keeps running and its directory goes.

The slot marks everything it starts with ``GYRE_FLEET_TOKEN=<token>`` in the environment (its own
environment, which evaluation commands inherit, and each harness's): :func:`start_guard` starts
``python -m gyre.fleet.guard`` in a session of its own, which polls the slot's pid (and start time)
every half second; once it is gone, it sends ``SIGKILL`` to every process whose environment holds
the token (again until none is left, for a few seconds: a fork caught mid-way), removes the given
directories and exits. The sandbox backends' own reapers (:mod:`gyre.sandbox.reaper`) still remove
what they track (cgroups, containers). A process that clears its environment escapes the token
scan; the ``local`` backend's isolation (a pid namespace that dies with its first process) and
bwrap's ``--die-with-parent`` cover those.

Usage: python -m gyre.fleet.guard --pid PID --start-time T --token TOKEN [--remove DIR ...] [--detach]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gyre.sandbox.reaper import process_start_time

__all__ = ["TOKEN_VAR", "start_guard", "marked_processes", "kill_marked"]

#: The environment variable that marks a slot's processes.
TOKEN_VAR = "GYRE_FLEET_TOKEN"


def marked_processes(token: str, *, exclude: int | None = None) -> list[int]:
    """Pids of this machine's processes whose environment holds ``GYRE_FLEET_TOKEN=<token>`` (those
    this user may read)."""
    needle = b"\0" + f"{TOKEN_VAR}={token}".encode() + b"\0"
    out = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        if pid in (os.getpid(), exclude):
            continue
        try:
            data = environ.read_bytes()
        except OSError:
            continue
        if needle in b"\0" + data + b"\0":
            out.append(pid)
    return out


def kill_marked(token: str, *, settle_s: float = 3.0) -> int:
    """``SIGKILL`` every process marked with ``token`` until none is left (or ``settle_s`` passed);
    returns how many were signalled."""
    killed: set[int] = set()
    deadline = time.monotonic() + settle_s
    while True:
        pids = [p for p in marked_processes(token) if process_start_time(p) is not None]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        if not pids or time.monotonic() > deadline:
            return len(killed)
        time.sleep(0.05)


def start_guard(token: str, *, remove: tuple[str, ...] = ()) -> None:
    """Start the guard of this process (module docstring). The guard itself carries no token and is
    not this process's child (it forks once more and its parent exits), so a runtime that kills a
    dead worker's children (Ray does) does not end it."""
    argv = [sys.executable, "-m", "gyre.fleet.guard", "--pid", str(os.getpid()), "--start-time",
            process_start_time(os.getpid()) or "", "--token", token]
    for d in remove:
        argv += ["--remove", d]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    subprocess.run([*argv, "--detach"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, start_new_session=True, env=env, timeout=60, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre.fleet.guard")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--start-time", default="")
    parser.add_argument("--token", required=True)
    parser.add_argument("--remove", action="append", default=[])
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--detach", action="store_true", help="fork; the parent exits at once")
    args = parser.parse_args(argv)
    if args.detach and os.fork() > 0:
        os._exit(0)
    start = args.start_time or process_start_time(args.pid)
    while start is not None and process_start_time(args.pid) == start:
        time.sleep(args.poll_s)
    kill_marked(args.token)
    for d in args.remove:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
