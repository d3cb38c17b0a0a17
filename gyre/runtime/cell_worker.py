"""One cell's loop in the main job: every rank runs it.

A cell owns two copies of the policy: its **engine** (an embedded engine speaking SGLang's native
HTTP API, in the leader's process, routed by the proxy on rank 0 as ``engine-{cell}``) serving
rollouts in the rollout role, and its **training replica** (a :class:`gyre.training.step.TrainStep`,
Megatron or HF; one shard per rank of the cell), offloaded while the cell serves rollouts.  The
cell's leader carries out the typed commands of :mod:`gyre.training.control` through
:attr:`CellWorker.handlers`, in order, and replies to ``rank0``; what needs the cell's other ranks
it orders them (:mod:`gyre.runtime.cell_group`), and they run it in :meth:`CellWorker.follow`.  A
step's work is :func:`gyre.runtime.pipeline.train_on_stream`, a publication
:func:`gyre.runtime.pipeline.policy_buckets` pushed with :func:`gyre.rollout.weights.push_weight_buckets`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Sequence

import torch

from gyre.rollout.weights import push_weight_buckets
from gyre.runtime import pipeline
from gyre.runtime.cell_group import CellGroup
from gyre.runtime.config import CellConfig
from gyre.training import control as ctl
from gyre.training.cell import CellRoles, SwitchFailedError, TrainingState
from gyre.training.streaming import MicroStepStream
from gyre.training.weight_snapshot import (MooncakeSnapshotClient, MooncakeSnapshotServer, SnapshotError,
                                           copy_flat_to_params)

logger = logging.getLogger(__name__)


class Snapshot:
    """Read access to the core's weight snapshot: local on the core, Mooncake reads elsewhere."""

    def __init__(self, server: MooncakeSnapshotServer | None = None, client: MooncakeSnapshotClient | None = None):
        self.server, self.client = server, client

    def version(self) -> int:
        if self.server is not None:
            return self.server.version
        return self.client.peek_version()

    def read(self, tensors: Sequence[torch.Tensor], version: int) -> None:
        if self.server is not None:
            copy_flat_to_params(self.server.payload, tensors)
        else:
            self.client.pull(tensors, expected_version=version)

    def pull(self, tensors: Sequence[torch.Tensor], *, exact: int | None = None, at_least: int | None = None,
             timeout_s: float = 300.0) -> int | None:
        """Read version ``exact`` (``None`` once the snapshot moved past it) or the newest version
        ``>= at_least`` into ``tensors``; waits while the core has not written it yet.

        Raises:
            TimeoutError: the version did not appear within ``timeout_s``.
        """
        want = exact if exact is not None else at_least
        deadline = time.monotonic() + timeout_s
        while True:
            v = self.version()
            if exact is not None and v > exact:
                return None
            if v >= want:
                try:
                    self.read(tensors, v)
                    return v
                except SnapshotError as exc:  # torn read: the core wrote meanwhile
                    logger.debug("snapshot read retried: %s", exc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight snapshot version {want} did not appear within {timeout_s}s (at {v})")
            time.sleep(0.01)


class CellWorker:
    """The control loop of cell ``cell`` (module docstring).

    Args:
        config: :class:`CellConfig` of the run.
        cell: this cell's index.
        store: the ``torch.distributed`` store shared by every rank.
        groups: :class:`gyre.training.prefix_groups.PrefixGroups`.
        model_dir: HF checkpoint the engine starts from.
        train_step: this cell's training replica (built from the same checkpoint).
        snapshot: access to the core's snapshot (set later on every rank, once the core's exists).
        start_version: the weight version both copies hold (the step resumed from).
        initial_role: ``"rollout"`` or ``"training"`` (async placement's fixed trainers).
        host: address the cell's engine binds (:func:`gyre.network.node_address`).
        cell_group: this rank's :class:`gyre.runtime.cell_group.CellGroup` (default: a cell of one
            rank).  Only the leader has an engine, a control inbox and :attr:`roles`.
        device: where the leader's embedded engine runs its model (``cuda:i`` with ``--backend gpu``).
        engine: the leader's engine, not started (anything with ``start()``, ``url``, ``stop()``, e.g.
            :class:`gyre.rollout.sglang_driver.engine.SGLangEngine`); default: an embedded engine.
    """

    def __init__(self, config: CellConfig, cell: int, store, groups, model_dir: str, train_step,
                 snapshot: Snapshot | None = None, *, start_version: int = 0, initial_role: str = "rollout",
                 host: str = "127.0.0.1", cell_group: CellGroup | None = None, device: str = "cpu",
                 engine=None):
        from gyre.rollout.embedded.config import EngineConfig
        from gyre.rollout.embedded.server import EngineServer

        self.cfg, self.cell, self.groups, self.snapshot = config, cell, groups, snapshot
        self.cg = cell_group if cell_group is not None else CellGroup.alone(cell)
        self.stream = MicroStepStream(store, config.num_cells, lease_s=config.lease_s)
        self.train_step = train_step
        self.params = train_step.params
        self.shapes = [(p.shape, p.dtype) for p in self.params]
        self.model_dir = str(model_dir)
        self.training = TrainingState(self.params, train_step.optimizer,
                                      getattr(train_step, "grad_buffers", lambda: [])())
        self.orders = {"restore": self.training.restore, "offload": self._offload_in_step,
                       "policy": self._drain_policy, "train": self._train, "save": self.save}
        self.engine = self.client = self.roles = None
        self.engine_version = start_version
        if not self.cg.is_leader:
            if initial_role != "training":
                self.training.offload()
            return
        self.channel = ctl.ControlChannel(store, f"cell{cell}")
        if initial_role != "training":
            self.training.offload()  # first: the engine sizes its memory with the trainer's gone
        if engine is None:
            engine = EngineServer(EngineConfig(model_dir=str(model_dir),
                                               max_running_requests=config.max_running_requests,
                                               random_seed=config.seed + 1000 * cell,
                                               weight_version=str(start_version), device=device), host=host)
        self.engine = engine.start()
        self.client = self.engine.client(timeout=600.0)
        self.roles = CellRoles(cell, f"engine-{cell}", self.client, None, self.training)
        if initial_role == "training":  # paused and idle first: SGLang's release asserts idleness
            self.roles.release_engine()
            self.roles.role = "training"
        self.handlers = {ctl.SwitchToTraining: self.switch_to_training, ctl.SwitchToRollout: self.switch_to_rollout,
                         ctl.JoinStep: self.join_step, ctl.LoadWeights: self.load_weights,
                         ctl.SaveCheckpoint: self.save_checkpoint}

    def _reply(self, msg: ctl.ControlMessage) -> None:
        self.channel.send("rank0", msg)

    def _scratch(self) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in self.shapes]

    # ------------------------------------------------------------------ orders (every rank of the cell)

    def _do(self, name: str, *args):
        """Leader: order the cell's other ranks to run ``name(*args)`` and run it here too."""
        self.cg.order(name, *args)
        return self.orders[name](*args)

    def _offload_in_step(self) -> None:
        """Another rank: offload, then tell the leader (its engine resumes after)."""
        self.training.offload()
        self.cg.agree_all(True)

    def _policy(self, at_least: int):
        """``(version, buckets)`` of the core's snapshot ``>= at_least`` (buckets on the leader)."""
        return pipeline.policy_buckets(self.snapshot, self.train_step, self._scratch(), at_least=at_least,
                                       bucket_bytes=self.cfg.update_weight_buffer_size, cell_group=self.cg)

    def _drain_policy(self, at_least: int) -> None:
        """Another rank's part of a publication: its shards go into the leader's buckets."""
        for _ in self._policy(at_least)[1]:
            pass

    def _train(self, step: int):
        return pipeline.train_on_stream(step, self.cell, self.train_step, self.stream, self.groups, self.snapshot,
                                        cell_group=self.cg)

    # ------------------------------------------------------------------ commands (the leader)

    def switch_to_training(self, msg: ctl.SwitchToTraining) -> None:
        """Release the engine's memory, restore the training state on every rank of the cell (the
        proxy on rank 0 already moved this engine's executions and aborted its requests); a switch
        that fails and rolls back is reported as :class:`~gyre.training.control.SwitchFailed`."""
        try:
            tr = self.roles.to_train(None)
        except SwitchFailedError as exc:
            return self._reply(ctl.SwitchFailed(self.cell, "training", str(exc)))
        self.cg.order("restore")
        self._reply(ctl.Switched(self.cell, "training", tr.latency_s, dict(tr.phases_s)))

    def switch_to_rollout(self, msg: ctl.SwitchToRollout) -> None:
        """Offload the training state on the cell's other ranks, then :meth:`CellRoles.to_rollout
        <gyre.training.cell.CellRoles.to_rollout>` on the leader: the engine's weights come back and
        load snapshot ``>= msg.version`` in buckets gathered from every rank's shard, the leader's
        training state is offloaded, the KV cache comes back (a switch that fails and rolls back:
        :class:`~gyre.training.control.SwitchFailed`)."""
        self.cg.order("offload")
        self.cg.agree_all(True)  # the cell's other ranks let go of their memory before the engine resumes
        self.cg.order("policy", msg.version)
        v, buckets = self._policy(msg.version)
        try:
            tr = self.roles.to_rollout(str(v), buckets)
        except SwitchFailedError as exc:
            for _ in buckets:  # the other ranks are still gathering
                pass
            self.cg.order("restore")
            return self._reply(ctl.SwitchFailed(self.cell, "rollout", str(exc)))
        self.engine_version = v
        self._reply(ctl.Switched(self.cell, "rollout", tr.latency_s, dict(tr.phases_s), version=v))

    def load_weights(self, msg: ctl.LoadWeights) -> None:
        """A rollout cell's engine loads snapshot ``>= msg.version`` in buckets (nothing to do otherwise)."""
        if self.roles.role != "rollout" or self.engine_version >= msg.version:
            self._reply(ctl.Published(self.cell, self.engine_version, 0.0))
            return
        t0 = time.perf_counter()
        self.cg.order("policy", msg.version)
        v, buckets = self._policy(msg.version)
        push_weight_buckets(self.client, buckets, str(v))
        self.engine_version = v
        self._reply(ctl.Published(self.cell, self.engine_version, time.perf_counter() - t0))

    def join_step(self, msg: ctl.JoinStep) -> None:
        self._reply(self._do("train", msg.step))

    # ------------------------------------------------------------------ loop

    def run(self, idle_timeout_s: float = 6 * 3600) -> None:
        """Leader: carry out control messages until ``Shutdown``; other ranks: :meth:`follow`."""
        if not self.cg.is_leader:
            return self.follow(idle_timeout_s)
        try:
            while True:
                msg = self.channel.recv(timeout_s=idle_timeout_s)
                if isinstance(msg, ctl.Shutdown):
                    self.cg.order("stop")
                    self._reply(ctl.Stopped(self.cell))
                    return
                try:
                    self.handlers[type(msg)](msg)
                except Exception as exc:
                    logger.exception("cell %d: %s failed", self.cell, msg.kind)
                    self._reply(ctl.Failed(self.cell, msg.kind, f"{type(exc).__name__}: {exc}"))
                    raise
        finally:
            self.engine.stop()

    def follow(self, idle_timeout_s: float = 6 * 3600) -> None:
        """A rank other than the leader: run the leader's orders until ``stop``."""
        while True:
            name, args = self.cg.next_order(timeout_s=idle_timeout_s)
            if name == "stop":
                return
            self.orders[name](*args)

    def save_checkpoint(self, msg: ctl.SaveCheckpoint) -> None:
        t0 = time.perf_counter()
        directory = self._do("save", msg.directory)
        self._reply(ctl.Saved(self.cell, directory, time.perf_counter() - t0))

    def save(self, directory: str) -> str:
        """Core only, every rank of the cell: write the policy (HF format, servable) and this
        shard's optimizer state to ``directory``.

        Layout: ``directory/hf/`` (HF weights + ``config.json`` + the tokenizer files, servable and
        loadable by either backend; the shards are gathered), the optimizer's ``state_dict`` (torch
        AdamW, or Megatron's optimizer) in :func:`gyre.runtime.checkpointing.optimizer_file` of this
        shard, and ``parallel_layout.json`` (the cell's TP and PP sizes, which a resumed run must
        match).  Returns ``directory``.
        """
        import shutil
        from pathlib import Path

        from gyre.runtime.checkpointing import optimizer_file

        out = Path(directory)
        (out / "hf").mkdir(parents=True, exist_ok=True)
        resident = self.training.resident
        self.training.restore()
        try:
            self.train_step.save_hf(out / "hf")
            torch.save(self.train_step.optimizer.state_dict(), optimizer_file(out, self.cg.layout.shard))
        finally:
            if not resident:
                self.training.offload()
        if not self.cg.is_leader:
            return str(out)
        (out / "parallel_layout.json").write_text(json.dumps({
            "tensor_model_parallel_size": self.cfg.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.cfg.pipeline_model_parallel_size}))
        for f in Path(self.model_dir).iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "config.json" \
                    and not (out / "hf" / f.name).exists():
                shutil.copy2(f, out / "hf" / f.name)
        return str(out)

