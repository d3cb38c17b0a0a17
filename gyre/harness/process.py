"""The harness child process: own process group, log file, time limit, optional isolation.

:class:`HarnessProcess` starts the harness as the leader of a new process group with stdin
closed and stdout+stderr appended to one log file; at the time limit or on cancel it sends
``SIGTERM`` to the whole group, then ``SIGKILL`` after a grace period.

With ``isolate=True`` (needs :func:`isolation_supported`) the child runs in a private mount and
pid namespace (``unshare``) where the run directory and the task's hidden paths are masked,
``/tmp`` is private, and everything left in the namespace dies with it. This hides paths; it is
not a security sandbox (the network, the rest of the filesystem and the user id are shared).
Without isolation only the process-group limits apply: a process that calls ``setsid()``
leaves the group and is not reached.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gyre.process_guard import popen_process_group, untrack_process_group

__all__ = ["HarnessProcess", "ProcessExit", "isolation_supported", "ISOLATION_SETUP_FAILED"]

logger = logging.getLogger(__name__)

#: Exit status of the isolation wrapper when its mounts fail (the harness did not run).
ISOLATION_SETUP_FAILED = 96
_MARKER = "gyre: isolation setup failed"

# $1 own dir, $2 working dir, $3 private /tmp size ("" = shared /tmp), $4 number of masks,
# the masks, then the command. The own dir stays reachable through the shell's cwd while
# everything is masked, then is bound back onto its path (mount -c: "." is not canonicalised).
_INIT_SCRIPT = r"""
fail() { echo "gyre: isolation setup failed: $1" >&2; exit 96; }
own=$1; workdir=$2; tmpsize=$3; n=$4; shift 4
cd "$own" || fail "cd $own"
i=0
while [ "$i" -lt "$n" ]; do
  m=$1; shift; i=$((i+1))
  if [ -d "$m" ]; then mount -t tmpfs -o size=64k,mode=755 gyre-hidden "$m" || fail "mask $m"
  elif [ -e "$m" ]; then mount --bind /dev/null "$m" || fail "mask $m"; fi
done
if [ -n "$tmpsize" ]; then mount -t tmpfs -o "size=$tmpsize,mode=1777" gyre-tmp /tmp || fail "private /tmp"; fi
mkdir -p "$own" || fail "mkdir $own"
mount --no-canonicalize --bind . "$own" || fail "rebind $own"
cd "$workdir" || fail "cd $workdir"
"$@" &
child=$!
trap 'kill -TERM $child 2>/dev/null' TERM INT HUP
while :; do
  wait $child; rc=$?
  kill -0 $child 2>/dev/null || break
done
exit $rc
"""


def _unshare_argv() -> list[str] | None:
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("mount") is None:
        return None
    return [unshare, "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private"]


@functools.lru_cache(maxsize=1)
def isolation_supported() -> bool:
    """Whether isolated launches work here (probed once: masks a directory in a namespace
    and checks the process inside cannot see what is behind it)."""
    prefix = _unshare_argv()
    if prefix is None:
        return False
    with tempfile.TemporaryDirectory(prefix="gyre-iso-probe-") as tmp:
        root = Path(tmp)
        (root / "run" / "own").mkdir(parents=True)
        (root / "run" / "other").mkdir()
        (root / "run" / "other" / "secret").write_text("x")
        own = root / "run" / "own"
        argv = [*prefix, "--", "sh", "-c", _INIT_SCRIPT, "gyre-init", str(own), str(own), "16m", "1",
                str(root / "run"), "sh", "-c", 'test ! -e "$1" && touch ok', "sh", str(root / "run" / "other" / "secret")]
        try:
            res = subprocess.run(argv, capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return False
        ok = res.returncode == 0 and (own / "ok").exists()
        if not ok:
            logger.info("harness isolation unavailable: %s", res.stderr.decode(errors="replace").strip()[-300:])
        return ok


@dataclass(slots=True, frozen=True)
class ProcessExit:
    """How the harness process ended.

    * ``returncode`` -- exit status (negative: killed by that signal; under isolation a death
      by signal ``N`` reads as ``128 + N``, as a shell reports it); ``None`` when Gyre killed it
      (time limit or cancel);
    * ``timed_out`` -- it ran past its limit; ``cancelled`` -- ``cancel()`` became true;
    * ``duration_s`` -- seconds from start to exit (or kill);
    * ``isolation_failed`` -- the isolation wrapper could not set up its mounts (the harness
      never ran).
    """

    returncode: int | None
    timed_out: bool
    cancelled: bool
    duration_s: float
    isolation_failed: bool = False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class HarnessProcess:
    """One harness child process.

    ``argv`` runs as the leader of a new session/process group (``start_new_session=True``)
    with stdin closed and stdout+stderr appended to one log file (written by the child
    directly, so the log streams while it runs). At the time limit or when cancelled
    (:meth:`wait` with ``cancel``) it sends ``SIGTERM`` to the *whole group*, waits
    ``kill_grace_s``, then ``SIGKILL``. Group members that outlive the leader are killed with
    ``SIGKILL`` before the leader is reaped, so its process id cannot be reused meanwhile.

    Isolation runs the child under ``unshare --mount --pid --fork --kill-child --mount-proc``
    with a small ``sh`` as the namespace's init that:

    1. mounts an empty ``tmpfs`` over every ``masks`` path (the run directory: other
       executions' workspaces, records, evaluations) and every hidden path (a directory gets an
       empty ``tmpfs``, a file ``/dev/null``); the execution's own directory stays reachable
       through the shell's working directory and is bound back onto its path afterwards;
    2. mounts a private, size-capped ``tmpfs`` on ``/tmp`` (discarded; ``TMPDIR`` points at
       the execution's ``tmp/``, which is kept);
    3. runs the harness as its child, forwards ``SIGTERM``/``SIGINT``/``SIGHUP`` to it, waits
       for it and exits with its status. When the init exits, the kernel kills everything left
       in the pid namespace (``setsid`` escapees included), and ``--mount-proc`` means ``/proc``
       shows only the namespace's own processes (another execution's environment, and so its
       proxy key, cannot be read there).

    Args:
        argv: the command; ``cwd``: its working directory; ``env``: its complete environment.
        log_path: file receiving stdout and stderr (appended).
        isolate: run inside the isolation wrapper (needs :func:`isolation_supported`).
        own_dir: the execution directory kept visible (isolation only).
        masks: paths hidden from the child (isolation only).
        private_tmp: size of a private ``tmpfs`` mounted on ``/tmp`` (e.g. ``"2g"``; isolation
            only; ``None``: the shared ``/tmp``).
        kill_grace_s: seconds between ``SIGTERM`` and ``SIGKILL``.

    Raises (from :meth:`start`):
        OSError: the command could not be started (not found, not executable).
    """

    def __init__(self, argv: Sequence[str], *, cwd: str | os.PathLike[str], env: Mapping[str, str],
                 log_path: str | os.PathLike[str], isolate: bool = False, own_dir: str | os.PathLike[str] | None = None,
                 masks: Sequence[str | os.PathLike[str]] = (), private_tmp: str | None = None,
                 kill_grace_s: float = 5.0) -> None:
        self.argv = [str(a) for a in argv]
        self.cwd, self.env, self.log_path = Path(cwd), dict(env), Path(log_path)
        self.isolate, self.own_dir, self.masks = isolate, own_dir, [str(Path(m)) for m in masks]
        self.private_tmp = private_tmp
        self.kill_grace_s = kill_grace_s
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self._exit: ProcessExit | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _full_argv(self) -> list[str]:
        if not self.isolate:
            return self.argv
        prefix = _unshare_argv()
        if prefix is None or self.own_dir is None:
            raise OSError("isolation requested but unshare/mount are unavailable")
        return [*prefix, "--", "sh", "-c", _INIT_SCRIPT, "gyre-init", str(self.own_dir), str(self.cwd),
                str(self.private_tmp or ""), str(len(self.masks)), *self.masks, *self.argv]

    def start(self) -> None:
        """Start the child (see class docstring for errors)."""
        if shutil.which(self.argv[0], path=self.env.get("PATH")) is None:
            raise FileNotFoundError(f"harness command not found: {self.argv[0]}")
        argv = self._full_argv()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.started_at = time.monotonic()
            self.proc = popen_process_group(argv, cwd=str(self.cwd), env=self.env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT)

    def _exited(self) -> bool:
        assert self.proc is not None
        return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def _wait_exit(self, timeout_s: float | None, cancel: Callable[[], bool] | None = None) -> str:
        """Poll until the child exits (``"exited"``), ``timeout_s`` passes (``"timeout"``) or
        ``cancel()`` is true (``"cancelled"``); the child is not reaped."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 0.005
        while True:
            if self._exited():
                return "exited"
            if cancel is not None and cancel():
                return "cancelled"
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                time.sleep(min(delay, left))
            else:
                time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def wait(self, timeout_s: float | None, *, cancel: Callable[[], bool] | None = None) -> ProcessExit:
        """Wait for the child until ``timeout_s`` seconds after its start (``None``: no limit);
        kill its group at the limit or as soon as ``cancel()`` returns true. Idempotent."""
        if self._exit is not None:
            return self._exit
        assert self.proc is not None and self.started_at is not None, "start() first"
        pgid = self.proc.pid
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - self.started_at))
        how = "exited"
        try:
            how = self._wait_exit(left, cancel)
            if how != "exited":
                logger.info("harness pid %d %s: terminating its process group", pgid,
                            "cancelled" if how == "cancelled" else f"ran past {timeout_s:.1f} s")
                _signal_group(pgid, signal.SIGTERM)
                if self._wait_exit(self.kill_grace_s) != "exited":
                    _signal_group(pgid, signal.SIGKILL)
                    self._wait_exit(None)
        finally:
            _signal_group(pgid, signal.SIGKILL)  # leftovers die before the leader is reaped
            rc = self.proc.wait()
            untrack_process_group(pgid)
        duration = time.monotonic() - self.started_at
        killed = how != "exited"
        iso_failed = False
        if self.isolate and not killed and rc == ISOLATION_SETUP_FAILED:
            try:
                iso_failed = _MARKER in self.log_path.read_text(errors="replace")[-4000:]
            except OSError:
                pass
        self._exit = ProcessExit(None if killed else rc, how == "timeout", how == "cancelled", duration, iso_failed)
        return self._exit
