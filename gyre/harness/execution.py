"""What one execution is made of: the proxy it calls, its directory, its launch, its result.

:class:`ProxyEndpoint` (where the harness sends its model calls), :class:`ExecutionDir` (the
per-execution directory and its workspace), :class:`LaunchContext` / :class:`LaunchSpec` (what an
adapter builds its command from, and the command), :class:`HarnessResult` (the closure handed to
evaluation). The launcher that uses them is :mod:`gyre.harness.base`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.evaluation import ExecutionClosure, PreservedWorkspace, TerminationStatus
from gyre.tasks import TaskSpec, WorkspaceError, materialize_workspace
from gyre.trajectory.records import EXECUTION_ID_RE

__all__ = ["FINAL_MESSAGE_KEY", "ProxyEndpoint", "ExecutionDir", "LaunchContext", "LaunchSpec", "HarnessResult",
           "executions_root", "harness_cache_dir"]

#: Key of the harness's final message in the evaluator target's metadata.
FINAL_MESSAGE_KEY = "final_message"


@dataclass(slots=True, frozen=True)
class ProxyEndpoint:
    """Where an execution's harness sends its model calls.

    * ``base_url`` -- the proxy root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is
      dropped): Anthropic clients use it as is, OpenAI clients append ``/v1``;
    * ``api_key`` -- the execution's key (``POST /gyre/executions`` returns it);
    * ``model`` -- the model name harnesses are told to request;
    * ``execution_id`` -- the proxy's id of the execution (for logs only).
    """

    base_url: str
    api_key: str
    model: str = "gyre-policy"
    execution_id: str | None = None

    def __post_init__(self) -> None:
        url = self.base_url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        object.__setattr__(self, "base_url", url)

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url


def harness_cache_dir() -> Path:
    """The harness cache directory: ``$GYRE_HARNESS_CACHE``, else
    ``<sys.prefix>/share/gyre/harnesses`` (inside the active venv), else ``~/.cache/gyre/harnesses``."""
    env = os.environ.get("GYRE_HARNESS_CACHE")
    if env:
        return Path(env)
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "share" / "gyre" / "harnesses"
    return Path.home() / ".cache" / "gyre" / "harnesses"


def executions_root(run_dir: str | os.PathLike[str]) -> Path:
    """``<run_dir>/executions``: where execution directories live."""
    return Path(run_dir) / "executions"


@dataclass(slots=True, frozen=True)
class ExecutionDir:
    """Paths of one execution directory, one per execution, kept after closure::

        <run_dir>/executions/<execution_id>/
            workspace/         the live workspace: the harness's working directory
            snapshot/          the preserved copy handed to evaluation (preserve="snapshot")
            home/  tmp/        the harness's HOME (its config files) and TMPDIR
            harness.log        the harness's stdout and stderr, written as it runs
            final_message.txt  the harness's last answer, when it gives one
            execution.json     task, harness, command (key redacted), timings, exit status, termination
    """

    root: Path
    run_dir: Path

    @property
    def execution_id(self) -> str:
        return self.root.name

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def snapshot(self) -> Path:
        return self.root / "snapshot"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def log_path(self) -> Path:
        return self.root / "harness.log"

    @property
    def final_message_path(self) -> Path:
        return self.root / "final_message.txt"

    @property
    def meta_path(self) -> Path:
        return self.root / "execution.json"

    @classmethod
    def create(cls, run_dir: str | os.PathLike[str], execution_id: str, task: TaskSpec) -> "ExecutionDir":
        """Create the directory and materialise the task's workspace in it.

        Raises:
            ValueError: ``execution_id`` is not a safe name (:data:`~gyre.trajectory.records.EXECUTION_ID_RE`).
            WorkspaceError: the directory exists or the workspace could not be created.
        """
        if not EXECUTION_ID_RE.match(execution_id):
            raise ValueError(f"unsafe execution id {execution_id!r}")
        run_dir = Path(run_dir).resolve()
        root = executions_root(run_dir) / execution_id
        try:
            root.mkdir(parents=True)
        except FileExistsError:
            raise WorkspaceError(f"execution directory exists: {root}") from None
        except OSError as exc:
            raise WorkspaceError(f"cannot create {root}: {exc}") from exc
        dirs = cls(root, run_dir)
        for d in (dirs.home, dirs.tmp):
            d.mkdir()
        materialize_workspace(task.workspace, dirs.workspace)
        return dirs


@dataclass(slots=True, frozen=True)
class LaunchContext:
    """What an adapter needs to build its command (:meth:`Harness.build_command`);
    ``timeout_s`` is the execution's budget (seconds)."""

    execution_id: str
    task: TaskSpec
    dirs: ExecutionDir
    endpoint: ProxyEndpoint
    timeout_s: float


@dataclass(slots=True)
class LaunchSpec:
    """The harness command: ``argv``, adapter environment (merged over the base environment),
    and ``redact`` -- strings replaced by ``<redacted>`` in ``execution.json``."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    redact: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class HarnessResult:
    """A closed execution as the launcher saw it.

    ``termination`` is ``completed`` (exit 0), ``harness_exit`` (non-zero exit after doing some
    work), ``timeout`` (killed at the limit: ``SIGTERM`` to the group, ``SIGKILL`` after the
    grace), ``cancelled``, ``crashed`` (killed by a signal, or exited non-zero before any work)
    or ``setup_failed`` (the workspace could not be created). Every closure with a workspace is
    scored the same way (partial scoring); ``workspace is None`` -- setup failed, the harness
    could not be started, or it *crashed at start* (non-zero exit with no model call made;
    without a call counter: with the workspace unchanged) -- gets the failure placeholder from
    :class:`~gyre.evaluation.RewardManager`.

    * ``exit_code`` -- exit status; negative: killed by that signal; ``None`` when Gyre killed
      it (timeout/cancel) or it never started;
    * ``duration_s`` -- harness wall time (seconds);
    * ``workspace`` -- the preserved workspace to assess, ``None`` when there is no assessable work;
    * ``final_message`` -- the harness's last answer (adapter-specific), if any;
    * ``error`` -- why there is no workspace / why it crashed (one line), else ``""``.
    """

    execution_id: str
    task_id: str
    harness: str
    termination: TerminationStatus
    exit_code: int | None
    duration_s: float
    workspace: PreservedWorkspace | None
    dirs: ExecutionDir | None
    final_message: str | None = None
    model_calls: int | None = None
    error: str = ""

    def closure(self, task: TaskSpec, execution_key: str | None = None) -> ExecutionClosure:
        """The :class:`~gyre.evaluation.ExecutionClosure` evaluation takes: the preserved
        workspace (or ``None``: placeholder), the termination status (recorded beside the
        reward, never in it), the instruction, and metadata = the task's metadata plus
        :data:`FINAL_MESSAGE_KEY`."""
        meta = dict(task.metadata)
        meta[FINAL_MESSAGE_KEY] = self.final_message
        meta["task_id"] = task.id
        return ExecutionClosure(self.execution_id, self.termination, self.workspace, task.instruction,
                                execution_key, meta)

    def as_dict(self) -> dict[str, Any]:
        return {
            "execution_id": self.execution_id, "task_id": self.task_id, "harness": self.harness,
            "termination": self.termination.value, "exit_code": self.exit_code, "duration_s": self.duration_s,
            "workspace": None if self.workspace is None else {"path": str(self.workspace.path),
                                                              "ref": self.workspace.ref},
            "final_message": self.final_message, "model_calls": self.model_calls, "error": self.error,
        }
