"""A child process of an execution: own process group, log file, time limit, optional isolation.

:class:`SandboxProcess` starts a command (a harness, an evaluation command, or a sandbox runtime
wrapping one) as the leader of a new process group with stdin
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

__all__ = ["SandboxProcess", "ProcessExit", "isolation_argv", "isolation_supported", "ISOLATION_SETUP_FAILED",
           "ISOLATION_SETUP_MARKER", "signal_group"]

logger = logging.getLogger(__name__)

#: Exit status of the isolation wrapper when its mounts fail (the command did not run).
ISOLATION_SETUP_FAILED = 96
#: What the isolation wrapper writes to stderr when its mounts fail.
ISOLATION_SETUP_MARKER = "gyre: isolation setup failed"

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


def isolation_argv(argv: Sequence[str], *, own_dir: str | os.PathLike[str], cwd: str | os.PathLike[str],
                   masks: Sequence[str | os.PathLike[str]] = (), private_tmp: str | None = None) -> list[str]:
    """``argv`` under the isolation wrapper (:class:`SandboxProcess`); raises ``OSError`` when
    ``unshare`` or ``mount`` is missing."""
    prefix = _unshare_argv()
    if prefix is None:
        raise OSError("isolation requested but unshare/mount are unavailable")
    return [*prefix, "--", "sh", "-c", _INIT_SCRIPT, "gyre-init", str(own_dir), str(cwd), str(private_tmp or ""),
            str(len(masks)), *(str(m) for m in masks), *(str(a) for a in argv)]


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
                str(root / "run"), "sh", "-c", 'test ! -e "$1" && touch ok', "sh",
                str(root / "run" / "other" / "secret")]
        try:
            res = subprocess.run(argv, capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return False
        ok = res.returncode == 0 and (own / "ok").exists()
        if not ok:
            logger.info("process isolation unavailable: %s", res.stderr.decode(errors="replace").strip()[-300:])
        return ok


@dataclass(slots=True, frozen=True)
class ProcessExit:
    """How a child process ended.

    * ``returncode`` -- exit status (negative: killed by that signal; under isolation a death
      by signal ``N`` reads as ``128 + N``, as a shell reports it); ``None`` when Gyre killed it
      (time limit or cancel);
    * ``timed_out`` -- it ran past its limit; ``cancelled`` -- ``cancel()`` became true;
    * ``duration_s`` -- seconds from start to exit (or kill);
    * ``isolation_failed`` -- the isolation wrapper could not set up its mounts (the command
      never ran).
    """

    returncode: int | None
    timed_out: bool
    cancelled: bool
    duration_s: float
    isolation_failed: bool = False


def signal_group(pgid: int, sig: int) -> None:
    """``killpg`` that ignores a group already gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class SandboxProcess:
    """One child process of an execution.

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
    3. runs the command as its child, forwards ``SIGTERM``/``SIGINT``/``SIGHUP`` to it, waits
       for it and exits with its status. When the init exits, the kernel kills everything left
       in the pid namespace (``setsid`` escapees included), and ``--mount-proc`` means ``/proc``
       shows only the namespace's own processes (another execution's environment, and so its
       proxy key, cannot be read there).

    Args:
        argv: the command; ``cwd``: its working directory; ``env``: its complete environment.
        log_path: file receiving stdout and stderr (appended).
        stderr_path: a separate file for stderr (appended; ``None``: the log file).
        isolate: run inside the isolation wrapper (needs :func:`isolation_supported`).
        own_dir: the execution directory kept visible (isolation only).
        masks: paths hidden from the child (isolation only).
        private_tmp: size of a private ``tmpfs`` mounted on ``/tmp`` (e.g. ``"2g"``; isolation
            only; ``None``: the shared ``/tmp``).
        kill_grace_s: seconds between ``SIGTERM`` and ``SIGKILL``.
        signal_hook: called with ``SIGTERM`` / ``SIGKILL`` whenever the group is signalled at the
            limit or on cancel (a container runtime whose processes are not in the client's
            process group is stopped from there).
        check_command: look ``argv[0]`` up on ``env["PATH"]`` before starting (off where the
            command runs inside another root file system).
        setup_failed: given the exit status and the end of the log (stderr), whether a wrapper
            (a sandbox runtime) failed before the command ran (``ProcessExit.isolation_failed``).

    Raises (from :meth:`start`):
        OSError: the command could not be started (not found, not executable).
    """

    def __init__(self, argv: Sequence[str], *, cwd: str | os.PathLike[str], env: Mapping[str, str],
                 log_path: str | os.PathLike[str], isolate: bool = False, own_dir: str | os.PathLike[str] | None = None,
                 masks: Sequence[str | os.PathLike[str]] = (), private_tmp: str | None = None,
                 kill_grace_s: float = 5.0, signal_hook: Callable[[int], None] | None = None,
                 check_command: bool = True, stderr_path: str | os.PathLike[str] | None = None,
                 setup_failed: Callable[[int, str], bool] | None = None) -> None:
        self.argv = [str(a) for a in argv]
        self.signal_hook, self.check_command = signal_hook, check_command
        self.stderr_path = None if stderr_path is None else Path(stderr_path)
        self.setup_failed = setup_failed
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
        if self.own_dir is None:
            raise OSError("isolation requested without the execution's own directory")
        return isolation_argv(self.argv, own_dir=self.own_dir, cwd=self.cwd, masks=self.masks,
                              private_tmp=self.private_tmp)

    def start(self) -> None:
        """Start the child (see class docstring for errors)."""
        if self.check_command and shutil.which(self.argv[0], path=self.env.get("PATH")) is None:
            raise FileNotFoundError(f"command not found: {self.argv[0]}")
        argv = self._full_argv()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log, open(self.stderr_path or os.devnull, "ab") as err:
            self.started_at = time.monotonic()
            self.proc = popen_process_group(argv, cwd=str(self.cwd), env=self.env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=err if self.stderr_path else subprocess.STDOUT)

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

    def _signal(self, pgid: int, sig: int) -> None:
        if self.signal_hook is not None:
            try:
                self.signal_hook(sig)
            except Exception as exc:  # the group is still signalled below
                logger.warning("stopping pid %d's sandbox failed: %s", pgid, exc)
        signal_group(pgid, sig)

    def kill_now(self) -> None:
        """``SIGKILL`` the whole group at once (and the signal hook); :meth:`wait` still reaps it."""
        if self.proc is not None and self._exit is None:
            self._signal(self.proc.pid, signal.SIGKILL)

    def running(self) -> bool:
        """Whether the child started and has not exited."""
        if self.proc is None or self._exit is not None:
            return False
        try:
            return not self._exited()
        except ChildProcessError:  # reaped meanwhile by wait()
            return False

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
                logger.info("pid %d %s: terminating its process group", pgid,
                            "cancelled" if how == "cancelled" else f"ran past {timeout_s:.1f} s")
                self._signal(pgid, signal.SIGTERM)
                if self._wait_exit(self.kill_grace_s) != "exited":
                    self._signal(pgid, signal.SIGKILL)
                    self._wait_exit(None)
        finally:
            signal_group(pgid, signal.SIGKILL)  # leftovers die before the leader is reaped
            rc = self.proc.wait()
            untrack_process_group(pgid)
        duration = time.monotonic() - self.started_at
        killed = how != "exited"
        iso_failed = False
        if not killed and ((self.isolate and rc == ISOLATION_SETUP_FAILED) or (self.setup_failed and rc)):
            try:
                tail = (self.stderr_path or self.log_path).read_text(errors="replace")[-4000:]
            except OSError:
                tail = ""
            iso_failed = ((self.isolate and rc == ISOLATION_SETUP_FAILED and ISOLATION_SETUP_MARKER in tail)
                          or bool(self.setup_failed and self.setup_failed(rc, tail)))
        self._exit = ProcessExit(None if killed else rc, how == "timeout", how == "cancelled", duration, iso_failed)
        return self._exit
