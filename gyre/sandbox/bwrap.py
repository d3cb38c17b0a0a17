"""``bwrap``: each command in a bubblewrap sandbox over the host's root, read-only.

What a command sees:

* the host's root read-only, with the masked paths hidden behind an empty read-only directory (the
  run directory: other executions, records, checkpoints; the task's evaluator-only files) and its
  own ``/tmp``, ``/run`` and
  ``/dev/shm`` (empty ``tmpfs``), its own ``/dev`` (null, zero, random, tty) and ``/proc``;
* the spec's writable paths (the execution's directory) read-write, its read-only paths bound again
  after the masks;
* its own user, pid, ipc, uts, cgroup and network namespaces: it runs as uid 1000 with no
  capabilities, may not make further user namespaces, sees only its own processes, and has only a
  loopback device of its own -- the engines' ports, the TCPStore and every outside address are
  unreachable. The proxy is reached through the sandbox's own Unix socket
  (:class:`~gyre.sandbox.gateway.ProxyGateway`) and a forwarder listening on ``127.0.0.1:PORT``
  inside (:mod:`gyre.sandbox.loopback`), which is the sandbox's first process;
* ``--die-with-parent`` and a pid namespace: when the command's launcher or the command itself
  ends, everything left in the sandbox is killed by the kernel. The kernel ties this to the
  *thread* that started the command: start a sandbox's commands from a thread that outlives them
  (the harness launcher starts and waits in one thread);
* with cgroups (:mod:`gyre.sandbox.cgroups`): its process count and memory limited.

With ``network=True`` the sandbox shares the host's network (and so its loopback: the proxy is
reached directly, and so is everything else listening there). Runs the ``host`` environment only.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gyre.sandbox.base import BackendUnavailable, ExecutionBackend, Sandbox
from gyre.sandbox.cgroups import CGROUP_JOIN_FAILED, SandboxCgroup, cgroups_supported
from gyre.sandbox.local import copy_path
from gyre.sandbox.spec import IN_SANDBOX_PROXY_SOCKET, Environment, SandboxSpec, parse_size, python_runtime_paths

__all__ = ["BwrapBackend", "BwrapSandbox", "bwrap_unavailable_reason", "SANDBOX_UID"]

#: The user and group id a command has inside (mapped to the launcher's own outside).
SANDBOX_UID = 1000
_LOOPBACK = Path(__file__).with_name("loopback.py")


@functools.lru_cache(maxsize=1)
def bwrap_unavailable_reason() -> str | None:
    """Why bubblewrap cannot run a sandbox here (probed once), ``None`` when it can."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bubblewrap is not installed (Debian: apt-get install bubblewrap)"
    try:
        res = subprocess.run([exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
                              "--uid", str(SANDBOX_UID), "--die-with-parent", "--", "/bin/true"],
                             capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap failed to start: {exc}"
    if res.returncode != 0:
        return "bwrap cannot make its namespaces here: " + res.stderr.decode(errors="replace").strip()[-200:]
    return None


class BwrapSandbox(Sandbox):
    """A ``bwrap`` sandbox (module docstring): each :meth:`start` is one ``bwrap`` process over the
    same mounts; they share the sandbox's cgroup and gateway socket."""

    def __init__(self, backend: "BwrapBackend", spec: SandboxSpec, socket: Path | None,
                 cgroup: SandboxCgroup | None) -> None:
        super().__init__(backend, spec)
        self.socket, self.cgroup = socket, cgroup

    def mount_args(self) -> list[str]:
        spec = self.spec
        args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        tmp_size = parse_size(spec.private_tmp_size or "2g")
        args += ["--size", str(tmp_size), "--tmpfs", "/tmp", "--tmpfs", "/run", "--tmpfs", "/dev/shm"]
        for p in dict.fromkeys((*python_runtime_paths(), *spec.readonly)):
            if os.path.exists(p):
                args += ["--ro-bind", str(p), str(p)]
        for m in spec.masks:
            if os.path.isdir(m):
                args += ["--tmpfs", str(m)]
            elif os.path.lexists(m):
                args += ["--ro-bind", "/dev/null", str(m)]
        for p in spec.writable:
            args += ["--bind", str(p), str(p)]
        for p in spec.protected:
            if os.path.exists(p):
                args += ["--ro-bind", str(p), str(p)]
        if self.socket is not None:
            args += ["--bind", str(self.socket), IN_SANDBOX_PROXY_SOCKET]
        for m in spec.masks:  # after the binds below them made their mount points
            if os.path.isdir(m):
                args += ["--remount-ro", str(m)]
        return args

    def command(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path) -> tuple[list[str], dict[str, str]]:
        spec = self.spec
        ns = ["--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
              "--disable-userns", "--hostname", "gyre-sandbox", "--die-with-parent", "--new-session"]
        if spec.network:
            ns.insert(1, "--share-net")
        inner = [str(a) for a in argv]
        if self.socket is not None:
            inner = [sys.executable, "-I", "-S", str(_LOOPBACK), str(spec.proxy.inside_port), IN_SANDBOX_PROXY_SOCKET,
                     "--", *inner]
        host = [self.backend.exe, *self.mount_args(), *ns, "--chdir", str(cwd), "--", *inner]
        if self.cgroup is not None:
            host = self.cgroup.join_argv(host)
        return host, dict(env)

    def setup_failed(self, returncode: int, log_tail: str) -> bool:
        if returncode == CGROUP_JOIN_FAILED and "gyre: cgroup join failed" in log_tail:
            return True
        return returncode == 1 and any(line.startswith("bwrap: ") for line in log_tail.splitlines()[-5:])

    def copy_in(self, src: str | os.PathLike[str], dest: str) -> None:
        copy_path(src, self.require_writable(dest))

    def copy_out(self, src: str, dest: str | os.PathLike[str]) -> None:
        copy_path(self.require_writable(src), dest)

    def alive(self) -> bool:
        return bool(self.cgroup is not None and self.cgroup.pids()) or super().alive()

    def stop(self) -> None:
        super().stop()
        if self.cgroup is not None:
            self.cgroup.kill_all()

    def release(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.socket is not None:
            self.backend.close_socket(self.spec.name)

    def limit_hit(self) -> str | None:
        return None if self.cgroup is None else self.cgroup.limit_hit()


class BwrapBackend(ExecutionBackend):
    """Bubblewrap sandboxes (module docstring).

    Args:
        cgroups: ``"auto"`` (limits where the machine allows control groups), ``"require"`` or ``"off"``.
        socket_dir: where the gateway's sockets live (default: the backend's state directory).
    """

    name = "bwrap"
    needs_reaper = True  # the cgroups of sandboxes whose launcher was killed

    def __init__(self, *, cgroups: str = "auto", max_starts: int | None = None,
                 socket_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(max_starts=max_starts)
        if cgroups not in ("auto", "require", "off"):
            raise ValueError(f"cgroups must be auto, require or off, got {cgroups!r}")
        self.cgroups, self.socket_dir = cgroups, socket_dir
        self.exe = shutil.which("bwrap") or "bwrap"

    def unavailable_reason(self, environment: Environment | None = None) -> str | None:
        if environment is not None and not environment.is_host:
            return f"runs only the host environment, not {environment.describe()} (use podman or docker)"
        reason = bwrap_unavailable_reason()
        if reason is None and self.cgroups == "require" and not cgroups_supported():
            reason = "cgroups required but this machine does not let Gyre make them"
        return reason

    def forwards_proxy(self, network: bool) -> bool:
        return not network

    def _create(self, spec: SandboxSpec) -> BwrapSandbox:
        use_cgroup = self.cgroups != "off" and cgroups_supported() and (spec.limits.pids or spec.limits.memory_bytes)
        cgroup = SandboxCgroup(spec.name, spec.limits) if use_cgroup else None
        socket = None
        if spec.proxy is not None and not spec.network:
            try:
                socket = self.open_socket(spec.name, spec.proxy.host, spec.proxy.port)
            except (OSError, ValueError) as exc:
                if cgroup is not None:
                    cgroup.remove()
                raise BackendUnavailable(f"bwrap: cannot open the proxy socket of {spec.name}: {exc}") from exc
        return BwrapSandbox(self, spec, socket, cgroup)

    def sweep(self, run_label: str) -> int:
        return SandboxCgroup.sweep(f"gyre-{run_label}-") if cgroups_supported() else 0
