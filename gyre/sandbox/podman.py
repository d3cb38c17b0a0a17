"""``podman`` and ``docker``: one container per sandbox, from the task's image or Dockerfile.

A sandbox is a container started detached (``run -d``) from the environment's image, named
:func:`~gyre.sandbox.spec.sandbox_name` and labelled ``gyre.run=<run label>`` (what a start-up
sweep removes), with:

* the image's root read-only (``--read-only``; ``/tmp``, ``/run``, ``/var/tmp`` are the container's
  own ``tmpfs``), the spec's writable paths bound read-write and its read-only paths (the harness's
  runtime, which reaches an image that lacks it this way; evaluator-only files) bound read-only,
  each at its own path; masked paths covered by an empty ``tmpfs``;
* every capability dropped and ``no-new-privileges``; the process count and memory limited;
* no network (``--network none``: a loopback device of its own) unless the spec asks for one; the
  proxy is reached through the sandbox's own Unix socket, bound at
  :data:`~gyre.sandbox.spec.IN_SANDBOX_PROXY_SOCKET`, and the container's first process is the
  forwarder of :mod:`gyre.sandbox.loopback` listening on ``127.0.0.1:PORT`` (without a proxy it
  is ``sleep infinity``); ``--init`` reaps what commands leave behind.

Commands run with ``exec``; stopping a command at its limit stops the whole container (its files
in the bound paths stay). Teardown removes the container. ``podman`` runs with the ``runc``
runtime and explicit ``nofile`` / ``nproc`` limits by default, since ``crun`` cannot set them on
machines that withhold ``CAP_SYS_RESOURCE``. ``docker`` is the same class driving the Docker CLI
(against a Docker daemon, or podman's Docker-compatible service through ``DOCKER_HOST``).
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gyre.sandbox.base import BackendUnavailable, ExecutionBackend, Sandbox
from gyre.sandbox.cgroups import cgroup_dirs_of, limit_hit_in
from gyre.sandbox.local import copy_path
from gyre.sandbox.loopback import READY
from gyre.sandbox.spec import IN_SANDBOX_PROXY_SOCKET, Environment, SandboxSpec, python_runtime_paths

__all__ = ["PodmanBackend", "DockerBackend", "ContainerSandbox", "TEST_IMAGE"]

logger = logging.getLogger(__name__)

#: The image ``tools/setup_sandbox.sh`` builds offline from Debian's packages (also tagged
#: ``debian:bookworm``, so a Dockerfile ``FROM debian:bookworm`` builds without a registry).
TEST_IMAGE = "localhost/gyre-test:bookworm"
_LOOPBACK = Path(__file__).with_name("loopback.py")
_RUN_LABEL = "gyre.run"


class ContainerSandbox(Sandbox):
    """One container (module docstring)."""

    def __init__(self, backend: "PodmanBackend", spec: SandboxSpec, socket: Path | None) -> None:
        super().__init__(backend, spec)
        self.socket = socket
        self.cgroups: dict[str, Path] | None = None

    def command(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path) -> tuple[list[str], dict[str, str]]:
        env_args: list[str] = []
        client_env = self.backend.client_env()
        for key, value in env.items():  # values travel in the client's environment, not its argv
            env_args += ["--env", key]
            client_env[key] = value
        return [self.backend.exe, "exec", "--workdir", str(cwd), *env_args, self.spec.name,
                *(str(a) for a in argv)], client_env

    def host_cwd(self, cwd: Path) -> Path:
        return self.backend.state_dir  # where conmon may write its files (see PodmanBackend.cli)

    def signal_hook(self):
        def stop_container(sig: int) -> None:
            self.backend.cli(["kill", "--signal", str(int(sig)), self.spec.name], check=False, timeout_s=30)
        return stop_container

    def setup_failed(self, returncode: int, log_tail: str) -> bool:
        # the CLI's own failures: 125 (the CLI), 126 (not executable), 127 (not found in the image)
        return returncode == 125 or (returncode in (126, 127) and "OCI runtime" in log_tail)

    def copy_in(self, src: str | os.PathLike[str], dest: str) -> None:
        host = self.writable_path(dest)
        if host is not None:
            copy_path(src, host)
        else:
            self.backend.cli(["cp", str(src), f"{self.spec.name}:{dest}"])

    def copy_out(self, src: str, dest: str | os.PathLike[str]) -> None:
        host = self.writable_path(src)
        if host is not None:
            copy_path(host, dest)
        else:
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            self.backend.cli(["cp", f"{self.spec.name}:{src}", str(dest)])

    def alive(self) -> bool:
        res = self.backend.cli(["inspect", "--format", "{{.State.Running}}", self.spec.name], check=False)
        return res.returncode == 0 and res.stdout.strip() == "true"

    def stop(self) -> None:
        super().stop()
        self.backend.cli(["kill", "--signal", "KILL", self.spec.name], check=False, timeout_s=30)

    def release(self) -> None:
        self.backend.remove(self.spec.name)
        for skeleton in self.backend.state_dir.glob(f"{self.spec.name}-mask-*"):
            shutil.rmtree(skeleton, ignore_errors=True)
        if self.socket is not None:
            self.backend.close_socket(self.spec.name)

    def limit_hit(self) -> str | None:
        """From the container's control groups (found through its first process at creation)."""
        if self.cgroups is None:
            return None
        return limit_hit_in(self.cgroups.get("pids"), self.cgroups.get("memory"), self.spec.limits)


class PodmanBackend(ExecutionBackend):
    """Containers through the ``podman`` CLI (module docstring).

    Args:
        runtime: the OCI runtime (``--runtime``; ``None``: the CLI's default).
        extra_run_args: more arguments for every ``run``.
        ready_timeout_s: how long a new container's proxy forwarder may take to listen.
        host: the service the CLI talks to (``DOCKER_HOST`` / ``CONTAINER_HOST``, e.g.
            ``unix:///run/podman/podman.sock``; ``None``: the CLI's own default).
    """

    name = "podman"
    executable = "podman"
    needs_reaper = True  # containers run detached: they outlive a killed launcher

    def __init__(self, *, runtime: str | None = "runc", extra_run_args: Sequence[str] = (),
                 max_starts: int | None = None, ready_timeout_s: float = 30.0,
                 socket_dir: str | os.PathLike[str] | None = None, host: str | None = None) -> None:
        super().__init__(max_starts=max_starts)
        self.host = host
        self.runtime, self.extra_run_args = runtime, list(extra_run_args)
        self.ready_timeout_s = ready_timeout_s
        self.socket_dir = socket_dir
        self.exe = shutil.which(self.executable) or self.executable
        self._lock = threading.Lock()
        self._built: set[str] = set()

    # ------------------------------------------------------------------ the CLI

    def client_env(self) -> dict[str, str]:
        """The environment the CLI itself runs with."""
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "DOCKER_HOST", "CONTAINER_HOST",
                                                               "XDG_RUNTIME_DIR", "CONTAINERS_CONF", "TMPDIR")}
        if self.host:
            env["DOCKER_HOST" if self.name == "docker" else "CONTAINER_HOST"] = self.host
        return env

    def cli(self, args: Sequence[str], *, check: bool = True, timeout_s: float = 120.0,
            input_text: str | None = None) -> subprocess.CompletedProcess:
        """Run the CLI; with ``check``, a failure raises ``RuntimeError`` with its stderr's last line."""
        try:
            # in the state directory: conmon writes an ``oom`` file into its working directory when a
            # container's process is OOM-killed
            res = subprocess.run([self.exe, *args], capture_output=True, text=True, timeout=timeout_s,
                                 env=self.client_env(), input=input_text, cwd=self.state_dir,
                                 stdin=None if input_text is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{self.name} {args[0]} timed out after {timeout_s:.0f} s") from exc
        if check and res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{self.name} {args[0]} failed (exit {res.returncode}): {last}")
        return res

    @functools.cached_property
    def _probe(self) -> str | None:
        if shutil.which(self.executable) is None:
            return f"{self.executable} is not installed"
        try:
            res = self.cli(["version", "--format", "{{.Server.Version}}"] if self.name == "docker"
                           else ["info", "--format", "{{.Host.OCIRuntime.Name}}"], check=False, timeout_s=60)
        except RuntimeError as exc:
            return str(exc)
        if res.returncode != 0:
            return f"{self.executable} does not answer: " + (res.stderr.strip().splitlines() or ["?"])[-1]
        return None

    def image_present(self, image: str) -> bool:
        return self.cli(["image", "inspect", image], check=False, timeout_s=60).returncode == 0

    def unavailable_reason(self, environment: Environment | None = None) -> str | None:
        reason = self._probe
        if reason or environment is None:
            return reason
        if environment.is_host:
            return "runs images, not the host environment (use bwrap or local)"
        if environment.kind == "rootfs":
            return "runs images and Dockerfiles, not a root file system directory"
        if environment.kind == "image" and not self.image_present(environment.ref):
            return f"image {environment.ref} is not present here (tools/setup_sandbox.sh builds the test image)"
        if environment.kind == "dockerfile" and not Path(environment.ref).is_file():
            return f"Dockerfile {environment.ref} not found"
        return None

    # ------------------------------------------------------------------ images

    def image_for(self, environment: Environment) -> str:
        """The image a sandbox of ``environment`` starts from (a Dockerfile built once, offline)."""
        if environment.kind == "image":
            return environment.ref
        tag = environment.dockerfile_tag()
        with self._lock:
            if tag not in self._built and not self.image_present(tag):
                dockerfile = Path(environment.ref)
                pull = ["--pull=never"] if self.name == "podman" else []
                self.cli(["build", *pull, "-t", tag, "-f", str(dockerfile), str(dockerfile.parent)], timeout_s=1800)
            self._built.add(tag)
        return tag

    # ------------------------------------------------------------------ sandboxes

    def run_args(self, spec: SandboxSpec, socket: Path | None) -> list[str]:
        args = ["run", "-d", "--name", spec.name, "--label", f"{_RUN_LABEL}={spec.run_label}",
                "--hostname", "gyre-sandbox", "--read-only", "--init", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--ulimit", "nofile=1024:1024"]
        if self.runtime:
            args += ["--runtime", self.runtime]
        # an explicit nproc: the runtime's default is above what a machine without CAP_SYS_RESOURCE
        # may set (here runc refused anything above the pid space, 32768); nproc counts every process
        # of the user the container runs as, so it is kept high and pids-limit does the limiting
        _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        nproc = min(hard if hard != resource.RLIM_INFINITY else 1 << 30, 32000)
        if spec.limits.pids is not None:
            args += ["--pids-limit", str(spec.limits.pids)]
        args += ["--ulimit", f"nproc={nproc}:{nproc}"]
        if spec.limits.memory_bytes is not None:
            args += ["--memory", str(spec.limits.memory_bytes), "--memory-swap", str(spec.limits.memory_bytes)]
        if not spec.network:
            args += ["--network", "none"]
        for p in dict.fromkeys((*python_runtime_paths(), *spec.readonly)):
            if os.path.exists(p):
                args += ["-v", f"{p}:{p}:ro"]
        for m in spec.masks:
            if os.path.isdir(m):
                args += ["-v", f"{self.mask_skeleton(spec, Path(m), socket)}:{m}:ro"]
            elif os.path.lexists(m):
                args += ["-v", f"/dev/null:{m}:ro"]
        for p in spec.writable:
            args += ["-v", f"{p}:{p}:rw"]
        for p in spec.protected:
            if os.path.exists(p):
                args += ["-v", f"{p}:{p}:ro"]
        if socket is not None:
            args += ["-v", f"{socket}:{IN_SANDBOX_PROXY_SOCKET}"]
        if spec.workdir is not None:
            args += ["--workdir", str(spec.workdir)]
        return [*args, *self.extra_run_args]

    def forwards_proxy(self, network: bool) -> bool:
        return True

    def mask_skeleton(self, spec: SandboxSpec, mask: Path, socket: Path | None) -> Path:
        """An empty directory standing for ``mask`` inside, holding only the (empty) mount points of
        the paths bound below it (a container runtime cannot make them in a read-only bind)."""
        root = Path(tempfile.mkdtemp(prefix=f"{spec.name}-mask-", dir=self.state_dir))
        for p in (*spec.writable, *spec.protected):
            if mask in p.parents:
                target = root / p.relative_to(mask)
                if p.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.touch()
        return root

    def _create(self, spec: SandboxSpec) -> ContainerSandbox:
        image = self.image_for(spec.environment)
        socket = None
        if spec.proxy is not None:
            socket = self.open_socket(spec.name, spec.proxy.host, spec.proxy.port)
            first = [sys.executable, "-I", "-S", str(_LOOPBACK), str(spec.proxy.inside_port), IN_SANDBOX_PROXY_SOCKET]
        else:
            first = ["sleep", "infinity"]
        sandbox = ContainerSandbox(self, spec, socket)
        try:
            self.remove(spec.name)  # a leftover of the same name (a resumed run's)
            self.cli([*self.run_args(spec, socket), image, *first], timeout_s=120)
            pid = self.cli(["inspect", "--format", "{{.State.Pid}}", spec.name], check=False).stdout.strip()
            sandbox.cgroups = cgroup_dirs_of(int(pid)) if pid.isdigit() and int(pid) > 0 else None
            if socket is not None:
                self._wait_ready(spec.name)
        except Exception:
            sandbox.teardown()
            raise
        return sandbox

    def _wait_ready(self, name: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        delay = 0.02
        while True:
            res = self.cli(["logs", name], check=False, timeout_s=30)
            if READY in res.stderr or READY in res.stdout:
                return
            state = self.cli(["inspect", "--format", "{{.State.Running}}", name], check=False)
            if state.stdout.strip() == "false" or time.monotonic() > deadline:
                tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise BackendUnavailable(f"{self.name}: the proxy forwarder of {name} did not start: {tail}")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def remove(self, name: str) -> None:
        """Remove container ``name`` at once, if it exists, and end the ``conmon`` monitors of its
        ``exec`` sessions, which otherwise wait out podman's exec exit delay (300 s) after it is gone."""
        args = ["rm", "-f", name] if self.name == "docker" else ["rm", "-f", "-t", "0", name]
        self.cli(args, check=False, timeout_s=60)
        marker = f"\0-n\0{name}\0".encode()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmdline = (proc / "cmdline").read_bytes()
                if cmdline.startswith(b"/usr/bin/conmon\0") or b"conmon\0" in cmdline[:64]:
                    if marker in cmdline:
                        os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue

    def sweep(self, run_label: str) -> int:
        if self._probe:
            return 0
        res = self.cli(["ps", "-a", "--filter", f"label={_RUN_LABEL}={run_label}", "--format", "{{.Names}}"],
                       check=False, timeout_s=60)
        names = res.stdout.split()
        for name in names:
            self.remove(name)
        return len(names)

    def reaper_options(self) -> dict:
        return {"host": self.host}


class DockerBackend(PodmanBackend):
    """The same containers through the ``docker`` CLI (``DOCKER_HOST`` picks the daemon)."""

    name = "docker"
    executable = "docker"

    def __init__(self, *, runtime: str | None = None, **kwargs) -> None:
        super().__init__(runtime=runtime, **kwargs)
