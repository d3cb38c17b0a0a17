"""Rank 0's controller: the event pump around the scheduler.

Scheduler commands are carried out in order through :attr:`Controller.commands`, cell replies
through :attr:`Controller.replies`; each arrow's work is a function of :mod:`gyre.runtime.pipeline`,
counting :mod:`~gyre.runtime.accounting`, checkpoints :mod:`~gyre.runtime.checkpointing`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from gyre.buffer.packing import MicroStepPacker
from gyre.buffer.trajectory_buffer import GroupDropped, ReadyGroup, TrajectoryBuffer
from gyre.buffer.work_items import encode_work_item
from gyre.evaluation.provenance import AssessmentLog
from gyre.evaluation.rewards import RewardManager
from gyre.harness import ProxyEndpoint
from gyre.runtime import pipeline
from gyre.runtime.accounting import GroupStats, RunAccounting, format_step, write_summary
from gyre.runtime.carry_over import read_carry_over
from gyre.runtime.checkpointing import CheckpointWriter, ControllerState, should_save
from gyre.runtime.config import ControllerConfig
from gyre.runtime.executions import ExecutionTable, task_for_group
from gyre.runtime.pipeline import FinishedExecution
from gyre.scheduler import events as ev
from gyre.scheduler.scheduler import Scheduler
from gyre.training import control as ctl

logger = logging.getLogger(__name__)


class Controller:
    """Rank 0's shell: a started proxy with ``engine-{c}`` per cell and the engines of ``standalone``
    (:class:`gyre.runtime.standalone.StandaloneRoutes`), the ``rank0`` control channel, the micro-step
    stream, the harness and tasks, the core's snapshot server (its version moves on for steps without
    training work), a metrics sink; ``resume``: the :class:`ControllerState` of the checkpoint resumed from."""

    def __init__(self, config: ControllerConfig, proxy, channel: ctl.ControlChannel, stream, harness,
                 tasks: Sequence[Any], snapshot_server, sink, *, resume: ControllerState | None = None, standalone):
        self.cfg, self.proxy, self.channel, self.stream, self.run_dir = config, proxy, channel, stream, config.run_dir
        self.standalone = standalone  # route -> engine id; the pool's publication
        self.harness, self.tasks, self.snapshot_server, self.sink = harness, list(tasks), snapshot_server, sink
        resume = resume or ControllerState()
        self.attempt, self.start_step = resume.attempt + 1, resume.iteration
        self.sched = Scheduler(config.scheduler)
        self.sched.resume_at(self.start_step)  # 0: a new run
        self.buffer = TrajectoryBuffer(config.n_samples_per_prompt, config.advantages)
        self.rewards = RewardManager(config.retry, AssessmentLog(self.run_dir / "evaluations" / "assessments.jsonl"))
        self.packer = MicroStepPacker(config.packing)
        self.rng = resume.rng(config.seed)
        self.acct = RunAccounting(resume.history, before=resume.summary, before_timeline=resume.timeline,
                                  before_elapsed_s=resume.elapsed_s)
        self.checkpoints = CheckpointWriter(self.run_dir, keep=config.keep_checkpoints)
        self.finished: queue.Queue[FinishedExecution] = queue.Queue()
        self.pool = ThreadPoolExecutor(max_workers=config.max_executions_in_flight + 2,
                                       thread_name_prefix="gyre-execution")
        self.t0, self.wall0 = time.monotonic(), time.time()
        carry = read_carry_over(self.run_dir, set(resume.trained)) if self.attempt else None
        self.executions = ExecutionTable(self.run_dir / "executions.jsonl", self.attempt, resume.trained, carry)
        self.group_items: dict[int, list[list[Any]]] = {}       # ready group -> its work items
        self.coordinators: dict[int, Any] = {}                  # step -> StepCoordinator
        self.joined: dict[int, set[int]] = {}                   # step -> cells told to join
        self.pending_publish: dict[int, set[int]] = {}          # version -> cells (or STANDALONE) yet to load it
        self._pending, self._handling = collections.deque(), False
        self.commands = {ev.Dispatch: self.dispatch, ev.Launch: self.launch, ev.Reroute: self.reroute,
                         ev.ToTrain: self.to_train, ev.ToRollout: self.to_rollout, ev.EnqueueGroup: self.enqueue_group,
                         ev.CloseJoinWindow: self.close_join_window, ev.Publish: self.publish}
        self.replies = {ctl.Switched: self.on_switched, ctl.StepDone: self.on_step_done,
                        ctl.JoinSkipped: self.on_step_done, ctl.Published: self.on_published,
                        ctl.Saved: self.on_saved, ctl.Failed: self.on_failed, ctl.SwitchFailed: self.on_switch_failed}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def handle(self, event: Any) -> None:
        """Feed one event (stamped now); carry out its commands in order (later events queue behind)."""
        self._pending.append(event)
        if self._handling:
            return
        self._handling = True
        try:
            while self._pending:
                e = dataclasses.replace(self._pending.popleft(), now=self.now())
                for cmd in self.sched.handle(e):
                    self.commands[type(cmd)](cmd)
        finally:
            self._handling = False

    # ------------------------------------------------------------------ scheduler commands

    def dispatch(self, cmd: ev.Dispatch) -> None:
        """Pick the group's task (a carried-over group's after a resume) and register the group."""
        carried = self.executions.next_carried({t.id for t in self.tasks})
        task = next(t for t in self.tasks if t.id == carried.task_id) if carried else \
            task_for_group(self.tasks, cmd.group_id, seed=self.cfg.seed, attempt=self.attempt)
        sids = self.executions.add_group(cmd.group_id, cmd.execution_ids, task, carried)
        self.buffer.add_group(cmd.group_id, sids, cmd.policy_version)
        self.acct.groups[cmd.group_id] = GroupStats(task.id, cmd.policy_version)

    def launch(self, cmd: ev.Launch) -> None:
        """Register the execution with the proxy (pinned to its route's engine) and run it in a harness thread."""
        xs = self.executions
        key, task, sid = xs.keys[cmd.execution_id], xs.group_task[cmd.group_id], xs.sid(cmd.execution_id)
        if (ce := xs.adopted.get(cmd.execution_id)) is not None:  # it finished before the run stopped
            self.handle(ev.ExecutionLaunched(cmd.execution_id))
            return self.finished.put(FinishedExecution(key, None, ce.outcome, ce.tree, execution_id=sid))
        ex = self.proxy.register_execution(sid, engine_id=self.standalone.engine_for(sid, cmd.dest), task_id=task.id,
                                           harness=self.harness.name, role_rules=self.harness.roles)
        xs.launching(sid, key, task.id, self.now())
        timeout = min(task.timeout_s or self.cfg.execution_timeout_s, self.cfg.execution_timeout_s)
        self.pool.submit(lambda: self.finished.put(pipeline.run_execution(
            key, task, self.harness, self.proxy, self.rewards, ProxyEndpoint(self.proxy.url_for(sid), ex.api_key),
            run_dir=self.run_dir, timeout_s=timeout, on_launch=lambda r: xs.running.__setitem__(sid, r),
            evaluators=self.cfg.evaluation)))
        self.handle(ev.ExecutionLaunched(cmd.execution_id))

    def reroute(self, cmd: ev.Reroute) -> None:
        for sid in map(self.executions.sid, cmd.execution_ids):
            if sid in self.executions.in_flight:
                self.proxy.set_route(sid, self.standalone.engine_for(sid, cmd.dest))

    def to_train(self, cmd: ev.ToTrain) -> None:
        """Abort the cell's in-flight requests (the proxy retries them at their new route), then switch it."""
        aborted = self.proxy.abort_engine(f"engine-{cmd.cell}")
        self.sink.event("role_command", cell=cmd.cell, to="training", aborted=aborted, t=self.now())
        self.channel.send(f"cell{cmd.cell}", ctl.SwitchToTraining(cmd.cell, self.sched.queue.stream.step))

    def to_rollout(self, cmd: ev.ToRollout) -> None:
        self.sink.event("role_command", cell=cmd.cell, to="rollout", t=self.now())
        self.channel.send(f"cell{cmd.cell}", ctl.SwitchToRollout(cmd.cell, self.sched.steps_done))

    def _coordinator(self, step: int):
        if step not in self.coordinators:
            self.coordinators[step] = self.stream.coordinator(step)
            self.acct.step(step).started = self.now()
        return self.coordinators[step]

    def enqueue_group(self, cmd: ev.EnqueueGroup) -> None:
        """Put the group's work items into the step's stream; its designated executions are trained."""
        coord = self._coordinator(cmd.step)
        for item in self.group_items.pop(cmd.group_id, []):
            coord.add(encode_work_item(item))
        self.acct.enqueued(cmd.step, cmd.group_id, cmd.staleness)
        self.executions.mark_trained(self.acct.groups[cmd.group_id].designated, cmd.step + 1)

    def close_join_window(self, cmd: ev.CloseJoinWindow) -> None:
        """Finalize the drained stream and close its window (the cells reduce; the core updates)."""
        info = self.acct.step(cmd.step)
        info.window = self._coordinator(cmd.step).close(timeout_s=60)
        info.closed = self.now()
        if not info.core_joined:  # no training work in this step: the snapshot version moves on
            self.snapshot_server.restamp(cmd.step + 1)
            self._log_step(cmd.step)
        it = cmd.step + 1
        if should_save(it, save_interval=self.cfg.save_interval, train_steps=self.cfg.train_steps):
            state = ControllerState(it, self.attempt, sorted(self.executions.trained), self.rng.bit_generator.state,
                                    self.acct.history, self.cfg.training_backend, train_steps=self.cfg.train_steps,
                                    timeline=self.acct.role_timeline(self.sched, self.now()),
                                    elapsed_s=self.acct.before_elapsed_s + self.now())
            self.channel.send("cell0", ctl.SaveCheckpoint(self.checkpoints.request(it, state)))

    def publish(self, cmd: ev.Publish) -> None:
        self.pending_publish[cmd.version] = set(range(self.cfg.num_cells)) | self.standalone.publish(cmd.version)
        for c in range(self.cfg.num_cells):
            self.channel.send(f"cell{c}", ctl.LoadWeights(cmd.version))

    def on_finished(self, fin: FinishedExecution) -> None:
        """Log the execution, tell the scheduler, hand its outcome and tree to the buffer."""
        group = self.acct.groups.get(fin.key.group)
        status = self.executions.closed(fin, group.task if group else None, self.now())
        self.standalone.release(fin.execution_id)
        if self.sched.done:
            return
        if group is not None:
            group.closed(fin.outcome.reward, surplus=status is ev.ExecutionStatus.SURPLUS)
        self.handle(ev.ExecutionFinished(fin.key.index, status))
        for out in self.buffer.record_outcome(fin.outcome, fin.tree):
            if isinstance(out, ReadyGroup):
                group = pipeline.assemble_group(self.buffer, out, self.rng, self.cfg.admission, self.packer)
                self.group_items[group.group_id] = group.items
                self.acct.groups[group.group_id].ready(out, group)
                self.executions.cancel(out.surplus_execution_ids)
                self.sink.event("group_ready", group=group.group_id, rewards=list(out.rewards),
                                items=len(group.items), t=self.now())
                self.handle(ev.GroupReady(group.group_id, len(group.items)))
            elif isinstance(out, GroupDropped):
                gid = int(out.group_id)
                logger.warning("group %d dropped (%s): it fills its slot with no micro-steps", gid, out.reason.value)
                self.group_items[gid] = []
                self.acct.groups[gid].drop(out, self.cfg.n_samples_per_prompt)
                self.executions.cancel(out.open_execution_ids)
                self.handle(ev.GroupReady(gid, 0))

    def on_failed(self, r: ctl.Failed) -> None:  # a cell's failure ends the run
        raise RuntimeError(f"cell {r.cell} failed to carry out {r.command}: {r.detail}")

    def on_switch_failed(self, r: ctl.SwitchFailed) -> None:
        """Report it; the cell keeps its role and the scheduler may command the switch again."""
        logger.warning("cell %d could not switch to %s and keeps its role: %s", r.cell, r.role, r.detail)
        self.sink.event("switch_failed", cell=r.cell, to=r.role, detail=r.detail, t=self.now())
        self.handle(ev.SwitchFailed(r.cell, ev.Role(r.role)))
        if self.sched.stalled:
            raise RuntimeError(f"{self.sched.stalled}: {r.detail}")

    def on_switched(self, r: ctl.Switched) -> None:
        rec = self.acct.transition(r, self.sched.queue.stream.step, self.now())
        self.sink.event("role_change", **rec)
        self.handle(ev.CellRoleChanged(r.cell, ev.Role.TRAINING if r.role == "training" else ev.Role.ROLLOUT))

    def on_published(self, r: ctl.Published) -> None:
        self.acct.published(r)
        for v, cells in list(self.pending_publish.items()):
            cells.discard(r.cell)
            if not cells:
                del self.pending_publish[v]
                self.sink.event("publish", version=v, t=self.now())
                self.handle(ev.WeightsPublished(v))

    def on_step_done(self, r: ctl.StepDone | ctl.JoinSkipped) -> None:
        """The core's step statistics; a core that skipped the step (it had no work) sends none."""
        if isinstance(r, ctl.JoinSkipped):
            logger.info("cell %d skipped step %d: %s", r.cell, r.step + 1, r.reason)
        if r.cell == 0:
            self.acct.step(r.step).train = r if isinstance(r, ctl.StepDone) else None
            self._log_step(r.step)
            self.checkpoints.refresh_summary(r.step + 1, {**self._summary(), "steps": r.step + 1})  # saved next

    def on_saved(self, r: ctl.Saved) -> None:
        for it in self.checkpoints.complete(r.directory):
            self.sink.event("checkpoint", iteration=it, dir=r.directory, t=self.now())

    def _send_joins(self) -> None:
        """The scheduler's joining cells join the current step's stream (ascending), once each."""
        step = self.sched.queue.stream.step
        sent = self.joined.setdefault(step, set())
        for c in self.sched.joining_cells():
            if c not in sent:
                sent.add(c)
                self._coordinator(step)
                if c == 0:
                    self.acct.step(step).core_joined = True
                self.channel.send(f"cell{c}", ctl.JoinStep(c, step, step))

    def _log_step(self, step: int) -> None:
        m = self.acct.step_metrics(step, self.sched, now=self.now())
        if note := self.acct.take_no_signal_note():
            logger.warning(note)
        self.sink.log(step + 1, m)
        logger.info(format_step(step + 1, m))

    def run(self, progress=None) -> dict[str, Any]:
        """Drive the run to ``--train-steps`` steps; return the summary (also ``summary.json``)."""
        self.handle(ev.Start())
        last = last_tick = self.now()
        while not (self.sched.done and not self.checkpoints.pending):
            for msg in iter(self.channel.poll, None):
                self.replies[type(msg)](msg)
            step = self.sched.queue.stream.step
            if (coord := self.coordinators.get(step)) is not None and not self.sched.done:
                for _, cell in coord.poll():
                    self.handle(ev.MicroStepDone(cell, step))
            try:
                self.on_finished(self.finished.get(timeout=0.01))
            except queue.Empty:
                pass
            if self.now() - last_tick > 1.0:
                last_tick = self.now()
                self.handle(ev.Tick(0.0))
            self._send_joins()
            now = self.now()
            self.acct.busy(now - last, training=self.sched.cells_in([ev.CellState.TRAINING]) > 0,
                           rolling=self.sched.counters.running > 0)
            last = now
            if progress is not None:
                progress(self)
        return self.shutdown()

    def shutdown(self) -> dict[str, Any]:
        """End running harnesses, wait for their records, stop the cells, write the summary."""
        self.executions.cancel(list(self.executions.running))
        self.pool.shutdown(wait=True)
        while not self.finished.empty():
            self.on_finished(self.finished.get())
        for c in range(self.cfg.num_cells):
            self.channel.send(f"cell{c}", ctl.Shutdown("run finished"))
        self.channel.collect(ctl.Stopped, self.cfg.num_cells, timeout_s=120)
        self.executions.close()
        summary = self._summary()
        write_summary(self.run_dir, summary, self.acct.role_timeline(self.sched, self.now()), self.cfg.placement)
        return summary

    def _summary(self) -> dict[str, Any]:
        return self.acct.summary(self.sched, self.executions, placement=self.cfg.placement,
                                 first_step=self.start_step, wall_s=time.time() - self.wall0)
