"""Run a command in its own process group with a time limit (the thin shell of executable checks).

:func:`run_command` starts the command as the leader of a new session/process group
(``start_new_session=True``), waits up to ``timeout_s`` and, at the limit, sends ``SIGTERM``
to the *whole group*, waits ``grace_s``, then ``SIGKILL``. Whatever the outcome, group
members that outlive the leader (background processes a test spawned) are killed with
``SIGKILL`` before the leader is reaped -- the leader stays a zombie meanwhile
(``waitid(..., WNOWAIT)``), so its id cannot be reused for an unrelated group.

Limits (documented, not hidden): a process that calls ``setsid()``/``setpgid()`` leaves the
group and is not reached; there is no CPU/memory cgroup.

Read-only paths: with ``readonly_paths`` the command runs in a private mount namespace
(``unshare --mount``) in which each path is bind-mounted onto itself read-only -- inside it
even root cannot write there, while the rest of the filesystem is unchanged. This needs
``unshare`` and ``mount`` and the right to create a mount namespace (root, or unprivileged
user namespaces); :func:`readonly_mounts_supported` probes it once.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gyre.process_guard import popen_process_group, untrack_process_group

__all__ = ["CommandRun", "run_command", "readonly_mounts_supported", "READONLY_SETUP_FAILED"]

logger = logging.getLogger(__name__)

#: Exit status (and stderr marker) of the wrapper when the read-only bind mounts fail.
READONLY_SETUP_FAILED = 97
_MARKER = "gyre: read-only mount setup failed"

# $1 = number of paths, then the paths, then the command. Each path is bound onto itself and
# remounted read-only inside the new mount namespace; then the command replaces the shell.
_RO_SCRIPT = (
    'n=$1; shift; i=0; '
    'while [ "$i" -lt "$n" ]; do p=$1; shift; '
    'mount --bind "$p" "$p" 2>/dev/null && mount -o remount,bind,ro "$p" 2>/dev/null '
    f'|| {{ echo "{_MARKER}: $p" >&2; exit {READONLY_SETUP_FAILED}; }}; '
    'i=$((i+1)); done; exec "$@"'
)


def _unshare_prefixes() -> list[list[str]]:
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("mount") is None:
        return []
    base = [unshare, "--mount", "--propagation", "private"]
    return [base, [unshare, "--user", "--map-root-user", "--mount", "--propagation", "private"]]


@functools.lru_cache(maxsize=1)
def _readonly_prefix() -> tuple[str, ...] | None:
    """The first ``unshare`` invocation under which a read-only bind mount really blocks writes."""
    for prefix in _unshare_prefixes():
        with tempfile.TemporaryDirectory(prefix="gyre-ro-probe-") as tmp:
            target = Path(tmp) / "ro"
            target.mkdir()
            probe = target / "f"
            probe.write_text("x")
            argv = [*prefix, "--", "sh", "-c", _RO_SCRIPT, "sh", "1", str(target),
                    "sh", "-c", 'echo y > "$1" 2>/dev/null; exit 0', "sh", str(probe)]
            try:
                res = subprocess.run(argv, capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.SubprocessError):
                continue
            if res.returncode == 0 and probe.read_text() == "x":
                return tuple(prefix)
    return None


def readonly_mounts_supported() -> bool:
    """Whether :func:`run_command` can make ``readonly_paths`` read-only here (probed once)."""
    return _readonly_prefix() is not None


@dataclass(slots=True, frozen=True)
class CommandRun:
    """Result of :func:`run_command`.

    * ``returncode`` -- exit status of the command (negative: killed by that signal); ``None``
      when it was killed at the time limit;
    * ``timed_out`` -- it ran past ``timeout_s`` and its process group was killed;
    * ``duration_s`` -- seconds from start to exit (or kill);
    * ``readonly_applied`` -- the read-only mounts were in place;
    * ``readonly_failed`` -- they were requested but could not be set up (the command did not run).
    """

    returncode: int | None
    timed_out: bool
    duration_s: float
    readonly_applied: bool = False
    readonly_failed: bool = False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_exit(pid: int, timeout_s: float | None) -> bool:
    """Wait until ``pid`` has exited, without reaping it. True when it exited in time."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = 0.002
    while True:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return True
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
        else:
            time.sleep(delay)
        delay = min(delay * 2, 0.05)


def run_command(
    argv: Sequence[str],
    *,
    cwd: str | os.PathLike[str],
    env: Mapping[str, str],
    timeout_s: float,
    stdout_path: str | os.PathLike[str],
    stderr_path: str | os.PathLike[str],
    grace_s: float = 2.0,
    readonly_paths: Sequence[str | os.PathLike[str]] = (),
) -> CommandRun:
    """Run ``argv`` in a new process group with a wall-clock limit (see module docstring).

    Args:
        argv: the command (no shell unless ``argv`` starts one).
        cwd: working directory.
        env: the complete environment.
        timeout_s: limit in seconds (> 0).
        stdout_path / stderr_path: files receiving the output (files, not pipes, so a
            background process holding the descriptors cannot block the caller).
        grace_s: seconds between ``SIGTERM`` and ``SIGKILL`` at the limit.
        readonly_paths: paths made read-only for the command; needs
            :func:`readonly_mounts_supported` (else ``RuntimeError``).

    Raises:
        OSError: the command could not be started (e.g. not found).
        RuntimeError: ``readonly_paths`` given but read-only mounts are unsupported.
        ValueError: ``timeout_s <= 0``.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    argv = [str(a) for a in argv]
    ro = [str(Path(p).resolve()) for p in readonly_paths]
    if ro:
        prefix = _readonly_prefix()
        if prefix is None:
            raise RuntimeError("read-only mounts are not supported on this machine (unshare --mount failed)")
        argv = [*prefix, "--", "sh", "-c", _RO_SCRIPT, "sh", str(len(ro)), *ro, *argv]
    start = time.monotonic()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = popen_process_group(argv, cwd=str(cwd), env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    pgid = proc.pid  # session leader: pgid == pid
    timed_out = False
    try:
        if not _wait_exit(proc.pid, timeout_s):
            timed_out = True
            logger.info("command %s ran past %.1f s: terminating process group %d", argv[:3], timeout_s, pgid)
            _signal_group(pgid, signal.SIGTERM)
            if not _wait_exit(proc.pid, grace_s):
                _signal_group(pgid, signal.SIGKILL)
                _wait_exit(proc.pid, None)
    finally:
        # Leftover group members (background processes) die before the leader is reaped.
        _signal_group(pgid, signal.SIGKILL)
        rc = proc.wait()
        untrack_process_group(pgid)
    duration = time.monotonic() - start
    ro_failed = False
    if ro and not timed_out and rc == READONLY_SETUP_FAILED:
        try:
            ro_failed = _MARKER in Path(stderr_path).read_text(errors="replace")
        except OSError:
            ro_failed = False
    return CommandRun(
        returncode=None if timed_out else rc,
        timed_out=timed_out,
        duration_s=duration,
        readonly_applied=bool(ro) and not ro_failed,
        readonly_failed=ro_failed,
    )
