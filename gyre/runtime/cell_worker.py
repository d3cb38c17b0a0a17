"""One cell's loop in the main job: every rank runs it.

A cell owns two copies of the policy in its process: its **engine** (an embedded engine speaking
SGLang's native HTTP API, routed by the proxy on rank 0 as ``engine-{cell}``) serving rollouts in
the rollout role, and its **training replica** (a :class:`gyre.training.step.TrainStep`, Megatron
or HF), offloaded while the cell serves rollouts.  The cell carries out the typed commands of
:mod:`gyre.training.control` through :attr:`CellWorker.handlers`, in order, and replies to
``rank0``; a step's work is :func:`gyre.runtime.pipeline.train_on_stream`, a publication
:func:`gyre.runtime.pipeline.publish_to_engines`.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from gyre.runtime import pipeline
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
        cell: this cell's index (= its rank: one rank per cell).
        store: the ``torch.distributed`` store shared by every rank.
        groups: :class:`gyre.training.prefix_groups.PrefixGroups`.
        model_dir: HF checkpoint the engine starts from.
        train_step: this cell's training replica (built from the same checkpoint).
        snapshot: access to the core's snapshot (set later on every rank, once the core's exists).
        start_version: the weight version both copies hold (the step resumed from).
        initial_role: ``"rollout"`` or ``"training"`` (async placement's fixed trainers).
        host: address the cell's engine binds (:func:`gyre.network.node_address`).
    """

    def __init__(self, config: CellConfig, cell: int, store, groups, model_dir: str, train_step,
                 snapshot: Snapshot | None = None, *, start_version: int = 0, initial_role: str = "rollout",
                 host: str = "127.0.0.1"):
        from gyre.rollout.config import EngineConfig
        from gyre.rollout.embedded_server import EngineServer
        from gyre.rollout.engine_client import EngineClient

        self.cfg, self.cell, self.groups, self.snapshot = config, cell, groups, snapshot
        self.channel = ctl.ControlChannel(store, f"cell{cell}")
        self.stream = MicroStepStream(store, config.num_cells, lease_s=config.lease_s)
        self.train_step = train_step
        self.params = train_step.params
        self.shapes = [(p.shape, p.dtype) for p in self.params]
        self.model_dir = str(model_dir)
        self.training = TrainingState(self.params, train_step.optimizer)
        self.engine = EngineServer(EngineConfig(model_dir=str(model_dir), max_running_requests=config.max_running_requests,
                                                random_seed=config.seed + 1000 * cell,
                                                weight_version=str(start_version)), host=host).start()
        self.client = EngineClient(self.engine.url, timeout=600.0)
        self.roles = CellRoles(cell, f"engine-{cell}", self.client, None, self.training)
        self.engine_version = start_version
        if initial_role == "training":
            self.client.release_memory_occupation(["weights", "kv_cache"])
            self.roles.role = "training"
        else:
            self.training.offload()
        self.handlers = {ctl.SwitchToTraining: self.switch_to_training, ctl.SwitchToRollout: self.switch_to_rollout,
                         ctl.JoinStep: self.join_step, ctl.LoadWeights: self.load_weights,
                         ctl.SaveCheckpoint: self.save_checkpoint}

    def _reply(self, msg: ctl.ControlMessage) -> None:
        self.channel.send("rank0", msg)

    def _scratch(self) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in self.shapes]

    # ------------------------------------------------------------------ commands

    def switch_to_training(self, msg: ctl.SwitchToTraining) -> None:
        """Release the engine's memory, restore the training state (the proxy on rank 0 already
        moved this engine's executions and aborted its requests); a switch that fails and rolls
        back is reported as :class:`~gyre.training.control.SwitchFailed`."""
        try:
            tr = self.roles.to_train(None)
        except SwitchFailedError as exc:
            return self._reply(ctl.SwitchFailed(self.cell, "training", str(exc)))
        self._reply(ctl.Switched(self.cell, "training", tr.latency_s, dict(tr.phases_s)))

    def switch_to_rollout(self, msg: ctl.SwitchToRollout) -> None:
        """Offload the training state, resume the engine and load snapshot ``>= msg.version``
        (a switch that fails and rolls back: :class:`~gyre.training.control.SwitchFailed`)."""
        scratch = self._scratch()
        v = self.snapshot.pull(scratch, at_least=msg.version)
        try:
            tr = self.roles.to_rollout(str(v), self.train_step.hf_named(scratch))
        except SwitchFailedError as exc:
            return self._reply(ctl.SwitchFailed(self.cell, "rollout", str(exc)))
        self.engine_version = v
        self._reply(ctl.Switched(self.cell, "rollout", tr.latency_s, dict(tr.phases_s), version=v))

    def load_weights(self, msg: ctl.LoadWeights) -> None:
        """A rollout cell's engine loads snapshot ``>= msg.version`` (nothing to do otherwise)."""
        if self.roles.role != "rollout" or self.engine_version >= msg.version:
            self._reply(ctl.Published(self.cell, self.engine_version, 0.0))
            return
        t0 = time.perf_counter()
        self.engine_version = pipeline.publish_to_engines(self.snapshot, [self.client], self.train_step,
                                                          self._scratch(), at_least=msg.version)
        self._reply(ctl.Published(self.cell, self.engine_version, time.perf_counter() - t0))

    def join_step(self, msg: ctl.JoinStep) -> None:
        self._reply(pipeline.train_on_stream(msg.step, self.cell, self.train_step, self.stream, self.groups,
                                             self.snapshot))

    # ------------------------------------------------------------------ loop

    def run(self, idle_timeout_s: float = 6 * 3600) -> None:
        """Carry out control messages until ``Shutdown``."""
        try:
            while True:
                msg = self.channel.recv(timeout_s=idle_timeout_s)
                if isinstance(msg, ctl.Shutdown):
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

    def save_checkpoint(self, msg: ctl.SaveCheckpoint) -> None:
        t0 = time.perf_counter()
        directory = self.save(msg.directory)
        self._reply(ctl.Saved(self.cell, directory, time.perf_counter() - t0))

    def save(self, directory: str) -> str:
        """Core only: write the policy (HF format, servable) and the optimizer state to ``directory``.

        Layout: ``directory/hf/`` (HF weights + ``config.json`` + the tokenizer files, servable and
        loadable by either backend), ``directory/optimizer.pt`` (the optimizer's ``state_dict``: torch
        AdamW, or Megatron's optimizer).  Returns ``directory``.
        """
        import shutil
        from pathlib import Path

        out = Path(directory)
        (out / "hf").mkdir(parents=True, exist_ok=True)
        resident = self.training.resident
        self.training.restore()
        try:
            self.train_step.save_hf(out / "hf")
            torch.save(self.train_step.optimizer.state_dict(), out / "optimizer.pt")
        finally:
            if not resident:
                self.training.offload()
        for f in Path(self.model_dir).iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "config.json" \
                    and not (out / "hf" / f.name).exists():
                shutil.copy2(f, out / "hf" / f.name)
        return str(out)

