"""Rank 0's controller: the imperative shell around the scheduler (DESIGN.md §2, §4).

It feeds :class:`gyre.scheduler.Scheduler` events and carries out its commands, in order:

=====================  =====================================================================
command                what the controller does
=====================  =====================================================================
``Dispatch``           pick the group's task (seeded round-robin over a shuffled task list),
                       register the group with the :class:`~gyre.buffer.TrajectoryBuffer`
``Launch``             register the execution with the proxy, pinned to ``engine-{dest}``;
                       run the harness in a worker thread (harness -> closure -> evaluator)
``Reroute``            move the executions' proxy routes to the destination engine
``ToTrain``            abort the cell's in-flight requests (the proxy retries them at their new
                       route), then tell the cell to switch (control message)
``ToRollout``          tell the cell to switch back, loading snapshot ``>= steps done``
``EnqueueGroup``       put the group's packed work items into the step's micro-step stream
``CloseJoinWindow``    finalize the stream and close the window; the core updates; checkpoint
``Publish``            every rollout cell loads the core's new snapshot into its engine
=====================  =====================================================================

Events come back from harness threads (launched / closed + outcome), from the cells'
acknowledgements (role changes, step statistics, publication) and from the stream coordinator
(micro-steps done).  Every event is stamped with the controller's clock when it is handled, so
the scheduler sees monotone time.  Training cells are told to join the current step's stream
once no publication is pending (so a core the scheduler releases at publication is never inside
a stream).

Everything the run writes lives under ``--run-dir``: ``records/`` (trajectory trees),
``executions/`` (workspaces, harness logs), ``evaluations/assessments.jsonl``,
``executions.jsonl`` (one line per closed execution: reward, status, step trained),
``metrics.jsonl``, ``checkpoints/``, ``timeline.json`` / ``timeline.png`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import queue
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gyre.scheduler import events as ev
from gyre.training import control as ctl

logger = logging.getLogger(__name__)

_STATUS = {"completed": ev.ExecutionStatus.COMPLETED, "timeout": ev.ExecutionStatus.TIMEOUT,
           "cancelled": ev.ExecutionStatus.CANCELLED}


def work_items(micro_steps: Sequence[Any]) -> list[list[Any]]:
    """Group micro-steps that share a split execution (union-find), keeping order.

    A GSPO sequence ratio needs every target of an execution (DESIGN.md §3.5), so the micro-steps
    of a split execution are processed by one cell as one work item.
    """
    parent = list(range(len(micro_steps)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, ms in enumerate(micro_steps):
        for e in np.flatnonzero(ms.split):
            eid = ms.execution_ids[e]
            if eid in first:
                parent[find(i)] = find(first[eid])
            else:
                first[eid] = i
    items: dict[int, list[Any]] = {}
    for i, ms in enumerate(micro_steps):
        items.setdefault(find(i), []).append(ms)
    return list(items.values())


@dataclass
class StepInfo:
    """What the controller knows about one optimizer step (metrics, summary)."""

    step: int
    group_ids: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    started: float | None = None
    closed: float | None = None
    core_joined: bool = False
    window: int = 0
    train: dict[str, float] = field(default_factory=dict)
    switches: list[float] = field(default_factory=list)


class Controller:
    """Rank 0's shell (module docstring).

    Args:
        args: the run's flags (``run_dir`` set).
        proxy: a started :class:`gyre.proxy.server.ProxyServer` with ``engine-{c}`` per cell.
        channel: the ``rank0`` :class:`~gyre.training.control.ControlChannel`.
        stream: the :class:`~gyre.training.streaming.MicroStepStream`.
        harness: the :class:`gyre.harness.Harness` every execution runs.
        tasks: the task list (:class:`gyre.tasks.TaskSpec`).
        snapshot_server: the core's snapshot (for steps without training work).
        sink: :class:`gyre.metrics.MetricsSink`.
        start_step: first step (``> 0`` when resuming); ``attempt``: resume count (id prefix).
        trained_before: execution ids trained before a resume (never trained again).
    """

    def __init__(self, args: argparse.Namespace, proxy, channel: ctl.ControlChannel, stream, harness,
                 tasks: Sequence[Any], snapshot_server, sink, *, start_step: int = 0, attempt: int = 0,
                 trained_before: Sequence[str] = (), rng_state: dict | None = None,
                 history: dict | None = None):
        from gyre.buffer.packing import MicroStepPacker, PackingConfig
        from gyre.buffer.trajectory_buffer import TrajectoryBuffer
        from gyre.evaluation.provenance import AssessmentLog
        from gyre.evaluation.rewards import RewardManager
        from gyre.scheduler.config import SchedulerConfig
        from gyre.scheduler.scheduler import Scheduler
        from gyre.trajectory.admission import AdmissionConfig

        self.args, self.proxy, self.channel, self.stream = args, proxy, channel, stream
        self.harness, self.tasks, self.snapshot_server, self.sink = harness, list(tasks), snapshot_server, sink
        self.run_dir = Path(args.run_dir)
        self.attempt = attempt
        self.sched = Scheduler(SchedulerConfig.from_args(args))
        if start_step:
            self.sched.resume_at(start_step)
        self.start_step = start_step
        self.buffer = TrajectoryBuffer.from_args(args)
        self.rewards = RewardManager.from_args(args, AssessmentLog(self.run_dir / "evaluations" / "assessments.jsonl"))
        self.admission = AdmissionConfig(j_max=args.max_trajectories_per_execution,
                                         role_priority=tuple(args.role_priority),
                                         include_undelivered=bool(args.train_undelivered))
        self.packer = MicroStepPacker(PackingConfig.from_args(args))
        self.rng = np.random.default_rng(args.seed)
        if rng_state is not None:
            self.rng.bit_generator.state = rng_state
        self.events: queue.Queue = queue.Queue()
        self.pool = ThreadPoolExecutor(max_workers=args.num_cells * args.rollout_concurrency_per_cell + 2,
                                       thread_name_prefix="gyre-execution")
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        # bookkeeping
        self.sid: dict[int, str] = {}                  # scheduler execution id -> string id
        self.eid_of: dict[str, int] = {}
        self.group_task: dict[int, Any] = {}
        self.group_items: dict[int, list[list[Any]]] = {}
        self.group_stats: dict[int, dict[str, Any]] = {}
        self.running: dict[str, Any] = {}             # string id -> RunningExecution (cancel)
        self.surplus: set[str] = set()
        self.in_flight: set[str] = set()
        self.coordinators: dict[int, Any] = {}
        self.steps: dict[int, StepInfo] = {}
        self.joined: dict[int, set[int]] = {}
        self.pending_publish: dict[int, set[int]] = {}
        self.pending_save: dict[int, dict] = {}
        self.trained: set[str] = set(trained_before)
        self.history = history or {"reward_mean_by_step": {}, "executions": 0}
        self.transitions: list[dict[str, Any]] = []
        self.overlap_s = 0.0
        self.rollout_busy_s = 0.0
        self.training_busy_s = 0.0
        self.executions_launched = 0
        self.executions_closed: dict[str, int] = {}
        self.failed: str | None = None
        self._exec_log = open(self.run_dir / "executions.jsonl", "a", encoding="utf-8")
        self._pending: collections.deque = collections.deque()
        self._handling = False

    # ------------------------------------------------------------------ time / events

    def now(self) -> float:
        return time.monotonic() - self.t0

    def handle(self, event: Any) -> None:
        """Feed one scheduler event (stamped now) and carry out its commands in order.

        Events raised while commands are carried out (e.g. a launch acknowledgement) queue
        behind the current command list, so commands always run in the scheduler's order.
        """
        self._pending.append(event)
        if self._handling:
            return
        self._handling = True
        try:
            while self._pending:
                e = dataclasses.replace(self._pending.popleft(), now=self.now())
                for cmd in self.sched.handle(e):
                    getattr(self, "_do_" + type(cmd).__name__)(cmd)
        finally:
            self._handling = False

    # ------------------------------------------------------------------ commands

    def _do_Dispatch(self, cmd: ev.Dispatch) -> None:
        n = len(self.tasks)
        epoch, pos = divmod(cmd.group_id, n)
        order = np.random.default_rng([self.args.seed, self.attempt, epoch]).permutation(n)
        task = self.tasks[int(order[pos])]
        self.group_task[cmd.group_id] = task
        sids = []
        for eid in cmd.execution_ids:
            sid = f"a{self.attempt}-g{cmd.group_id:04d}-e{eid:05d}"
            self.sid[eid], self.eid_of[sid] = sid, eid
            sids.append(sid)
        self.buffer.add_group(cmd.group_id, sids, cmd.policy_version)
        self.group_stats[cmd.group_id] = {"task": task.id, "version": cmd.policy_version}

    def _do_Launch(self, cmd: ev.Launch) -> None:
        from gyre.harness import ProxyEndpoint

        sid, task = self.sid[cmd.execution_id], self.group_task[cmd.group_id]
        ex = self.proxy.register_execution(sid, task_id=task.id, harness=self.harness.name,
                                           role_rules=self.harness.roles, engine_id=f"engine-{cmd.dest}")
        self.in_flight.add(sid)
        self.executions_launched += 1
        endpoint = ProxyEndpoint(self.proxy.url, ex.api_key)
        self.pool.submit(self._run_execution, cmd.execution_id, sid, task, endpoint, ex.api_key)
        self.handle(ev.ExecutionLaunched(cmd.execution_id))

    def _do_Reroute(self, cmd: ev.Reroute) -> None:
        for eid in cmd.execution_ids:
            sid = self.sid[eid]
            if sid in self.in_flight:
                self.proxy.set_route(sid, f"engine-{cmd.dest}")

    def _do_ToTrain(self, cmd: ev.ToTrain) -> None:
        aborted = self.proxy.abort_engine(f"engine-{cmd.cell}")
        self.sink.event("role_command", cell=cmd.cell, to="training", aborted=aborted, t=self.now())
        self.channel.send(f"cell{cmd.cell}", ctl.ToTrain(cmd.cell, self.sched.queue.stream.step))

    def _do_ToRollout(self, cmd: ev.ToRollout) -> None:
        self.sink.event("role_command", cell=cmd.cell, to="rollout", t=self.now())
        self.channel.send(f"cell{cmd.cell}", ctl.ToRollout(cmd.cell, self.sched.steps_done))

    def _coordinator(self, step: int):
        if step not in self.coordinators:
            self.coordinators[step] = self.stream.coordinator(step)
            self.steps.setdefault(step, StepInfo(step)).started = self.now()
        return self.coordinators[step]

    def _do_EnqueueGroup(self, cmd: ev.EnqueueGroup) -> None:
        from gyre.runtime.cell_worker import encode_work_item

        coord = self._coordinator(cmd.step)
        for item in self.group_items.pop(cmd.group_id, []):
            coord.add(encode_work_item(item))
        info = self.steps[cmd.step]
        info.group_ids.append(cmd.group_id)
        info.staleness.append(cmd.staleness)
        for sid in self.group_stats[cmd.group_id].get("designated", ()):
            self.trained.add(sid)
            self._log_execution_step(sid, cmd.step)

    def _do_CloseJoinWindow(self, cmd: ev.CloseJoinWindow) -> None:
        coord = self._coordinator(cmd.step)
        deadline = time.monotonic() + 60
        while not coord.ledger.drained() and time.monotonic() < deadline:
            coord.ledger.close()
            coord.poll()
            time.sleep(0.005)
        info = self.steps[cmd.step]
        info.window = coord.close()
        info.closed = self.now()
        if not info.core_joined:  # no training work in this step: the snapshot version moves on
            self.snapshot_server.header[0] = cmd.step + 1
            self._log_step(cmd.step)
        if self._should_save(cmd.step + 1):
            directory = self.run_dir / "checkpoints" / f"iter_{cmd.step + 1:07d}"
            self.pending_save[cmd.step + 1] = {"dir": str(directory), "state": self._controller_state(cmd.step + 1)}
            self.channel.send("cell0", ctl.SaveCheckpoint(str(directory)))

    def _do_Publish(self, cmd: ev.Publish) -> None:
        self.pending_publish[cmd.version] = set(range(self.args.num_cells))
        for c in range(self.args.num_cells):
            self.channel.send(f"cell{c}", ctl.Publish(cmd.version))

    # ------------------------------------------------------------------ executions (worker threads)

    def _run_execution(self, eid: int, sid: str, task, endpoint, api_key: str) -> None:
        from gyre.evaluation.rewards import ExecutionOutcome

        result = outcome = tree = None
        try:
            timeout = task.timeout_s or self.args.execution_timeout_s
            result = self.harness.run(task, self.run_dir, sid, endpoint, timeout_s=min(timeout, self.args.execution_timeout_s),
                                      model_calls=lambda: self.proxy.counters(sid)["calls"],
                                      on_launch=lambda r: self.running.__setitem__(sid, r))
            outcome = self.rewards.assess(result.closure(task, api_key), task.build_evaluator())
        except Exception as exc:  # a broken execution must not stop the run
            logger.exception("execution %s failed in the launcher", sid)
            outcome = ExecutionOutcome.placeholder(sid)
            self.events.put(("finished", eid, sid, None, outcome, None, f"{type(exc).__name__}: {exc}"))
            return
        finally:
            self.running.pop(sid, None)
        try:
            tree = self.proxy.tree(sid)
            self.proxy.close_execution(sid)
        except Exception as exc:
            logger.warning("execution %s: closing at the proxy failed: %s", sid, exc)
        self.events.put(("finished", eid, sid, result, outcome, tree, ""))

    def _on_finished(self, eid: int, sid: str, result, outcome, tree, error: str) -> None:
        from gyre.buffer.trajectory_buffer import GroupDropped, ReadyGroup

        self.in_flight.discard(sid)
        term = result.termination.value if result is not None else "crashed"
        status = ev.ExecutionStatus.SURPLUS if sid in self.surplus else _STATUS.get(term, ev.ExecutionStatus.FAILED)
        self.executions_closed[status.value] = self.executions_closed.get(status.value, 0) + 1
        self._exec_log.write(json.dumps({
            "event": "closed", "execution_id": sid, "group": self._group_of(sid), "task": self.group_stats.get(
                self._group_of(sid), {}).get("task"), "termination": term, "status": status.value,
            "outcome": outcome.status.value, "reward": outcome.reward, "duration_s": getattr(result, "duration_s", None),
            "calls": len(tree.records) if tree is not None else 0, "error": error or getattr(result, "error", ""),
            "t": self.now()}) + "\n")
        self._exec_log.flush()
        if self.sched.done:
            return
        gs = self.group_stats.get(self._group_of(sid))
        if gs is not None and outcome.reward is not None and status is not ev.ExecutionStatus.SURPLUS:
            gs.setdefault("closed_rewards", []).append(float(outcome.reward))
        self.handle(ev.ExecutionFinished(eid, status))
        for out in self.buffer.record_outcome(outcome, tree):
            if isinstance(out, ReadyGroup):
                self._group_ready(out)
            elif isinstance(out, GroupDropped):
                self._group_dropped(out)

    def _group_of(self, sid: str) -> int:
        return int(sid.split("-g")[1].split("-")[0])

    def _cancel(self, sids: Sequence[str]) -> None:
        for sid in sids:
            self.surplus.add(sid)
            running = self.running.get(sid)
            if running is not None:
                running.cancel()

    def _group_ready(self, rg) -> None:
        from gyre.buffer.trajectory_buffer import materialize_group

        self.buffer.take(rg.group_id)
        rows = materialize_group(rg, self.rng, self.admission)
        packed = self.packer.pack(rows) if rows else None
        items = work_items(packed.micro_steps) if packed is not None else []
        gid = int(rg.group_id)
        self.group_items[gid] = items
        self.group_stats[gid].update(
            designated=list(rg.execution_ids), rewards=list(rg.rewards), zero_std=rg.zero_std,
            trajectories=len(rows), targets=sum(int(m.num_targets) for it in items for m in it),
            timeouts=sum(o.termination.value == "timeout" for o in rg.outcomes),
            excluded=len(rg.excluded_execution_ids), micro_steps=sum(len(it) for it in items))
        self._cancel(rg.surplus_execution_ids)
        self.sink.event("group_ready", group=gid, rewards=list(rg.rewards), items=len(items), t=self.now())
        self.handle(ev.GroupReady(gid, len(items)))

    def _group_dropped(self, gd) -> None:
        gid = int(gd.group_id)
        logger.warning("group %d dropped (%s): it fills its slot with no micro-steps", gid, gd.reason.value)
        self.group_items[gid] = []
        gs = self.group_stats[gid]
        gs.update(dropped=gd.reason.value, designated=[], excluded=len(gd.excluded_execution_ids),
                  rewards=gs.get("closed_rewards", [])[: self.args.n_samples_per_prompt])
        self._cancel(gd.open_execution_ids)
        self.handle(ev.GroupReady(gid, 0))

    def _log_execution_step(self, sid: str, step: int) -> None:
        self._exec_log.write(json.dumps({"event": "trained", "execution_id": sid, "step": step}) + "\n")
        self._exec_log.flush()

    # ------------------------------------------------------------------ acknowledgements

    def _on_ack(self, ack: ctl.Ack) -> None:
        if not ack.ok and ack.command not in ("join",):
            raise RuntimeError(f"cell {ack.cell} failed to carry out {ack.command}: {ack.detail}")
        if ack.command == "to_train":
            self._transition(ack, "rollout->training")
            self.handle(ev.CellRoleChanged(ack.cell, ev.Role.TRAINING))
        elif ack.command == "to_rollout":
            self._transition(ack, "training->rollout")
            self.handle(ev.CellRoleChanged(ack.cell, ev.Role.ROLLOUT))
        elif ack.command == "publish":
            pending = self.pending_publish.get(int(ack.timings.get("version", -1)), None)
            for v, cells in list(self.pending_publish.items()):
                cells.discard(ack.cell)
                if not cells:
                    del self.pending_publish[v]
                    self.sink.event("publish", version=v, t=self.now())
                    self.handle(ev.WeightsPublished(v))
            del pending
        elif ack.command == "step":
            step = int(ack.timings["step"])
            if ack.cell == 0:
                self.steps[step].train = dict(ack.timings)
                self._log_step(step)
        elif ack.command == "save":
            self._finish_save(ack.detail)
        elif ack.command == "join":
            logger.info("cell %d skipped step %s: %s", ack.cell, ack.timings.get("step"), ack.detail)

    def _transition(self, ack: ctl.Ack, direction: str) -> None:
        rec = {"cell": ack.cell, "direction": direction, "latency_s": ack.timings.get("switch_s"), "t": self.now(),
               **{k: v for k, v in ack.timings.items() if k != "switch_s"}}
        self.transitions.append(rec)
        step = self.sched.queue.stream.step
        self.steps.setdefault(step, StepInfo(step)).switches.append(rec["latency_s"] or 0.0)
        self.sink.event("role_change", **rec)

    def _send_joins(self) -> None:
        """Training cells join the current step's stream (ascending), once no publication is pending."""
        s = self.sched
        step = s.queue.stream.step
        if s.done or s.awaiting_publish is not None or step >= self.args.train_steps:
            return
        sent = self.joined.setdefault(step, set())
        for c, state in enumerate(s.cell_states):
            if state is not ev.CellState.TRAINING:
                break
            if c not in sent:
                sent.add(c)
                self._coordinator(step)
                if c == 0:
                    self.steps[step].core_joined = True
                self.channel.send(f"cell{c}", ctl.JoinBatch(c, step, step))

    # ------------------------------------------------------------------ metrics, checkpoints

    def _log_step(self, step: int) -> None:
        info = self.steps[step]
        # the training reward: the N designated rewards of every group of the step, dropped ones included
        rewards = [r for g in info.group_ids for r in self.group_stats[g].get("rewards", [])]
        designated = sum(len(self.group_stats[g].get("designated", [])) for g in info.group_ids)
        m: dict[str, float] = {
            "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
            "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else float("nan"),
            "groups": len(info.group_ids),
            "groups_dropped": sum("dropped" in self.group_stats[g] for g in info.group_ids),
            "executions_trained": designated,
            "timeouts": sum(self.group_stats[g].get("timeouts", 0) for g in info.group_ids),
            "excluded_executions": sum(self.group_stats[g].get("excluded", 0) for g in info.group_ids),
            "trajectories_per_execution": (sum(self.group_stats[g].get("trajectories", 0) for g in info.group_ids)
                                           / designated) if designated else 0.0,
            "targets_per_execution": (sum(self.group_stats[g].get("targets", 0) for g in info.group_ids)
                                      / designated) if designated else 0.0,
            "staleness_mean": statistics.fmean(info.staleness) if info.staleness else 0.0,
            "waterlevel": self.sched.counters.waterlevel,
            "cells_training": self.sched.cells_in([ev.CellState.TRAINING]),
            "cells_rollout": self.sched.cells_in([ev.CellState.ROLLOUT]),
            "switch_latency_s": statistics.fmean(info.switches) if info.switches else float("nan"),
            "step_time_s": (info.closed or self.now()) - (info.started or 0.0),
            "window": info.window,
        }
        t = info.train
        for k in ("loss", "clip_fraction", "clip_fraction_high", "clip_fraction_low", "token_clip_fraction",
                  "rho_mean", "rho_max", "rho_capped_fraction", "train_inference_mismatch", "entropy", "grad_norm",
                  "row_tokens", "forward_tokens", "consume_s", "update_s"):
            if k in t:
                m[k] = t[k]
        if "row_tokens" in t and t.get("consume_s", 0) > 0:
            m["tokens_per_s"] = t["row_tokens"] / (t["consume_s"] + t.get("update_s", 0.0))
        self.history["reward_mean_by_step"][str(step)] = m["reward_mean"]
        self.sink.log(step + 1, m)
        logger.info("step %d: reward %.3f (n=%d), loss %s, grad norm %s, staleness %.2f, window %d", step,
                    m["reward_mean"], len(rewards), t.get("loss"), t.get("grad_norm"), m["staleness_mean"], info.window)

    def _should_save(self, iteration: int) -> bool:
        k = self.args.save_interval
        return iteration >= self.args.train_steps or (k > 0 and iteration % k == 0)

    def _controller_state(self, iteration: int) -> dict[str, Any]:
        return {"iteration": iteration, "attempt": self.attempt, "trained": sorted(self.trained),
                "rng_state": self.rng.bit_generator.state, "history": self.history,
                "training_backend": self.args.training_backend, "saved_at": time.time()}

    def _finish_save(self, directory: str) -> None:
        for it, pending in list(self.pending_save.items()):
            if pending["dir"] == directory:
                (Path(directory) / "controller.json").write_text(json.dumps(pending["state"]))
                tracker = Path(directory).parent / "latest_checkpointed_iteration.txt"
                tmp = tracker.with_suffix(".tmp")
                tmp.write_text(str(it))
                tmp.replace(tracker)
                self.sink.event("checkpoint", iteration=it, dir=directory, t=self.now())
                del self.pending_save[it]

    # ------------------------------------------------------------------ loop

    def _account(self, dt: float) -> None:
        training = self.sched.cells_in([ev.CellState.TRAINING]) > 0
        rolling = self.sched.counters.running > 0
        self.overlap_s += dt if (training and rolling) else 0.0
        self.training_busy_s += dt if training else 0.0
        self.rollout_busy_s += dt if rolling else 0.0

    def run(self, progress=None) -> dict[str, Any]:
        """Drive the run to ``--train-steps`` steps; return the summary (also ``summary.json``)."""
        self.handle(ev.Start())
        last = self.now()
        last_tick = last
        while not (self.sched.done and not self.pending_save):
            for msg in iter(self.channel.poll, None):
                if isinstance(msg, ctl.Ack):
                    self._on_ack(msg)
            step = self.sched.queue.stream.step
            coord = self.coordinators.get(step)
            if coord is not None and not self.sched.done:
                for m, cell in coord.poll():
                    self.handle(ev.MicroStepDone(cell, step))
            try:
                item = self.events.get(timeout=0.01)
            except queue.Empty:
                item = None
            if item is not None and item[0] == "finished":
                self._on_finished(*item[1:])
            if self.now() - last_tick > 1.0:
                last_tick = self.now()
                self.handle(ev.Tick(0.0))
            self._send_joins()
            now = self.now()
            self._account(now - last)
            last = now
            if progress is not None:
                progress(self)
        return self.shutdown()

    def shutdown(self) -> dict[str, Any]:
        """End running harnesses, wait for their records, stop the cells, write the summary."""
        for sid in list(self.running):
            self._cancel([sid])
        self.pool.shutdown(wait=True)
        while not self.events.empty():
            item = self.events.get()
            if item[0] == "finished":
                self._on_finished(*item[1:])
        for c in range(self.args.num_cells):
            self.channel.send(f"cell{c}", ctl.Shutdown("run finished"))
        acked: set[int] = set()
        deadline = time.monotonic() + 120
        while len(acked) < self.args.num_cells and time.monotonic() < deadline:
            msg = self.channel.poll()
            if msg is None:
                time.sleep(0.01)
            elif isinstance(msg, ctl.Ack) and msg.command == "shutdown":
                acked.add(msg.cell)
        self._exec_log.close()
        return self.summary()

    def timeline(self) -> list[list[tuple[float, float, str]]]:
        end = self.now()
        return [[(a, b, s.value) for a, b, s in cell] for cell in self.sched.role_timeline(end)]

    def summary(self) -> dict[str, Any]:
        to_t = [t["latency_s"] for t in self.transitions if t["direction"] == "rollout->training"]
        to_r = [t["latency_s"] for t in self.transitions if t["direction"] == "training->rollout"]
        trained = [s for s in self.steps.values() if s.closed is not None]
        timeline = self.timeline()
        (self.run_dir / "timeline.json").write_text(json.dumps({"timeline": timeline, "placement": self.args.placement}))
        summary = {
            "placement": self.args.placement,
            "steps": self.sched.steps_done,
            "first_step": self.start_step,
            "executions": self.executions_launched,
            "executions_closed": self.executions_closed,
            "executions_trained": len(self.trained),
            "reward_mean_by_step": self.history["reward_mean_by_step"],
            "role_changes": len(self.transitions),
            "switch_latency_s": {"rollout_to_training": to_t, "training_to_rollout": to_r,
                                 "mean": statistics.fmean(to_t + to_r) if to_t + to_r else None},
            "train_rollout_overlap_s": round(self.overlap_s, 3),
            "time_per_phase_s": {
                "rollout": round(self.rollout_busy_s, 3),          # some execution running
                "training": round(self.training_busy_s, 3),        # some cell in the training role
                "overlap": round(self.overlap_s, 3),
                "micro_steps": round(sum(s.train.get("consume_s", 0.0) for s in trained), 3),
                "update": round(sum(s.train.get("update_s", 0.0) for s in trained), 3),
                "switching": round(sum(t["latency_s"] or 0.0 for t in self.transitions), 3)},
            "trajectories_admitted": sum(self.group_stats[g].get("trajectories", 0) for s in trained for g in s.group_ids),
            "tokens_trained": sum(s.train.get("row_tokens", 0.0) for s in trained),
            "staleness_mean": self.sched.mean_staleness,
            "wall_s": round(time.time() - self.wall0, 3),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
