"""``apptainer``: each command in ``apptainer exec`` of the task's image or root file system directory.

What the command line asks of Apptainer (HPC sites' container runtime, often the only one allowed):
``--containall`` (own pid, ipc and mount namespaces, no host home or working directory),
``--cleanenv`` (the environment given travels as ``APPTAINERENV_*`` variables of the client, not in
its argv), ``--net --network none`` (a loopback device of its own), the spec's writable paths bound
read-write and its read-only paths (the harness's runtime, evaluator-only files) read-only at their
own paths, masked paths covered by an empty directory, the proxy socket at
:data:`~gyre.sandbox.spec.IN_SANDBOX_PROXY_SOCKET` behind the same forwarder as bwrap's.
``image`` environments run ``docker://NAME`` (or a ``.sif`` file), ``rootfs`` a directory.

Apptainer is not packaged for this machine's Debian, so this backend has only been checked by the
command lines it builds (``tests/sandbox/test_apptainer_command.py``), never run; it reports itself
unavailable where ``apptainer`` is not installed. No cgroup limits (Apptainer applies them only
from a TOML file as root); the workspace size limit still applies.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from gyre.sandbox.base import ExecutionBackend, Sandbox
from gyre.sandbox.local import copy_path
from gyre.sandbox.spec import IN_SANDBOX_PROXY_SOCKET, Environment, SandboxSpec, python_runtime_paths

__all__ = ["ApptainerBackend", "ApptainerSandbox"]

_LOOPBACK = Path(__file__).with_name("loopback.py")


class ApptainerSandbox(Sandbox):
    """Commands under ``apptainer exec`` (module docstring)."""

    def __init__(self, backend: "ApptainerBackend", spec: SandboxSpec, socket: Path | None, empty: Path) -> None:
        super().__init__(backend, spec)
        self.socket, self.empty = socket, empty

    def image(self) -> str:
        env = self.spec.environment
        if env.kind == "rootfs" or env.ref.endswith(".sif") or "://" in env.ref:
            return env.ref
        return f"docker://{env.ref}"

    def command(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path) -> tuple[list[str], dict[str, str]]:
        spec = self.spec
        args = [self.backend.exe, "exec", "--containall", "--cleanenv", "--pwd", str(cwd)]
        if not spec.network:
            args += ["--net", "--network", "none"]
        binds = [f"{p}:{p}:ro" for p in dict.fromkeys((*python_runtime_paths(), *spec.readonly))]
        binds += [f"{self.empty}:{m}:ro" for m in spec.masks]
        binds += [f"{p}:{p}:rw" for p in spec.writable]
        binds += [f"{p}:{p}:ro" for p in spec.protected]
        if self.socket is not None:
            binds.append(f"{self.socket}:{IN_SANDBOX_PROXY_SOCKET}")
        for b in binds:
            args += ["--bind", b]
        inner = [str(a) for a in argv]
        if self.socket is not None:
            inner = [sys.executable, "-I", "-S", str(_LOOPBACK), str(spec.proxy.inside_port), IN_SANDBOX_PROXY_SOCKET,
                     "--", *inner]
        client_env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")}
        client_env.update({f"APPTAINERENV_{k}": v for k, v in env.items()})
        return [*args, self.image(), *inner], client_env

    def setup_failed(self, returncode: int, log_tail: str) -> bool:
        return returncode == 255 and "FATAL:" in log_tail

    def copy_in(self, src: str | os.PathLike[str], dest: str) -> None:
        copy_path(src, self.require_writable(dest))

    def copy_out(self, src: str, dest: str | os.PathLike[str]) -> None:
        copy_path(self.require_writable(src), dest)

    def release(self) -> None:
        if self.socket is not None:
            self.backend.close_socket(self.spec.name)
        shutil.rmtree(self.empty, ignore_errors=True)


class ApptainerBackend(ExecutionBackend):
    """``apptainer exec`` sandboxes (module docstring)."""

    name = "apptainer"

    def __init__(self, *, max_starts: int | None = None) -> None:
        super().__init__(max_starts=max_starts)
        self.exe = shutil.which("apptainer") or "apptainer"

    def unavailable_reason(self, environment: Environment | None = None) -> str | None:
        if shutil.which("apptainer") is None:
            return "apptainer is not installed (it is not packaged for Debian 12)"
        if environment is not None and environment.kind not in ("image", "rootfs"):
            return f"runs images and root file system directories, not {environment.describe()}"
        return None

    def forwards_proxy(self, network: bool) -> bool:
        return not network

    def _create(self, spec: SandboxSpec) -> ApptainerSandbox:
        socket = None
        if spec.proxy is not None and not spec.network:
            socket = self.open_socket(spec.name, spec.proxy.host, spec.proxy.port)
        empty = Path(tempfile.mkdtemp(prefix=f"{spec.name}-empty-", dir=self.state_dir))
        os.chmod(empty, 0o555)
        return ApptainerSandbox(self, spec, socket, empty)
