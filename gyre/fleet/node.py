"""The node side of the fleet: one :class:`SlotAgent` per execution slot, a Ray actor on the node that
holds the slot (no Ray import here: the agent is plain Python, the launcher wraps it).

A slot runs one execution at a time, through the same launcher as rank 0 without a fleet
(:meth:`gyre.harness.Harness.run`, so the node's :class:`~gyre.sandbox.ExecutionBackend` makes the
sandbox). What it does with one execution::

    closure = agent.run(job, task_archive, workspace_archive)   # unpack once per task, run, close
    assessment = agent.evaluate(execution_id, settings, judge_url, target, timeout_s)   # 0..n times
    agent.release(execution_id)                                  # the execution's directory goes

* the slot's directory is ``<GYRE_FLEET_DIR or $TMPDIR/gyre-fleet>/<run label>/slot-<id>/``:
  ``tasks/<digest>/`` (unpacked task directories and initial workspaces) and ``run/executions/``
  (the execution directories, laid out as in a run directory); its guard
  (:mod:`gyre.fleet.guard`) removes it, and kills what the slot started, when the slot's process ends;
* the harness is built on the node by the factory the launcher ships (the run's harness flags), and
  its proxy endpoint is rank 0's reachable proxy address: a sandbox without a network reaches it
  through the backend's per-sandbox gateway socket (:class:`~gyre.sandbox.gateway.ProxyGateway`,
  joined to that address over TCP), with the execution's own key;
* the execution's crash-at-start test uses the workspace digest (the node has no call counter;
  rank 0 fills in the call count).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.fleet.guard import TOKEN_VAR, start_guard
from gyre.fleet.shipping import relocate_task, unpack

__all__ = ["ExecutionJob", "NodeClosure", "SlotAgent", "fleet_dir", "MAX_LOG_BYTES"]

#: The largest harness log a node sends back (its tail is kept).
MAX_LOG_BYTES = 32 << 20


def fleet_dir() -> Path:
    """Where slots keep their files on this node: ``$GYRE_FLEET_DIR``, else ``$TMPDIR/gyre-fleet``."""
    return Path(os.environ.get("GYRE_FLEET_DIR") or Path(tempfile.gettempdir()) / "gyre-fleet")


@dataclass(frozen=True)
class ExecutionJob:
    """One execution as rank 0 sends it: the task as loaded there, the digests naming its two
    archives (sent beside the job), the endpoint with rank 0's reachable proxy address and the
    execution's key, and its time budget."""

    execution_id: str
    task: Any                      # gyre.tasks.TaskSpec, with rank 0's paths
    task_digest: str
    workspace_digest: str
    endpoint: Any                  # gyre.harness.ProxyEndpoint
    timeout_s: float | None


@dataclass(frozen=True)
class NodeClosure:
    """A closed execution as the node returns it: the launcher's result
    (:meth:`gyre.harness.HarnessResult.as_dict`), its ``execution.json`` text, the harness log
    (its last :data:`MAX_LOG_BYTES`), where it ran."""

    result: dict[str, Any]
    execution_json: str
    harness_log: bytes
    node: dict[str, Any]


class SlotAgent:
    """One execution slot on a node (module docstring).

    Args:
        harness_factory: builds the harness here (called once, on the first execution).
        run_label: names the run (the slot's directory, the sandboxes).
        node_id: the Ray node id (reported back with each closure).
    """

    def __init__(self, harness_factory: Callable[[], Any], run_label: str, node_id: str = "") -> None:
        self.factory, self.label = harness_factory, run_label
        self.token = uuid.uuid4().hex
        os.environ[TOKEN_VAR] = self.token  # evaluation commands inherit it; harnesses get it below
        self.root = fleet_dir() / run_label / f"slot-{self.token[:12]}"
        self.run_dir = self.root / "run"
        self.run_dir.mkdir(parents=True)
        start_guard(self.token, remove=(str(self.root),))
        self.info = {"node_id": node_id, "host": socket.gethostname(), "pid": os.getpid(), "root": str(self.root)}
        self._harness = None
        self._lock = threading.Lock()
        self._unpacked: dict[str, Path] = {}
        self._tasks: dict[str, Any] = {}
        self._running: dict[str, Any] = {}
        self._cancelled: set[str] = set()

    def describe(self) -> dict[str, Any]:
        """Where this slot runs: node id, host name, process id, directory."""
        return dict(self.info)

    @property
    def harness(self):
        with self._lock:
            if self._harness is None:
                h = self.factory()
                h.extra_env[TOKEN_VAR] = self.token
                h.ensure_installed()
                self._harness = h
            return self._harness

    def _unpack_once(self, digest: str, data: bytes) -> Path:
        with self._lock:
            if digest not in self._unpacked:
                dest = self.root / "tasks" / digest
                shutil.rmtree(dest, ignore_errors=True)
                self._unpacked[digest] = unpack(data, dest)
            return self._unpacked[digest]

    def run(self, job: ExecutionJob, task_archive: bytes, workspace_archive: bytes) -> NodeClosure:
        """Run one execution to its closure here (module docstring); never raises for what
        :meth:`gyre.harness.Harness.run` turns into a closure."""
        eid = job.execution_id
        task = relocate_task(job.task, self._unpack_once(job.task_digest, task_archive),
                             self._unpack_once(job.workspace_digest, workspace_archive))
        self._tasks[eid] = task

        def launched(running) -> None:
            self._running[eid] = running
            if eid in self._cancelled:
                running.cancel()

        result = self.harness.run(task, self.run_dir, eid, job.endpoint, timeout_s=job.timeout_s, model_calls=None,
                                  on_launch=launched)
        self._running.pop(eid, None)
        root = self.run_dir / "executions" / eid
        meta = _read(root / "execution.json", limit=None).decode(errors="replace")
        log = _read(root / "harness.log", limit=MAX_LOG_BYTES)
        return NodeClosure(result.as_dict(), meta, log, self.describe())

    def cancel(self, execution_id: str) -> None:
        """End the execution's harness (as :meth:`gyre.harness.RunningExecution.cancel`), also when
        it has not started yet."""
        self._cancelled.add(execution_id)
        if (running := self._running.get(execution_id)) is not None:
            running.cancel()

    def evaluate(self, execution_id: str, settings: Any, judge_base_url: str, target: Any,
                 timeout_s: float | None) -> Any:
        """One assessment attempt of the execution's preserved workspace here: the task's evaluator,
        built by the node's harness (:meth:`gyre.harness.Harness.evaluator`), on ``target``."""
        task = self._tasks[execution_id]
        evaluator = self.harness.evaluator(settings, task, self.run_dir, judge_base_url)
        return evaluator.evaluate(target, timeout_s=timeout_s)

    def release(self, execution_id: str) -> None:
        """Remove the execution's directory and what the slot kept of it."""
        self._tasks.pop(execution_id, None)
        self._cancelled.discard(execution_id)
        shutil.rmtree(self.run_dir / "executions" / execution_id, ignore_errors=True)

    def close(self) -> None:
        """Release the harness's backend (the guard removes the directory once the process ends)."""
        if self._harness is not None:
            self._harness.close()


def _read(path: Path, *, limit: int | None) -> bytes:
    try:
        with open(path, "rb") as f:
            if limit is not None:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - limit))
            return f.read()
    except OSError:
        return b""
