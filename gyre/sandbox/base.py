"""The execution backend interface: one sandbox per execution, commands run in it, then torn down.

::

    backend = make_backend("bwrap")                  # gyre.sandbox.registry
    backend.check(spec.environment)                  # BackendUnavailable: the tool is missing here
    with backend.create(spec) as sandbox:            # a burst of creates is gated (max_starts)
        proc = sandbox.start(argv, env=env, cwd=workspace, log_path=log)   # the harness
        exit = proc.wait(timeout_s, cancel=...)      # SandboxProcess: SIGTERM, then SIGKILL at the limit
        sandbox.stop()                               # nothing runs any more; the files stay
        sandbox.copy_out("/workspace/out.txt", dest)
    # leaving the block tears the sandbox down (container removed, cgroup removed, socket closed)
    backend.sweep(run_label)                         # what a crashed launcher left behind

Every backend binds the paths it is given at their own path, so commands, ``HOME`` and workspace
paths are the same inside and outside; it differs in what else the command sees
(:mod:`gyre.sandbox.local`, :mod:`gyre.sandbox.bwrap`, :mod:`gyre.sandbox.podman`).
"""

from __future__ import annotations

import abc
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from gyre.sandbox.gateway import ProxyGateway
from gyre.sandbox.process import ProcessExit, SandboxProcess
from gyre.sandbox.spec import Environment, SandboxSpec

__all__ = ["BackendUnavailable", "ExecutionBackend", "Sandbox"]

logger = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (its tool is missing or fails its probe), or cannot run the
    environment asked for. ``str(exc)`` is one line with the reason."""


class Sandbox(abc.ABC):
    """One execution's environment (module docstring). Thread-safe: :meth:`stop` and
    :meth:`teardown` may come from another thread while a command runs."""

    def __init__(self, backend: "ExecutionBackend", spec: SandboxSpec) -> None:
        self.backend, self.spec = backend, spec
        self._lock = threading.Lock()
        self._procs: list[SandboxProcess] = []
        self._torn_down = False

    # ------------------------------------------------------------------ commands

    @abc.abstractmethod
    def command(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path) -> tuple[list[str], dict[str, str]]:
        """The host command line and environment that run ``argv`` inside the sandbox."""

    def setup_failed(self, returncode: int, log_tail: str) -> bool:
        """Whether a command that exited with ``returncode`` never ran because the sandbox's
        runtime failed to set it up (``log_tail``: the end of its stderr)."""
        return False

    def signal_hook(self) -> Callable[[int], None] | None:
        """Called with the signal when a command is stopped at its limit (``None``: the process
        group of the host command holds everything the command started)."""
        return None

    def start(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike[str],
              log_path: str | os.PathLike[str], stderr_path: str | os.PathLike[str] | None = None,
              kill_grace_s: float = 5.0) -> SandboxProcess:
        """Start ``argv`` in the sandbox (``env`` is its complete environment, ``cwd`` its working
        directory inside); stdout and stderr go to ``log_path`` (stderr to ``stderr_path`` when given).

        Raises:
            BackendUnavailable: the sandbox was torn down.
            OSError: the host command could not be started.
        """
        with self._lock:
            if self._torn_down:
                raise BackendUnavailable(f"sandbox {self.spec.name} was torn down")
        host_argv, host_env = self.command(argv, env=env, cwd=Path(cwd))
        proc = SandboxProcess(host_argv, cwd=self.host_cwd(Path(cwd)), env=host_env, log_path=log_path,
                              stderr_path=stderr_path, kill_grace_s=kill_grace_s, signal_hook=self.signal_hook(),
                              check_command=False, setup_failed=self.setup_failed)
        proc.start()
        with self._lock:
            self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike[str],
            log_path: str | os.PathLike[str], timeout_s: float | None,
            stderr_path: str | os.PathLike[str] | None = None, kill_grace_s: float = 2.0,
            cancel: Callable[[], bool] | None = None) -> ProcessExit:
        """:meth:`start`, then wait up to ``timeout_s`` (the whole command stopped at the limit)."""
        proc = self.start(argv, env=env, cwd=cwd, log_path=log_path, stderr_path=stderr_path,
                          kill_grace_s=kill_grace_s)
        return proc.wait(timeout_s, cancel=cancel)

    def host_cwd(self, cwd: Path) -> Path:
        """The host directory the host command starts in (the same path when it exists here)."""
        return cwd if cwd.is_dir() else Path("/")

    # ------------------------------------------------------------------ files

    def writable_path(self, path: str) -> Path | None:
        """``path`` when it lies under one of the spec's writable paths (bound at the same path inside
        and outside, so the launcher can reach it directly), else ``None``."""
        p = Path(os.path.abspath(path))
        return p if any(p == w or w in p.parents for w in self.spec.writable) else None

    def require_writable(self, path: str) -> Path:
        """:meth:`writable_path`, or ``ValueError`` where a backend copies through the bound paths only."""
        p = self.writable_path(path)
        if p is None:
            raise ValueError(f"{path} is not under a writable path of sandbox {self.spec.name}")
        return p

    @abc.abstractmethod
    def copy_in(self, src: str | os.PathLike[str], dest: str) -> None:
        """Copy the host file or directory ``src`` to ``dest`` inside the sandbox."""

    @abc.abstractmethod
    def copy_out(self, src: str, dest: str | os.PathLike[str]) -> None:
        """Copy ``src`` inside the sandbox to the host path ``dest``."""

    # ------------------------------------------------------------------ lifecycle

    def alive(self) -> bool:
        """Whether any process of the sandbox still runs (here: a command it started)."""
        with self._lock:
            procs = list(self._procs)
        return any(p.running() for p in procs)

    def stop(self) -> None:
        """End every process of the sandbox; its files (the workspace) stay. Idempotent."""
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            proc.kill_now()
        deadline = time.monotonic() + 10
        while any(p.running() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)

    def teardown(self) -> None:
        """:meth:`stop`, then release what the sandbox holds. Idempotent; never raises."""
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        try:
            self.stop()
        except Exception as exc:
            logger.warning("sandbox %s: stop failed: %s", self.spec.name, exc)
        try:
            self.release()
        except Exception as exc:
            logger.warning("sandbox %s: teardown failed: %s", self.spec.name, exc)

    def release(self) -> None:
        """What :meth:`teardown` removes after the processes ended (backend-specific)."""

    def limit_hit(self) -> str | None:
        """The limit that ended a command, in words (``None``: none known)."""
        return None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()


class ExecutionBackend(abc.ABC):
    """Makes sandboxes of one kind. ``max_starts`` bounds how many :meth:`create` calls run at once
    (a burst of dispatches waits its turn instead of starting hundreds of runtimes together; default
    twice the machine's cores, at least 4)."""

    name: ClassVar[str] = "backend"
    #: Whether sandboxes can outlive a killed launcher (then a reaper removes them, see
    #: :mod:`gyre.sandbox.reaper`).
    needs_reaper: ClassVar[bool] = False

    def __init__(self, *, max_starts: int | None = None) -> None:
        max_starts = max_starts if max_starts is not None else max(4, 2 * (os.cpu_count() or 1))
        if max_starts < 1:
            raise ValueError(f"max_starts must be >= 1, got {max_starts!r}")
        self.max_starts = max_starts
        self._start_gate = threading.BoundedSemaphore(max_starts)
        self._reapers: dict[str, subprocess.Popen] = {}
        self._state_lock = threading.Lock()
        self._state_dir: Path | None = None
        self._gateways: dict[tuple[str, int], ProxyGateway] = {}
        self._socket_owner: dict[str, ProxyGateway] = {}
        self.socket_dir: str | os.PathLike[str] | None = None

    @property
    def state_dir(self) -> Path:
        """A private directory of this backend (gateway sockets, mount skeletons), made on first
        use; removed by :meth:`close`, or by the reaper when the launcher was killed."""
        with self._state_lock:
            if self._state_dir is None:
                self._state_dir = Path(tempfile.mkdtemp(prefix=f"gyre-{self.name}-"))
            return self._state_dir

    @abc.abstractmethod
    def unavailable_reason(self, environment: Environment | None = None) -> str | None:
        """Why this backend cannot run here (or cannot run ``environment``), in one line; ``None``
        when it can."""

    def forwards_proxy(self, network: bool) -> bool:
        """Whether a sandbox with ``network`` reaches the proxy through its own socket and a
        forwarder on its loopback (then a command inside uses ``http://127.0.0.1:PORT``)."""
        return False

    def check(self, environment: Environment | None = None) -> None:
        """Raises :class:`BackendUnavailable` with :meth:`unavailable_reason`."""
        reason = self.unavailable_reason(environment)
        if reason:
            raise BackendUnavailable(f"{self.name}: {reason}")

    def create(self, spec: SandboxSpec) -> Sandbox:
        """A new sandbox for ``spec`` (gated by ``max_starts``).

        Raises:
            BackendUnavailable: see :meth:`check`.
            OSError / RuntimeError: the runtime failed to create it (the message says why).
        """
        self.check(spec.environment)
        if self.needs_reaper:
            self._ensure_reaper(spec.run_label)
        with self._start_gate:
            return self._create(spec)

    def open_socket(self, name: str, host: str, port: int) -> Path:
        """A gateway socket for sandbox ``name`` joined to the proxy at ``host``:``port`` (one
        :class:`~gyre.sandbox.gateway.ProxyGateway` per proxy, in ``socket_dir`` or the state directory)."""
        socket_dir = self.socket_dir or self.state_dir
        with self._state_lock:
            gateway = self._gateways.get((host, port))
            if gateway is None:
                gateway = self._gateways[(host, port)] = ProxyGateway(host, port, socket_dir=socket_dir)
        path = gateway.open(name)
        with self._state_lock:
            self._socket_owner[name] = gateway
        return path

    def close_socket(self, name: str) -> None:
        """Close sandbox ``name``'s gateway socket (its teardown); nothing when it has none."""
        with self._state_lock:
            gateway = self._socket_owner.pop(name, None)
        if gateway is not None:
            gateway.close(name)

    def reaper_options(self) -> dict:
        """Keyword arguments of :func:`~gyre.sandbox.reaper.start_reaper` beyond the name, the label
        and the state directory."""
        return {}

    def _ensure_reaper(self, label: str) -> None:
        from gyre.sandbox.reaper import start_reaper

        state = str(self.state_dir)
        with self._state_lock:
            if label not in self._reapers:
                self._reapers[label] = start_reaper(self.name, label, remove=(state,), **self.reaper_options())

    def stop_reapers(self) -> None:
        """End the reapers (a launcher that closes normally has torn its sandboxes down itself)."""
        with self._state_lock:
            reapers = list(self._reapers.values())
            self._reapers.clear()
        for r in reapers:
            r.terminate()
            try:
                r.wait(5)
            except subprocess.TimeoutExpired:
                r.kill()

    @abc.abstractmethod
    def _create(self, spec: SandboxSpec) -> Sandbox:
        """Make the sandbox (called under the start gate)."""

    def sweep(self, run_label: str) -> int:
        """Remove what sandboxes of ``run_label`` left (a crashed launcher); returns how many."""
        return 0

    def close(self) -> None:
        """Release what the backend itself holds: its proxy gateways, its reapers, its state directory."""
        with self._state_lock:
            gateways = list(self._gateways.values())
            self._gateways.clear()
        for gateway in gateways:
            gateway.shutdown()
        self.stop_reapers()
        with self._state_lock:
            state, self._state_dir = self._state_dir, None
        if state is not None:
            shutil.rmtree(state, ignore_errors=True)
