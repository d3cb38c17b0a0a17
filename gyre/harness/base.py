"""The harness adapter interface: workspaces, launch, time limit, closure.

One execution, as the main job's harness launcher drives it::

    harness = make_harness("claude-code")                  # gyre.harness.registry
    harness.ensure_installed()                             # HarnessUnavailable: registry unreachable
    dirs = harness.prepare(task, run_dir, execution_id)    # WorkspaceError -> no assessable work
    running = harness.launch(task, dirs, endpoint, timeout_s=..., model_calls=...)
    result = running.wait()                                # HarnessResult; running.cancel() from any thread
    outcome = reward_manager.assess(result.closure(task), task.build_evaluator(...))

or all of it at once, setup failures included: ``result = harness.run(task, run_dir, id, endpoint)``.
:class:`ExecutionDir` is the per-execution directory layout, :class:`Harness` the adapter base
and :class:`HarnessResult` the closure handed to evaluation.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from gyre.evaluation import PreservedWorkspace, TerminationStatus, preserve_workspace, tree_digest
from gyre.harness.execution import (ExecutionDir, HarnessResult, LaunchContext, LaunchSpec, ProxyEndpoint,
                                    harness_cache_dir)
from gyre.sandbox import (BackendUnavailable, Environment, ExecutionBackend, Limits, ProxyTarget, Sandbox,
                          SandboxSpec, sandbox_name)
from gyre.sandbox.cgroups import directory_size
from gyre.sandbox.evaluation_runner import SandboxCommandRunner
from gyre.sandbox.local import LocalBackend
from gyre.sandbox.process import ProcessExit, SandboxProcess
from gyre.sandbox.spec import python_runtime_paths
from gyre.harness.roles import RoleRules
from gyre.tasks import TaskSpec, WorkspaceError

__all__ = ["ExecutionUnresolved", "Harness", "HarnessUnavailable", "RunningExecution"]

logger = logging.getLogger(__name__)


#: Environment variables copied from the parent into every harness (nothing secret).
DEFAULT_PASSTHROUGH_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "TZ", "USER", "LOGNAME", "SSL_CERT_FILE",
                           "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")


def _needs_shared_tmp(argv: Sequence[str]) -> bool:
    """True when the harness needs files that live under ``/tmp`` (this interpreter, the Gyre
    checkout, the harness cache or the command itself, e.g. a clone in a temporary directory):
    a private ``/tmp`` would hide them, so the shared one is kept (``TMPDIR`` still points at the
    execution's own ``tmp/``)."""
    tmp = Path("/tmp").resolve()
    candidates = [sys.prefix, sys.executable, Path(__file__).resolve().parents[2],
                  os.environ.get("GYRE_HARNESS_CACHE"), argv[0] if argv else None,
                  shutil.which(argv[0]) if argv else None]
    for c in candidates:
        if not c:
            continue
        try:
            real = Path(os.path.realpath(c))
        except OSError:
            continue
        if real == tmp or tmp in real.parents:
            return True
    return False


class HarnessUnavailable(RuntimeError):
    """The harness cannot be used here: its package registry is unreachable, or the
    installed command is missing. ``str(exc)`` is one line with the reason."""


class ExecutionUnresolved(RuntimeError):
    """The execution has no closure to assess: the machine it ran on was lost before it closed, or it
    was cancelled before it started anywhere. The main job excludes it (an unresolved assessment,
    never a placeholder reward). ``str(exc)`` is one line with the reason."""


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


class RunningExecution:
    """A launched harness process. :meth:`wait` blocks until it ends (or is killed at the
    time limit / cancelled), preserves the workspace and returns the :class:`HarnessResult`;
    :meth:`cancel` may be called from any thread."""

    def __init__(self, harness: "Harness", ctx: LaunchContext, proc: SandboxProcess, meta: dict[str, Any],
                 model_calls: Callable[[], int] | None, initial_digest: str | None, sandbox: Sandbox) -> None:
        self.harness, self.ctx, self.proc, self.meta = harness, ctx, proc, meta
        self.sandbox = sandbox
        self._over_limit: str | None = None
        self._next_size_check = 0.0
        self.model_calls = model_calls
        self.initial_digest = initial_digest
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._result: HarnessResult | None = None

    @property
    def execution_id(self) -> str:
        return self.ctx.execution_id

    def cancel(self) -> None:
        """Ask :meth:`wait` to terminate the harness (``SIGTERM`` to its group, then ``SIGKILL``)."""
        self._cancel.set()

    def _should_stop(self) -> bool:
        """Cancelled, or the workspace passed its size limit (checked every 2 s)."""
        if self._cancel.is_set():
            return True
        limit = self.sandbox.spec.limits.workspace_bytes
        if limit is not None and time.monotonic() >= self._next_size_check:
            self._next_size_check = time.monotonic() + 2.0
            if directory_size(self.ctx.dirs.root, stop_at=limit) > limit:
                self._over_limit = f"workspace size limit ({limit} bytes) reached"
                return True
        return False

    def wait(self) -> HarnessResult:
        """Block until the execution closes; idempotent (later calls return the same result).

        Whatever the harness left running in its sandbox is stopped before the workspace is
        preserved, and the sandbox is torn down after the closure."""
        with self._lock:
            if self._result is None:
                try:
                    ex = self.proc.wait(self.ctx.timeout_s, cancel=self._should_stop)
                    limit = self._over_limit or (self.sandbox.limit_hit() if ex.returncode != 0 else None)
                    self.sandbox.stop()
                    self._result = self.harness.close_execution(self.ctx, ex, self.meta, self.model_calls,
                                                                self.initial_digest, limit)
                finally:
                    self.sandbox.teardown()
            return self._result


class Harness(abc.ABC):
    """A black-box harness adapter.

    The harness sees its own execution directory only: with isolation
    (:mod:`gyre.sandbox.process`) the whole run directory and every path the task lists as
    ``hidden`` (evaluator-only tests, solutions) are masked in its mount namespace. The proxy
    URL and the execution's API key reach it through its environment/config
    (:meth:`build_command`), never through the parent's environment: the child gets a minimal
    environment (``PATH``, locale, ``HOME``/``TMPDIR`` of the execution, no provider keys).

    Subclasses set :attr:`name` and :attr:`roles` and implement :meth:`build_command`;
    they may override :meth:`ensure_installed` and :meth:`final_message`.

    Every launch runs in a sandbox of ``backend`` (:mod:`gyre.sandbox`): the execution's directory
    is its one writable path (``execution.json`` and ``harness.log`` read-only inside), the run
    directory and the task's hidden paths are masked, the harness's runtime (this interpreter,
    Gyre's source, the harness install cache) is bound read-only, and a sandbox without a network
    reaches the proxy at the same ``127.0.0.1:PORT`` URL through its own socket.

    Args:
        backend: where executions run (default: ``local`` with ``isolation``).
        network: give sandboxes ordinary networking (default: only the proxy).
        limits: per-execution process, memory and workspace-size limits.
        default_environment: the environment of tasks that name none (default: the host's root).
        isolation: the default ``local`` backend's ``"auto"`` (mask other executions and hidden
            paths when the machine supports it), ``"require"`` (:class:`HarnessUnavailable` when it
            does not) or ``"off"``.
        kill_grace_s: seconds between ``SIGTERM`` and ``SIGKILL`` at the time limit.
        preserve: ``"snapshot"`` (copy the workspace to ``snapshot/`` at closure) or
            ``"inplace"`` (assess ``workspace/`` itself; cheaper, relies on the harness's whole
            process group being dead).
        extra_env: more environment variables for the harness.
        passthrough_env: parent variables copied into the harness's environment.
        python_on_path: put this interpreter's directory first on the harness's ``PATH`` (so
            ``python -m pytest`` works in the workspace).
        default_timeout_s: execution budget when neither the task nor :meth:`launch` gives one.
        private_tmp_size: with isolation, the size of the harness's private ``/tmp`` (a
            ``tmpfs``; ``None``: share the machine's ``/tmp``).
    """

    name: ClassVar[str] = "harness"
    roles: ClassVar[RoleRules] = RoleRules("harness")

    def __init__(self, *, isolation: str = "auto", kill_grace_s: float = 5.0, preserve: str = "snapshot",
                 extra_env: Mapping[str, str] | None = None, passthrough_env: Sequence[str] = DEFAULT_PASSTHROUGH_ENV,
                 python_on_path: bool = True, default_timeout_s: float = 600.0,
                 private_tmp_size: str | None = "2g", backend: ExecutionBackend | None = None, network: bool = False,
                 limits: Limits | None = None, default_environment: Environment | None = None) -> None:
        if isolation not in ("auto", "require", "off"):
            raise ValueError(f"isolation must be auto, require or off, got {isolation!r}")
        if preserve not in ("snapshot", "inplace"):
            raise ValueError(f"preserve must be snapshot or inplace, got {preserve!r}")
        if not kill_grace_s >= 0:
            raise ValueError(f"kill_grace_s must be >= 0, got {kill_grace_s!r}")
        self.isolation, self.kill_grace_s, self.preserve = isolation, kill_grace_s, preserve
        self.extra_env = dict(extra_env or {})
        self.passthrough_env = tuple(passthrough_env)
        self.python_on_path = python_on_path
        self.default_timeout_s = default_timeout_s
        self.private_tmp_size = private_tmp_size
        self.backend = backend if backend is not None else LocalBackend(isolation=isolation)
        self.network = network
        self.limits = limits if limits is not None else Limits(pids=None)
        self.default_environment = default_environment

    # ------------------------------------------------------------------ adapter hooks

    def ensure_installed(self) -> None:
        """Install the harness if needed (idempotent). Raises :class:`HarnessUnavailable`."""

    @abc.abstractmethod
    def build_command(self, ctx: LaunchContext) -> LaunchSpec:
        """The command that runs the harness on ``ctx.task.instruction`` in
        ``ctx.dirs.workspace`` against ``ctx.endpoint``; may write config files under
        ``ctx.dirs.home``. Raises :class:`HarnessUnavailable` when the harness is not installed."""

    def final_message(self, ctx: LaunchContext) -> str | None:
        """The harness's final answer after it exited (default: ``final_message.txt``)."""
        try:
            return ctx.dirs.final_message_path.read_text(errors="replace")
        except OSError:
            return None

    # ------------------------------------------------------------------ launcher

    @property
    def isolated(self) -> bool:
        """Whether launches run isolated: a sandboxing backend, or ``local`` with its isolation on.

        Raises:
            HarnessUnavailable: the backend cannot run here (``isolation="require"`` without
                ``unshare``, a missing tool).
        """
        reason = self.backend.unavailable_reason()
        if reason:
            raise HarnessUnavailable(f"execution backend {self.backend.name}: {reason}")
        return not isinstance(self.backend, LocalBackend) or self.backend.isolated

    @staticmethod
    def run_label(run_dir: str | os.PathLike[str]) -> str:
        """The label naming a run directory's sandboxes (what :meth:`sweep` finds after a crash)."""
        return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]

    def sweep(self, run_dir: str | os.PathLike[str]) -> int:
        """Remove the sandboxes an earlier, crashed launcher of ``run_dir`` left; returns how many."""
        n = self.backend.sweep(self.run_label(run_dir))
        if n:
            logger.warning("removed %d sandbox(es) an earlier launcher of %s left", n, run_dir)
        return n

    def close(self) -> None:
        """Release the backend (its proxy gateway); the harness launches nothing afterwards."""
        self.backend.close()

    def evaluation_runner(self, task: TaskSpec, run_dir: str | os.PathLike[str]) -> SandboxCommandRunner | None:
        """What runs ``task``'s executable checks: a sandbox of its environment from this harness's
        backend, with its evaluator-only files read-only (``None`` for the ``local`` backend: the
        checks run as ordinary processes there, as they always did)."""
        if isinstance(self.backend, LocalBackend):
            return None
        return SandboxCommandRunner(self.backend, self.environment_of(task), run_label=self.run_label(run_dir),
                                    evaluator_files=(task.task_dir, *task.hidden), masks=(Path(run_dir).resolve(),),
                                    network=self.network, limits=self.limits)

    def evaluator(self, settings: Any, task: TaskSpec, run_dir: str | os.PathLike[str], judge_base_url: str) -> Any:
        """``task``'s designated evaluator (``settings``: the run's
        :class:`~gyre.evaluation.EvaluatorSettings`; judges without an endpoint of their own call
        ``judge_base_url``), its executable checks run by :meth:`evaluation_runner`.

        Raises:
            ValueError / ImportError / TypeError: see :meth:`gyre.evaluation.EvaluatorSettings.build`.
        """
        return settings.build(task, judge_base_url, self.evaluation_runner(task, run_dir))

    def release(self, execution_id: str) -> None:
        """Called once an execution's assessment is over; this launcher keeps nothing per execution
        (its directory stays in the run directory)."""

    def runtime_paths(self, spec: LaunchSpec) -> tuple[Path, ...]:
        """What the harness command needs from this machine, bound read-only into its sandbox:
        this interpreter and Gyre's source, the harness install cache, and the command's own
        directory when it is not a system one."""
        paths = [*python_runtime_paths(), harness_cache_dir()]
        exe = shutil.which(spec.argv[0]) if spec.argv else None
        if exe:
            parent = Path(os.path.realpath(exe)).parent
            if not any(parent == Path(d) for d in ("/bin", "/usr/bin", "/usr/local/bin", "/sbin", "/usr/sbin")):
                paths.append(parent)
        return tuple(dict.fromkeys(p for p in paths if p.exists()))

    def environment_of(self, task: TaskSpec) -> Environment:
        """The environment ``task`` runs in: its own, else ``default_environment``, else the host's root."""
        return task.environment or self.default_environment or Environment()

    def base_env(self, ctx: LaunchContext) -> dict[str, str]:
        """The environment every harness starts from (see the module docstring)."""
        path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        if self.python_on_path:
            path = os.pathsep.join([str(Path(sys.executable).parent), path])
        env = {k: os.environ[k] for k in self.passthrough_env if k in os.environ}
        env.update({
            "PATH": path, "HOME": str(ctx.dirs.home), "TMPDIR": str(ctx.dirs.tmp), "TERM": "dumb",
            "SHELL": shutil.which("bash") or "/bin/sh", "LANG": env.get("LANG", "C.UTF-8"),
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1",
            "GYRE_EXECUTION_ID": ctx.execution_id, "GYRE_TASK_ID": ctx.task.id,
        })
        return env

    def prepare(self, task: TaskSpec, run_dir: str | os.PathLike[str], execution_id: str) -> ExecutionDir:
        """Create the execution directory with the task's workspace (:meth:`ExecutionDir.create`)."""
        return ExecutionDir.create(run_dir, execution_id, task)

    def launch(self, task: TaskSpec, dirs: ExecutionDir, endpoint: ProxyEndpoint, *, timeout_s: float | None = None,
               model_calls: Callable[[], int] | None = None) -> RunningExecution:
        """Start the harness on a prepared execution directory.

        Args:
            timeout_s: execution budget in seconds (default: the task's, else ``default_timeout_s``).
            model_calls: returns how many model calls the execution has made so far (the
                proxy's counter); used to tell a crash at start from a failure after work.

        Raises:
            HarnessUnavailable: the harness is not installed / isolation required but missing.
            OSError: the command could not be started (:meth:`run` turns this into a
                ``crashed`` closure without workspace).
        """
        timeout = float(timeout_s or task.timeout_s or self.default_timeout_s)
        isolate = self.isolated
        label = self.run_label(dirs.run_dir)
        url = urllib.parse.urlsplit(endpoint.base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        proxy_target = ProxyTarget(url.hostname or "127.0.0.1", port)
        inner_endpoint = endpoint
        if self.backend.forwards_proxy(self.network):  # inside, the proxy is at the forwarder's loopback port
            inner_endpoint = dataclasses.replace(endpoint, base_url=f"http://127.0.0.1:{proxy_target.inside_port}")
        ctx = LaunchContext(dirs.execution_id, task, dirs, inner_endpoint, timeout)
        spec = self.build_command(ctx)
        env = self.base_env(ctx)
        env.update(self.extra_env)
        env.update(spec.env)
        masks = [str(dirs.run_dir), *(str(h) for h in task.hidden)]
        initial = tree_digest(dirs.workspace) if model_calls is None else None
        private_tmp = self.private_tmp_size if isolate and not _needs_shared_tmp(spec.argv) else None
        secrets = (endpoint.api_key, *spec.redact)

        def redact(s: str) -> str:
            for x in secrets:
                if x:
                    s = s.replace(x, "<redacted>")
            return s

        environment = self.environment_of(task)
        meta = {"execution_id": ctx.execution_id, "task_id": task.id, "harness": self.name,
                "endpoint": endpoint.base_url, "model": endpoint.model, "timeout_s": timeout,
                "backend": self.backend.name, "environment": environment.describe(), "network": self.network,
                "isolated": isolate, "masks": masks, "argv": [redact(a) for a in spec.argv],
                "env": {k: redact(v) for k, v in spec.env.items()}, "roles": self.roles.as_dict(),
                "started_at": time.time()}
        _write_json(dirs.meta_path, meta)
        dirs.log_path.touch()
        sandbox_spec = SandboxSpec(
            name=sandbox_name(label, ctx.execution_id, "h"), run_label=label, environment=environment,
            writable=(dirs.root,), readonly=self.runtime_paths(spec), masks=tuple(Path(m) for m in masks),
            protected=(dirs.meta_path, dirs.log_path), network=self.network, proxy=proxy_target,
            workdir=dirs.workspace, limits=self.limits, private_tmp_size=private_tmp)
        logger.info("execution %s: launching %s on task %s (timeout %.0f s, %s backend, isolated=%s)",
                    ctx.execution_id, self.name, task.id, timeout, self.backend.name, isolate)
        try:
            sandbox = self.backend.create(sandbox_spec)
        except (BackendUnavailable, RuntimeError) as exc:
            raise OSError(f"sandbox could not be created: {exc}") from exc
        try:
            if environment.is_host and shutil.which(spec.argv[0], path=env.get("PATH")) is None:
                raise FileNotFoundError(f"harness command not found: {spec.argv[0]}")
            proc = sandbox.start(spec.argv, env=env, cwd=dirs.workspace, log_path=dirs.log_path,
                                 kill_grace_s=self.kill_grace_s)
        except BaseException:
            sandbox.teardown()
            raise
        return RunningExecution(self, ctx, proc, meta, model_calls, initial, sandbox)

    def run(self, task: TaskSpec, run_dir: str | os.PathLike[str], execution_id: str, endpoint: ProxyEndpoint, *,
            timeout_s: float | None = None, model_calls: Callable[[], int] | None = None,
            on_launch: Callable[[RunningExecution], None] | None = None) -> HarnessResult:
        """Prepare, launch and wait; never raises for a failed workspace or start -- those
        become closures without workspace (``setup_failed`` / ``crashed``).

        ``on_launch`` receives the :class:`RunningExecution` once started (keep it to cancel).

        Raises:
            HarnessUnavailable: the harness is not installed / isolation required but missing.
        """
        try:
            dirs = self.prepare(task, run_dir, execution_id)
        except (WorkspaceError, OSError) as exc:
            logger.warning("execution %s: workspace setup failed: %s", execution_id, exc)
            return HarnessResult(execution_id, task.id, self.name, TerminationStatus.SETUP_FAILED, None, 0.0, None,
                                 None, error=f"workspace setup failed: {exc}")
        try:
            running = self.launch(task, dirs, endpoint, timeout_s=timeout_s, model_calls=model_calls)
        except OSError as exc:
            logger.warning("execution %s: harness %s could not start: %s", execution_id, self.name, exc)
            res = HarnessResult(execution_id, task.id, self.name, TerminationStatus.CRASHED, None, 0.0, None, dirs,
                                error=f"harness could not start: {exc}")
            try:
                meta = json.loads(dirs.meta_path.read_text())
            except (OSError, ValueError):
                meta = {}
            _write_json(dirs.meta_path, {**meta, "result": res.as_dict()})
            return res
        if on_launch is not None:
            on_launch(running)
        return running.wait()

    # ------------------------------------------------------------------ closure

    def close_execution(self, ctx: LaunchContext, ex: ProcessExit, meta: dict[str, Any],
                        model_calls: Callable[[], int] | None, initial_digest: str | None,
                        limit_hit: str | None = None) -> HarnessResult:
        """The :class:`HarnessResult` of a harness that ended as ``ex``, its workspace preserved
        (``limit_hit``: the sandbox limit that ended it, in words; the execution then closes as
        ``crashed`` with that reason, and without a workspace when the limit was its size)."""
        dirs = ctx.dirs
        calls = None
        if model_calls is not None:
            try:
                calls = int(model_calls())
            except Exception as exc:  # a broken counter must not lose the execution
                logger.warning("execution %s: model-call counter failed: %s", ctx.execution_id, exc)
        rc = ex.returncode
        error = ""
        no_work = False
        if ex.isolation_failed:
            term, no_work, error = TerminationStatus.CRASHED, True, "sandbox setup failed (see harness.log)"
        elif limit_hit:
            term, error = TerminationStatus.CRASHED, limit_hit
            no_work = limit_hit.startswith("workspace size limit")
        elif ex.timed_out:
            term = TerminationStatus.TIMEOUT
        elif ex.cancelled:
            term = TerminationStatus.CANCELLED
        elif rc == 0:
            term = TerminationStatus.COMPLETED
        else:
            if calls is not None:
                no_work = calls == 0
            elif initial_digest is not None:
                try:
                    no_work = tree_digest(dirs.workspace) == initial_digest
                except OSError:
                    no_work = True
            if no_work:
                term, error = TerminationStatus.CRASHED, f"harness crashed at start (exit {rc}, no work done)"
            elif rc is not None and rc < 0:
                term, error = TerminationStatus.CRASHED, f"harness killed by signal {-rc}"
            else:
                term = TerminationStatus.HARNESS_EXIT
        workspace: PreservedWorkspace | None = None
        if not no_work:
            try:
                if self.preserve == "snapshot":
                    workspace = preserve_workspace(dirs.workspace, dirs.snapshot)
                else:
                    workspace = PreservedWorkspace(dirs.workspace, tree_digest(dirs.workspace))
            except (OSError, shutil.Error) as exc:
                error = f"workspace could not be preserved: {exc}"
                logger.warning("execution %s: %s", ctx.execution_id, error)
        try:
            final = self.final_message(ctx)
        except Exception as exc:  # adapter parsing bug: keep the execution
            logger.warning("execution %s: reading the final message failed: %s", ctx.execution_id, exc)
            final = None
        res = HarnessResult(ctx.execution_id, ctx.task.id, self.name, term, rc, ex.duration_s, workspace, dirs,
                            final, calls, error)
        logger.info("execution %s closed: %s (exit %s, %.1f s)%s", ctx.execution_id, term.value, rc, ex.duration_s,
                    f": {error}" if error else "")
        _write_json(dirs.meta_path, {**meta, "result": res.as_dict(), "ended_at": time.time()})
        return res
