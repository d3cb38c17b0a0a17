"""Gyre's pipeline, one function per arrow:

    harness -> proxy -> trajectory tree -> evaluation      run_execution     (rank 0, a harness thread)
    buffer -> advantages -> admission -> materialise
           -> pack into work items                        assemble_group    (rank 0, the controller)
    claim -> accumulate -> reduce -> one core update      train_on_stream   (every cell of the step)
    core snapshot -> engines                              policy_buckets (rollout cells), publish_to_engines
                                                          (standalone pool)

When each arrow runs is the scheduler's decision: :class:`gyre.runtime.controller.Controller`
carries out its commands on rank 0 and :class:`gyre.runtime.cell_worker.CellWorker` carries out
the control messages on every cell; both call these functions and nothing else of the pipeline.
The extension points are the harness (:class:`gyre.harness.Harness`), the task's evaluator or
reward function (:mod:`gyre.evaluation`) and the loss (:mod:`gyre.rl.objective`, inside the train
step).  ``docs/architecture.md`` maps the whole system.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from gyre.buffer.work_items import decode_work_item, work_items
from gyre.rl.objective import ObjectiveStats
from gyre.runtime.cell_group import CellGroup
from gyre.training import control as ctl
from gyre.training.streaming import MicroStepStream, consume_stream, reduce_and_update

logger = logging.getLogger(__name__)

#: Additive fields of :class:`ObjectiveStats`, summed over the participants of a step.
ADDITIVE_STATS = tuple(f.name for f in dataclasses.fields(ObjectiveStats) if f.name != "rho_max")
TOKEN_COUNTS = ("row_tokens", "forward_tokens", "log_ratio_pass_tokens")
#: Counts the participants of a step sum and the core reports (StepDone fields of the same names).
STEP_SUMS = (*TOKEN_COUNTS, "compute_s")


@dataclass(frozen=True, order=True)
class ExecutionKey:
    """Who an execution is: resume ``attempt``, rollout ``group``, scheduler execution ``index``."""

    attempt: int
    group: int
    index: int

    def __str__(self) -> str:  # the execution id of records, workspaces and proxy routes
        return f"a{self.attempt}-g{self.group:04d}-e{self.index:05d}"


@dataclass
class FinishedExecution:
    """One execution after the harness closed and its evaluation: what the buffer receives."""

    key: ExecutionKey
    result: Any                 # gyre.harness.HarnessResult, None when the launcher failed
    outcome: Any                # gyre.evaluation.ExecutionOutcome
    tree: Any                   # gyre.trajectory.TrajectoryTree recorded by the proxy, or None
    error: str = ""
    execution_id: str = ""      # str(key), or the id an earlier attempt gave a carried-over execution

    def __post_init__(self) -> None:
        self.execution_id = self.execution_id or str(self.key)


def run_execution(key: ExecutionKey, task, harness, proxy, rewards, endpoint, *, run_dir: Path, timeout_s: float,
                  on_launch: Callable[[Any], None], evaluators=None) -> FinishedExecution:
    """harness -> proxy -> trajectory tree -> evaluation, for one execution registered at the proxy.

    The task's designated evaluator is built first by the harness (``evaluators``, a
    :class:`gyre.evaluation.EvaluatorSettings`; judges call the model through the proxy at
    ``endpoint`` unless a judge endpoint is configured).  The harness runs against ``endpoint``
    (the proxy records every model call into the execution's tree); the closed workspace is
    assessed while the execution's key still works (a judge calls with it, role ``evaluator``).
    ``timeout_s`` is the execution's overall budget from the harness's start: evaluation retries
    stop when it is spent (the first assessment always runs).  The execution is always closed at
    the proxy at the end (its key and route released), whatever failed.

    Outcomes: the evaluator's (``VALID``, or ``EXCLUDED`` when every attempt was unresolved);
    ``PLACEHOLDER`` (reward 0, empty tree) only when the harness closed without assessable work
    (workspace setup failed, it could not start, it crashed at start); ``EXCLUDED`` when the
    evaluator cannot be built, the launcher raises (:class:`gyre.harness.ExecutionUnresolved`: the
    execution's machine was lost), or the assessment itself raises.  The harness is told when the
    execution is over (:meth:`gyre.harness.Harness.release`).  Never raises.
    """
    from gyre.evaluation.rewards import OutcomeStatus, TerminationStatus, placeholder_tree
    from gyre.evaluation.settings import EvaluatorSettings
    from gyre.harness.base import ExecutionUnresolved

    sid = str(key)
    clock = rewards.clock
    deadline = clock() + float(timeout_s)
    result, outcome, error = None, None, ""
    try:
        try:
            evaluator = harness.evaluator(evaluators or EvaluatorSettings(), task, run_dir, endpoint.openai_base_url)
        except Exception as exc:  # a task that cannot be scored is not run
            error = f"evaluator cannot be built: {_one_line(exc)}"
            outcome = rewards.exclude(sid, TerminationStatus.SETUP_FAILED, error)
            return FinishedExecution(key, None, outcome, None, error)
        try:
            result = harness.run(task, run_dir, sid, endpoint, timeout_s=timeout_s,
                                 model_calls=lambda: proxy.counters(sid)["calls"], on_launch=on_launch)
        except ExecutionUnresolved as exc:  # e.g. its fleet node was lost: no closure, no placeholder
            error = f"execution unresolved: {_one_line(exc)}"
            logger.warning("execution %s: %s", sid, error)
            outcome = rewards.exclude(sid, TerminationStatus.CRASHED, error)
            return FinishedExecution(key, None, outcome, _tree(proxy, sid), error)
        except Exception as exc:  # a broken launcher must not stop the run
            logger.exception("execution %s failed in the launcher", sid)
            error = f"launcher failed: {_one_line(exc)}"
            outcome = rewards.exclude(sid, TerminationStatus.CRASHED, error)
            return FinishedExecution(key, None, outcome, _tree(proxy, sid), error)
        try:
            outcome = rewards.assess(result.closure(task, endpoint.api_key), evaluator, retry_until=deadline)
        except Exception as exc:
            logger.exception("execution %s: assessment failed", sid)
            error = f"assessment failed: {_one_line(exc)}"
            outcome = rewards.exclude(sid, result.termination, error)
        tree = placeholder_tree(sid) if outcome.status is OutcomeStatus.PLACEHOLDER else _tree(proxy, sid)
        return FinishedExecution(key, result, outcome, tree, error)
    finally:
        try:
            harness.release(sid)
        except Exception as exc:
            logger.warning("execution %s: releasing it at the launcher failed: %s", sid, exc)
        try:
            proxy.close_execution(sid)
        except Exception as exc:
            logger.warning("execution %s: closing at the proxy failed: %s", sid, exc)


def _tree(proxy, sid: str):
    try:
        return proxy.tree(sid)
    except Exception as exc:
        logger.warning("execution %s: no trajectory tree at the proxy: %s", sid, exc)
        return None


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


@dataclass
class AssembledGroup:
    """A ready group as training work: admitted rows packed into micro-steps, grouped in work items."""

    group_id: int
    rows: list[Any]             # gyre.trajectory.materialize.TrajectoryRow
    items: list[list[Any]]      # work items of gyre.buffer.packing.MicroStep

    targets: int = 0            # trainable tokens over all micro-steps
    micro_steps: int = 0


def assemble_group(buffer, ready, rng: np.random.Generator, admission, packer) -> AssembledGroup:
    """buffer -> advantages -> admission -> materialise -> pack, for one ready group.

    The buffer computed the advantages over the group's designated rewards when it became ready;
    admission samples at most ``J_max`` trajectories of each designated execution's tree, which are
    materialised as rows carrying the execution's advantage and packed into micro-steps.
    """
    from gyre.buffer.trajectory_buffer import materialize_group

    buffer.take(ready.group_id)
    rows = materialize_group(ready, rng, admission)
    items = work_items(packer.pack(rows).micro_steps) if rows else []
    return AssembledGroup(int(ready.group_id), rows, items, sum(int(m.num_targets) for it in items for m in it),
                          sum(len(it) for it in items))


def train_on_stream(step: int, cell: int, train_step, stream: MicroStepStream, groups, snapshot,
                    cell_group: CellGroup | None = None) -> ctl.StepDone | ctl.JoinSkipped | None:
    """claim -> accumulate -> reduce -> one update: this cell's part of step ``step``.

    A satellite (``cell > 0``) first pulls the core's snapshot of version ``step`` and joins after
    cell ``cell - 1`` (participants stay a contiguous prefix ``0..k``).  The cell claims work items
    until the stream is drained; the participants sum gradients and statistics over the prefix group
    of the window ``k``; the core performs the one optimizer update and writes snapshot ``step + 1``.

    Every rank of the cell runs it (``cell_group``, :mod:`gyre.runtime.cell_group`; alone when
    ``None``): the leader decides the join and claims the work items, and orders each one to the
    cell's other ranks, which process it in lock step; each rank pulls, reduces and publishes its
    own shard.  The leader returns the reply for rank 0, the other ranks ``None``.
    """
    cg = cell_group if cell_group is not None else CellGroup.alone(cell)
    t0 = time.perf_counter()
    if reason := _join(step, cell, stream, snapshot, train_step.params, cg):
        if cell == 0:  # the window closed before the core joined: the step had no work, the weights stay
            snapshot.server.restamp(step + 1)
        return ctl.JoinSkipped(cell, step, reason) if cg.is_leader else None
    t_join = time.perf_counter()
    stats, tokens = ObjectiveStats(), dict.fromkeys(STEP_SUMS, 0)
    train_step.zero_grad()

    def process(payload) -> float:
        from gyre.training.step import apply_log_ratio_sums

        t_item = time.perf_counter()
        items = decode_work_item(payload)
        sums, pass_tokens = train_step.precompute_log_ratio_sums(items)
        apply_log_ratio_sums(items, sums)
        _, s = train_step.accumulate(items)
        stats.merge(s)
        tokens["row_tokens"] += sum(m.row_tokens for m in items)
        tokens["forward_tokens"] += sum(m.forward_tokens for m in items)
        tokens["log_ratio_pass_tokens"] += pass_tokens
        tokens["compute_s"] += time.perf_counter() - t_item  # this cell's time in micro-steps, not waiting
        return s.loss_sum

    if cg.is_leader:
        def run_item(payload) -> float:
            cg.order("item", payload)
            return process(payload)

        count, _ = consume_stream(stream, step, cell, run_item)
        cg.order("end")
        t_consumed = time.perf_counter()
        k = cg.share(stream.wait_window(step, timeout_s=3600))
    else:
        count = 0
        while (order := cg.next_order(timeout_s=3600))[0] == "item":
            process(order[1][0])
            count += 1
        t_consumed = time.perf_counter()
        k = cg.share(None)
    norm = summed = None
    if cell <= k:
        vec = [float(getattr(stats, f)) for f in ADDITIVE_STATS] + [float(v) for v in tokens.values()]
        update = (lambda s: _core_update(train_step, s)) if cell == 0 else None
        norm, summed = reduce_and_update(train_step.params, k, groups, vec, update, grads=train_step.grad_tensors())
    train_step.zero_grad()
    t_reduced = time.perf_counter()
    if cell == 0:
        snapshot.server.publish(train_step.params, version=step + 1)
    if not cg.is_leader:
        return None
    done = ctl.StepDone(cell, step, count, k, t_join - t0, t_consumed - t_join, t_reduced - t_consumed,
                        time.perf_counter() - t0)
    if cell == 0 and summed is not None:
        n = len(ADDITIVE_STATS)
        total = ObjectiveStats(**{f: type(getattr(stats, f))(v) for f, v in zip(ADDITIVE_STATS, summed)})
        total.rho_max = stats.rho_max  # the core's own maximum (not reduced)
        done = dataclasses.replace(done, **total.metrics(), normaliser=float(total.normaliser),
                                   **dict(zip(STEP_SUMS, summed[n:])),
                                   grad_norm=float("nan") if norm is None else float(norm))
    return done


def _join(step: int, cell: int, stream: MicroStepStream, snapshot, params, cg: CellGroup) -> str:
    """Enter step ``step``'s stream; returns why not (``""`` once joined), the same on every rank
    of the cell: the leader checks the window and registers, every rank pulls its shard."""
    closed = cg.share(stream.window_closed(step) if cg.is_leader else None)
    if closed:
        return "window closed"
    if cell == 0:
        return ""
    if not cg.agree_all(snapshot.pull(params, exact=step) is not None):
        return "snapshot moved on"
    reason = ""
    if cg.is_leader:
        while cell > 1 and not stream.has_joined(step, cell - 1):
            if stream.window_closed(step):
                reason = "window closed"
                break
            time.sleep(stream.poll_s)
        if not reason:
            stream.register_joined(step, cell, timeout_s=60)
    return cg.share(reason if cg.is_leader else None)


def _core_update(train_step, summed) -> float | None:
    normaliser = summed[ADDITIVE_STATS.index("normaliser")]
    if normaliser <= 0:  # nothing counted: no update, no decay, no momentum
        return None
    return train_step.optimizer_step(int(round(normaliser)))


def _agreed_pull(snapshot, scratch: list, at_least: int, cg: CellGroup) -> int:
    """Read the newest core snapshot ``>= at_least`` into ``scratch`` on every rank of the cell,
    all at the same version; returns it."""
    want = at_least
    while True:
        version = snapshot.pull(scratch, at_least=want)
        lo, hi = cg.agree_min_max(version)
        if lo == hi:
            return version
        want = hi  # the core published while the shards read: all read the newer one


def read_policy(snapshot, train_step, scratch: list, *, at_least: int,
                cell_group: CellGroup | None = None) -> tuple[int, dict]:
    """The newest core snapshot ``>= at_least`` as HF-named weights: ``(version, named)``.  Every
    rank of the cell takes part (each reads its shard into ``scratch``, and they agree on one
    version; the train step gathers the shards, every rank gets the whole model)."""
    cg = cell_group if cell_group is not None else CellGroup.alone(0)
    version = _agreed_pull(snapshot, scratch, at_least, cg)
    return version, train_step.hf_named(scratch)


def policy_buckets(snapshot, train_step, scratch: list, *, at_least: int, bucket_bytes: int,
                   cell_group: CellGroup | None = None) -> tuple[int, Iterator[dict]]:
    """As :func:`read_policy`, but the weights come in buckets of about ``bucket_bytes``, on the
    cell's leader only (``train_step.hf_named_buckets``); every rank of the cell must exhaust the
    iterator (it gathers the shards unit by unit)."""
    cg = cell_group if cell_group is not None else CellGroup.alone(0)
    version = _agreed_pull(snapshot, scratch, at_least, cg)
    return version, train_step.hf_named_buckets(scratch, bucket_bytes)


def publish_to_engines(snapshot, engines, train_step, scratch: list, *, at_least: int,
                       cell_group: CellGroup | None = None) -> int:
    """core snapshot -> engines: read the newest snapshot ``>= at_least`` once (:func:`read_policy`)
    and load it into each rollout engine in turn (under the engines' HF names); returns the version
    now served."""
    version, named = read_policy(snapshot, train_step, scratch, at_least=at_least, cell_group=cell_group)
    for engine in engines:
        engine.update_weights_from_tensor(named, weight_version=str(version))
    return version
