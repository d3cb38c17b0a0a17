"""Rank 0's side of the fleet: :class:`FleetLauncher`, which the main job uses in place of a harness
when executions run on a Ray cluster (``--execution-fleet``).

It has the launcher interface the pipeline calls (:meth:`run`, :meth:`evaluator`, :meth:`release`,
``name``, ``roles``, :meth:`sweep`, :meth:`close`); rank 0 stays the Ray driver and keeps the
scheduler, the proxy and every record. For one execution it

1. creates the execution's directory in rank 0's run directory;
2. puts the task's directory and its initial workspace in Ray's object store, once per task, as
   archives (:mod:`gyre.fleet.shipping`);
3. takes a free slot (:class:`~gyre.fleet.slots.SlotPool`) and runs the execution there
   (:meth:`gyre.fleet.node.SlotAgent.run`), with the proxy endpoint rewritten to rank 0's reachable
   address when the proxy URL's host is a loopback or unspecified one (:func:`needs_advertised_host`)
   and a node runs on another machine;
4. writes what came back -- ``harness.log``, ``execution.json`` (with a ``fleet`` entry naming the
   node), ``final_message.txt`` -- into the execution's directory and returns the
   :class:`~gyre.harness.HarnessResult` (its workspace: the node's preserved copy and its digest);
5. assesses on the same node (:class:`NodeEvaluator`: each attempt of the reward manager runs there),
   and on :meth:`release` removes the node's copy and frees the slot.

A slot lost while its execution runs (its node died, its actor was killed) ends that execution
with :class:`~gyre.harness.ExecutionUnresolved`: the main job excludes it, never scores it 0; an
assessment attempt on a lost node is an unresolved attempt.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from gyre.evaluation import PreservedWorkspace, TerminationStatus
from gyre.evaluation.assessment import Evaluator
from gyre.fleet.node import ExecutionJob, NodeClosure
from gyre.fleet.shipping import digest, outside_task_dir, pack_dir, workspace_archive
from gyre.fleet.slots import SLOT_RESOURCE, Slot, SlotPool
from gyre.harness.base import ExecutionUnresolved, Harness, HarnessUnavailable
from gyre.harness.execution import ExecutionDir, HarnessResult, ProxyEndpoint, executions_root
from gyre.harness.roles import RoleRules
from gyre.tasks import TaskSpec, WorkspaceError

__all__ = ["FleetLauncher", "NodeEvaluator", "RemoteRun", "connect_ray", "needs_advertised_host", "with_host"]

logger = logging.getLogger(__name__)


def needs_advertised_host(url: str) -> bool:
    """Whether a node on another machine cannot use ``url`` as it is: its host is a loopback address
    (``127.0.0.1``, ``::1``, ``localhost``) or the unspecified one a server listens on
    (``0.0.0.0``, ``::``, from ``--proxy-host 0.0.0.0``)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return addr.is_loopback or addr.is_unspecified


def with_host(url: str, host: str) -> str:
    """``url`` with its host replaced by ``host`` (the port kept)."""
    parts = urllib.parse.urlsplit(url)
    if ":" in host:
        host = f"[{host}]"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host))


def connect_ray(address: str, *, slots_per_node: int, object_store_bytes: int | None = None) -> bool:
    """Join the Ray cluster at ``address`` as its driver; ``auto``: the cluster Ray finds here
    (``RAY_ADDRESS``, or one ``ray start`` started on this machine), else a one-node cluster started
    here offering ``slots_per_node`` slots. Returns whether this process started Ray (then it shuts
    it down). Nothing when Ray is connected already.

    Raises:
        ConnectionError: no cluster at ``address``.
    """
    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address != "auto":
        ray.init(address=address, **quiet)
        return True
    try:
        ray.init(address="auto", **quiet)
    except ConnectionError:
        ray.init(resources={SLOT_RESOURCE: slots_per_node}, num_cpus=max(1, os.cpu_count() or 1),
                 include_dashboard=False, object_store_memory=object_store_bytes, **quiet)
    return True


class RemoteRun:
    """An execution placed on the fleet, as the controller holds it to cancel it."""

    def __init__(self, execution_id: str) -> None:
        self.execution_id = execution_id
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        """End the execution (its node stops the harness as a local launcher would; one still
        waiting for a slot never starts)."""
        self.cancelled.set()


class NodeEvaluator(Evaluator):
    """The task's evaluator, each attempt run on the node holding the execution's preserved workspace."""

    def __init__(self, launcher: "FleetLauncher", settings: Any, judge_base_url: str, name: str) -> None:
        self.launcher, self.settings, self.judge_base_url, self.name = launcher, settings, judge_base_url, name

    def evaluate(self, target, *, timeout_s: float | None = None):
        """One attempt on the node (module docstring of :mod:`gyre.fleet.launcher`).

        Raises:
            ExecutionUnresolved: no slot holds the execution any more, or its node was lost (the
                reward manager records an unresolved attempt).
        """
        slot = self.launcher.slot_of(target.execution_id)
        if slot is None:
            raise ExecutionUnresolved(f"no fleet slot holds execution {target.execution_id}")
        try:
            return ray.get(slot.actor.evaluate.remote(target.execution_id, self.settings, self.judge_base_url,
                                                      target, timeout_s))
        except ray.exceptions.RayActorError as exc:
            raise ExecutionUnresolved(f"fleet node {slot} lost during the assessment: {_one_line(exc)}") from None


class FleetLauncher:
    """Runs each execution on a fleet slot (module docstring).

    Args:
        harness_factory: builds the harness on a node (picklable: a class, or a
            :func:`functools.partial` of :func:`gyre.harness.harness_from_config`).
        name / roles: the harness's name and role rules (rank 0's proxy classifies calls with them).
        run_dir: the run directory (its label names the slots' directories and sandboxes).
        advertise_host: the address nodes on other machines reach rank 0's proxy at (default: this
            machine's address as Ray sees it).
    """

    def __init__(self, harness_factory: Callable[[], Harness], *, name: str, roles: RoleRules,
                 run_dir: str | os.PathLike[str], default_timeout_s: float = 600.0,
                 advertise_host: str | None = None, owns_ray: bool = False) -> None:
        self.name, self.roles = name, roles
        self.default_timeout_s = default_timeout_s
        self.label = Harness.run_label(run_dir)
        self.advertise_host = advertise_host or ray.util.get_node_ip_address()
        self.owns_ray = owns_ray
        self.pool = SlotPool(harness_factory, self.label)
        self._lock = threading.Lock()
        self._archives: dict[str, tuple[Any, str, Any, str]] = {}
        self._held: dict[str, Slot] = {}
        self.ray_s = 0.0       # rank 0's time in Ray calls that are not the execution itself (summed)
        self.executions = 0

    # ------------------------------------------------------------------ the launcher interface

    def ensure_installed(self) -> None:
        """Nothing here: each node installs the harness on its slot's first execution.

        Raises:
            HarnessUnavailable: the cluster offers no execution slot.
        """
        if self.pool.offered() < 1:
            raise HarnessUnavailable(f"the Ray cluster offers no {SLOT_RESOURCE} resource: start its nodes with "
                                     f"ray start --resources '{{\"{SLOT_RESOURCE}\": N}}'")

    def sweep(self, run_dir: str | os.PathLike[str]) -> int:
        """Nothing to sweep on rank 0 (each slot's guard cleans its node); returns 0."""
        return 0

    def evaluator(self, settings: Any, task: TaskSpec, run_dir: str | os.PathLike[str],
                  judge_base_url: str) -> Evaluator:
        """A :class:`NodeEvaluator` named as the task's evaluator (which is built here once, so a
        task whose evaluator cannot be built fails before it runs)."""
        built = settings.build(task, judge_base_url, None)
        return NodeEvaluator(self, settings, self._reachable(judge_base_url), built.name)

    def _reachable(self, url: str) -> str:
        """``url`` as nodes on other machines can use it (:func:`needs_advertised_host`)."""
        if needs_advertised_host(url) and not self._all_local():
            return with_host(url, self.advertise_host)
        return url

    def slot_of(self, execution_id: str) -> Slot | None:
        """The slot holding ``execution_id`` (from its run until :meth:`release`)."""
        with self._lock:
            return self._held.get(execution_id)

    def release(self, execution_id: str) -> None:
        """The execution's assessment is over: remove its node copy, free its slot."""
        with self._lock:
            slot = self._held.pop(execution_id, None)
        if slot is None:
            return
        t0 = time.perf_counter()
        try:
            ray.get(slot.actor.release.remote(execution_id), timeout=60)
        except ray.exceptions.RayActorError:
            self.pool.discard(slot)
            return
        except ray.exceptions.GetTimeoutError:
            logger.warning("execution %s: the slot on %s did not release it in 60 s", execution_id, slot)
        self._count(time.perf_counter() - t0)
        self.pool.give_back(slot)

    def close(self) -> None:
        """End the slot actors; shut Ray down when this launcher started it."""
        self.pool.shutdown()
        if self.owns_ray:
            ray.shutdown()

    def run(self, task: TaskSpec, run_dir: str | os.PathLike[str], execution_id: str, endpoint: ProxyEndpoint, *,
            timeout_s: float | None = None, model_calls: Callable[[], int] | None = None,
            on_launch: Callable[[RemoteRun], None] | None = None) -> HarnessResult:
        """Run the execution on a slot (module docstring); as :meth:`gyre.harness.Harness.run`, a
        workspace that cannot be made closes as ``setup_failed``.

        Raises:
            ExecutionUnresolved: its slot was lost mid-run, or it was cancelled before a slot was free.
            ValueError: the task has hidden paths outside its directory (a node receives only that).
        """
        if outside := outside_task_dir(task):
            raise ValueError(f"task {task.id}: hidden paths outside its directory cannot be sent to a fleet "
                             f"node: {', '.join(map(str, outside))}")
        root = executions_root(Path(run_dir).resolve()) / execution_id
        dirs = ExecutionDir(root, Path(run_dir).resolve())
        try:
            root.mkdir(parents=True)
            task_ref, task_digest, ws_ref, ws_digest = self._archive(task)
        except (WorkspaceError, OSError) as exc:
            logger.warning("execution %s: workspace setup failed: %s", execution_id, exc)
            return HarnessResult(execution_id, task.id, self.name, TerminationStatus.SETUP_FAILED, None, 0.0, None,
                                 None, error=f"workspace setup failed: {exc}")
        handle = RemoteRun(execution_id)
        if on_launch is not None:
            on_launch(handle)
        slot = self.pool.acquire(handle.cancelled.is_set)
        if slot is None:
            raise ExecutionUnresolved("cancelled before a fleet slot was free")
        with self._lock:
            self._held[execution_id] = slot
        job = ExecutionJob(execution_id, task, task_digest, ws_digest, self._endpoint(endpoint),
                           timeout_s or task.timeout_s or self.default_timeout_s)
        t0 = time.perf_counter()
        ref = slot.actor.run.remote(job, task_ref, ws_ref)
        sent_cancel = False
        try:
            while not ray.wait([ref], timeout=0.1)[0]:
                if handle.cancelled.is_set() and not sent_cancel:
                    slot.actor.cancel.remote(execution_id)
                    sent_cancel = True
            closure: NodeClosure = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            with self._lock:
                self._held.pop(execution_id, None)
            self.pool.discard(slot)
            raise ExecutionUnresolved(f"fleet node {slot} lost while the execution ran: {_one_line(exc)}") from None
        result = self._closed(closure, dirs, model_calls)
        self._count(time.perf_counter() - t0 - result.duration_s)
        return result

    # ------------------------------------------------------------------ helpers

    def _count(self, seconds: float) -> None:
        with self._lock:
            self.ray_s += max(0.0, seconds)
            self.executions += 1

    def _archive(self, task: TaskSpec) -> tuple[Any, str, Any, str]:
        """The task's two archives in the object store, made once per task."""
        with self._lock:
            cached = self._archives.get(task.id)
        if cached is None:
            task_bytes, ws_bytes = pack_dir(task.task_dir), workspace_archive(task)
            cached = (ray.put(task_bytes), digest(task_bytes), ray.put(ws_bytes), digest(ws_bytes))
            with self._lock:
                cached = self._archives.setdefault(task.id, cached)
        return cached

    def _all_local(self) -> bool:
        here = ray.util.get_node_ip_address()
        return all(n["NodeManagerAddress"] == here for n in ray.nodes() if n.get("Alive"))

    def _endpoint(self, endpoint: ProxyEndpoint) -> ProxyEndpoint:
        return dataclasses.replace(endpoint, base_url=self._reachable(endpoint.base_url))

    def _closed(self, closure: NodeClosure, dirs: ExecutionDir, model_calls: Callable[[], int] | None) -> HarnessResult:
        """The node's closure as rank 0's result, its files written into the execution's directory."""
        d = closure.result
        calls = d.get("model_calls")
        if model_calls is not None:
            try:
                calls = int(model_calls())
            except Exception as exc:  # a broken counter must not lose the execution
                logger.warning("execution %s: model-call counter failed: %s", d["execution_id"], exc)
        ws = d.get("workspace")
        workspace = PreservedWorkspace(Path(ws["path"]), ws["ref"]) if ws else None
        result = HarnessResult(d["execution_id"], d["task_id"], d["harness"], TerminationStatus(d["termination"]),
                               d["exit_code"], float(d["duration_s"]), workspace, dirs, d.get("final_message"),
                               calls, d.get("error") or "")
        dirs.log_path.write_bytes(closure.harness_log)
        if result.final_message is not None:
            dirs.final_message_path.write_text(result.final_message)
        try:
            meta = json.loads(closure.execution_json) if closure.execution_json else {}
        except ValueError:
            meta = {}
        meta.update(result=result.as_dict(), fleet=closure.node)
        tmp = dirs.meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2, default=str))
        os.replace(tmp, dirs.meta_path)
        return result


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]


def launcher_from_args(args: Any, *, context_window: int | None = None) -> FleetLauncher:
    """The main job's fleet: joins ``--execution-fleet`` (:func:`connect_ray`) and ships the run's
    harness flags (:class:`gyre.harness.HarnessConfig`) for each node to build the harness from.

    Raises:
        HarnessUnavailable: the harness flag names no loadable class, or the cluster offers no slot.
    """
    import functools

    from gyre.harness.registry import HarnessConfig, harness_from_config, load_harness_class

    cfg = HarnessConfig.from_args(args)
    try:
        cls = load_harness_class(cfg.harness)
    except (ValueError, ImportError, AttributeError, TypeError) as exc:
        raise HarnessUnavailable(f"harness {cfg.harness}: {exc}") from None
    owns = connect_ray(args.execution_fleet, slots_per_node=args.fleet_slots_per_node)
    launcher = FleetLauncher(functools.partial(harness_from_config, cfg, context_window=context_window),
                             name=cls.name, roles=cls.roles, run_dir=args.run_dir,
                             default_timeout_s=float(args.execution_timeout_s), owns_ray=owns)
    launcher.ensure_installed()
    return launcher
