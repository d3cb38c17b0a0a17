"""Per-sandbox process and memory limits through Linux control groups (v1 or v2), and the workspace size.

:class:`SandboxCgroup` makes one control group per sandbox below the launcher's own (v1: in the
``pids`` and ``memory`` hierarchies; v2: in the unified one, with the controllers enabled for its
parent), sets ``pids.max`` and the memory limit, and is joined by a sandbox's command before it
starts (:meth:`SandboxCgroup.join_argv`). It tells which limit was hit (the ``pids`` and ``memory``
event counters), kills every process in it, and removes itself. :func:`cgroups_supported` probes
once whether this machine lets the launcher make such groups (root, or a delegated v2 subtree).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from pathlib import Path

from gyre.sandbox.spec import Limits

__all__ = ["SandboxCgroup", "cgroups_supported", "cgroup_layout", "cgroup_dirs_of", "directory_size", "limit_hit_in",
           "CGROUP_JOIN_FAILED"]

logger = logging.getLogger(__name__)

#: Exit status of the join wrapper when the command could not be moved into its group.
CGROUP_JOIN_FAILED = 98
_ROOT = Path("/sys/fs/cgroup")
_PARENT = "gyre-sandboxes"


def _own_path(controller: str) -> str | None:
    """This process's cgroup path in ``controller``'s v1 hierarchy (``""`` for v2's), from /proc."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controller == "" and controllers == "") or controller in controllers.split(","):
            return path
    return None


@functools.lru_cache(maxsize=1)
def cgroup_layout() -> dict[str, Path] | None:
    """Where sandbox groups are made: ``{"pids": dir, "memory": dir}`` (v1, the same key may point to
    one v2 directory for both); ``None`` when neither layout is usable."""
    v1 = {}
    for controller in ("pids", "memory"):
        own = _own_path(controller)
        base = _ROOT / controller
        if own is not None and (base / "cgroup.procs").exists():
            v1[controller] = base / own.lstrip("/") / _PARENT
    if len(v1) == 2:
        return v1
    own = _own_path("")
    unified = _ROOT if (_ROOT / "cgroup.controllers").exists() else _ROOT / "unified"
    if own is None or not (unified / "cgroup.controllers").exists():
        return None
    controllers = (unified / "cgroup.controllers").read_text().split()
    if "pids" not in controllers or "memory" not in controllers:
        return None
    parent = unified / own.lstrip("/") / _PARENT
    return {"pids": parent, "memory": parent}


def _is_v2(directory: Path) -> bool:
    return (directory / "cgroup.controllers").exists() or (directory.parent / "cgroup.controllers").exists()


def _ensure_parent(directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    if _is_v2(directory):
        control = directory / "cgroup.subtree_control"
        enabled = control.read_text().split()
        missing = [c for c in ("pids", "memory") if c not in enabled]
        if missing:
            parent_control = directory.parent / "cgroup.subtree_control"
            parent_control.write_text(" ".join(f"+{c}" for c in missing))
            control.write_text(" ".join(f"+{c}" for c in missing))


@functools.lru_cache(maxsize=1)
def cgroups_supported() -> bool:
    """Whether sandbox groups can be made and limited here (probed once, cleaned up)."""
    layout = cgroup_layout()
    if layout is None:
        return False
    try:
        group = SandboxCgroup(f"probe-{os.getpid()}", Limits(pids=64, memory_bytes=64 << 20))
    except OSError as exc:
        logger.info("sandbox cgroups unavailable: %s", exc)
        return False
    group.remove()
    return True


class SandboxCgroup:
    """One sandbox's control group(s) (module docstring); ``create=False`` stands for groups of
    that name that already exist (a sweep removes them).

    Raises (constructor):
        OSError: the group could not be made or limited.
    """

    def __init__(self, name: str, limits: Limits, *, create: bool = True) -> None:
        layout = cgroup_layout()
        if layout is None:
            raise OSError("no usable cgroup hierarchy for pids and memory")
        self.name, self.limits = name, limits
        self._pids, self._memory = layout["pids"] / name, layout["memory"] / name
        self.dirs: list[Path] = []
        for directory in dict.fromkeys(layout.values()):
            d = directory / name
            if create:
                _ensure_parent(directory)
                d.mkdir(exist_ok=True)
            if d.is_dir():
                self.dirs.append(d)
        if create:
            try:
                self._apply()
            except OSError:
                self.remove()
                raise

    def _apply(self) -> None:
        pids, memory = self._pids, self._memory
        v2 = _is_v2(pids)
        if self.limits.pids is not None:
            (pids / "pids.max").write_text(str(self.limits.pids))
        if self.limits.memory_bytes is not None:
            if v2:
                (memory / "memory.max").write_text(str(self.limits.memory_bytes))
                if (memory / "memory.swap.max").exists():
                    (memory / "memory.swap.max").write_text("0")
            else:
                (memory / "memory.limit_in_bytes").write_text(str(self.limits.memory_bytes))
                memsw = memory / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    try:
                        memsw.write_text(str(self.limits.memory_bytes))
                    except OSError:
                        pass

    def join_argv(self, argv: list[str]) -> list[str]:
        """``argv`` preceded by a shell that moves itself into the group(s) and then ``exec``s it."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        script = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || '
                  f'{{ echo "gyre: cgroup join failed: $1" >&2; exit {CGROUP_JOIN_FAILED}; }}; '
                  'shift; n=$((n-1)); done; exec "$@"')
        return ["/bin/sh", "-c", script, "gyre-cgroup", str(len(procs)), *procs, *argv]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def kill_all(self, wait_s: float = 5.0) -> None:
        """``SIGKILL`` every process in the group until it is empty (at most ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while True:
            pids = self.pids()
            if not pids or time.monotonic() > deadline:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)

    def limit_hit(self) -> str | None:
        """Which limit the group reached, in words (``None``: neither)."""
        return limit_hit_in(self._pids, self._memory, self.limits)

    def remove(self) -> None:
        """Kill what is left and remove the group(s), killing again while a group is busy (a process
        that joined after the first kill: a sandbox being started). Idempotent; never raises."""
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self.kill_all(wait_s=0.02)
                    time.sleep(0.02)
            else:
                logger.warning("cgroup %s could not be removed", d)

    @classmethod
    def sweep(cls, prefix: str) -> int:
        """Kill and remove leftover groups whose name starts with ``prefix`` (a crashed run's);
        returns how many sandboxes' groups were removed (a group whose killed processes are still
        unreaped children of a live process stays until they are reaped)."""
        layout = cgroup_layout()
        if layout is None:
            return 0
        names: set[str] = set()
        for directory in dict.fromkeys(layout.values()):
            if directory.is_dir():
                names.update(d.name for d in directory.iterdir() if d.is_dir() and d.name.startswith(prefix))
        removed = 0
        for name in names:
            group = cls(name, Limits(), create=False)
            group.remove()
            removed += not any(d.exists() for d in group.dirs)
        return removed


def _counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def limit_hit_in(pids_dir: Path | None, memory_dir: Path | None, limits: Limits) -> str | None:
    """Which of ``limits`` the groups ``pids_dir`` / ``memory_dir`` reached, from their event counters."""
    if limits.memory_bytes is not None and memory_dir is not None:
        v2 = (memory_dir / "memory.events").exists()
        oom = _counter(memory_dir / ("memory.events" if v2 else "memory.oom_control"), "oom_kill")
        if oom:
            return f"memory limit ({limits.memory_bytes} bytes) reached: {oom} process(es) killed"
    if limits.pids is not None and pids_dir is not None and _counter(pids_dir / "pids.events", "max"):
        return f"process limit ({limits.pids}) reached"
    return None


def cgroup_dirs_of(pid: int) -> dict[str, Path]:
    """The ``pids`` and ``memory`` group directories process ``pid`` is in (v1 or v2), as this
    process sees them; missing keys where they cannot be found."""
    out: dict[str, Path] = {}
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return out
    unified = _ROOT if (_ROOT / "cgroup.controllers").exists() else _ROOT / "unified"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",") if controllers else []
        for c in ("pids", "memory"):
            if c in names:
                out[c] = _ROOT / c / path.lstrip("/")
        if not controllers and "pids" not in out:
            d = unified / path.lstrip("/")
            if (d / "pids.events").exists():
                out.setdefault("pids", d)
                out.setdefault("memory", d)
    return out


def directory_size(path: str | os.PathLike[str], stop_at: int | None = None) -> int:
    """Bytes in the files under ``path`` (symbolic links not followed); counting stops once it
    passes ``stop_at``."""
    total = 0
    stack = [str(path)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    else:
                        total += e.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
                if stop_at is not None and total > stop_at:
                    return total
    return total
