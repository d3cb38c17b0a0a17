"""One cell's loop in the main job (DESIGN.md §2, §4.3, §4.4): every rank runs it.

A cell owns two copies of the policy in its process:

* its **engine** -- an embedded engine speaking SGLang's native HTTP API (``--rollout-engine
  embedded``), serving rollouts while the cell is in the rollout role; the proxy on rank 0
  routes model calls to it as ``engine-{cell}``;
* its **training replica** -- ``--training-backend megatron``: a megatron-core ``GPTModel`` in
  Megatron DDP with Megatron's optimizer (:class:`gyre.training.step.MegatronTrainStep`; gradients
  accumulate in ``main_grad`` without ``finalize_model_grads``, the prefix group sums them);
  ``hf``: a ``transformers`` model with AdamW (:class:`gyre.training.step.HFTrainStep`).  Either
  way the weight snapshot carries the replica's own tensors and rollout engines receive them
  converted to HF names.  Offloaded (:class:`~gyre.training.cell.TrainingState`) while the cell
  serves rollouts.

The cell carries out typed control messages from rank 0 (:mod:`gyre.training.control`), in order:

* ``ToTrain`` -- release the engine's memory, restore the training state (the proxy on rank 0 has
  already moved this engine's executions and aborted its requests);
* ``JoinBatch(step)`` -- take part in step ``step``'s stream: satellites first pull the core's
  weight snapshot of version ``step``; claim micro-steps until the stream is final; sum gradients
  and statistics over the prefix group of the window; the core (cell 0) performs the one
  optimizer update and publishes snapshot ``step + 1``;
* ``ToRollout(version)`` -- offload training state, resume the engine, load snapshot ``>= version``;
* ``Publish(version)`` -- a rollout cell loads snapshot ``>= version`` into its engine;
* ``Shutdown`` -- stop the engine and leave.

Every command is acknowledged to ``rank0`` with its timings (seconds) and, for a step, its
statistics.  Micro-step payloads are pickled lists of :class:`gyre.buffer.packing.MicroStep`
(one *work item*: micro-steps that share a split execution stay together so the forward-only
log-ratio pass of GSPO sees the whole execution).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
import time
from datetime import timedelta
from typing import Any, Sequence

import torch

from gyre.rl.objective import ObjectiveStats
from gyre.training import control as ctl
from gyre.training.cell import CellRoles, TrainingState
from gyre.training.streaming import MicroStepStream, consume_stream, reduce_and_update
from gyre.training.weight_snapshot import (MooncakeSnapshotClient, MooncakeSnapshotServer, SnapshotError,
                                           copy_flat_to_params)

logger = logging.getLogger(__name__)

#: Additive fields of :class:`ObjectiveStats` summed across the participants of a step.
ADDITIVE_STATS = tuple(f.name for f in dataclasses.fields(ObjectiveStats) if f.name != "rho_max")


def encode_work_item(micro_steps: Sequence[Any]) -> torch.Tensor:
    """A work item as a ``uint8`` tensor (the stream's payloads are ``torch.save``-d tensors)."""
    return torch.frombuffer(bytearray(pickle.dumps(list(micro_steps))), dtype=torch.uint8)


def decode_work_item(payload: torch.Tensor) -> list[Any]:
    return pickle.loads(payload.numpy().tobytes())


class Snapshot:
    """Read access to the core's weight snapshot: local on the core, Mooncake reads elsewhere."""

    def __init__(self, server: MooncakeSnapshotServer | None = None, client: MooncakeSnapshotClient | None = None):
        self.server, self.client = server, client

    def version(self) -> int:
        if self.server is not None:
            return int(self.server.header[0])
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
        args: the run's flags.
        cell: this cell's index (= its rank: one rank per cell on the CPU default).
        store: the ``torch.distributed`` store shared by every rank.
        groups: :class:`gyre.training.prefix_groups.PrefixGroups`.
        model_dir: HF checkpoint both copies start from.
        snapshot: access to the core's snapshot (the core passes its server).
        initial_role: ``"rollout"`` or ``"training"`` (async placement's fixed trainers).
        optimizer_state: core only, on resume: the ``optimizer.pt`` of the checkpoint.
    """

    def __init__(self, args: argparse.Namespace, cell: int, store, groups, model_dir: str, snapshot: Snapshot,
                 initial_role: str = "rollout", optimizer_state: str | None = None):
        from gyre.embedded_model import load_hf_model
        from gyre.rollout.config import EngineConfig
        from gyre.rollout.embedded_server import EngineServer
        from gyre.rollout.engine_client import EngineClient
        from gyre.training.step import build_train_step

        self.args, self.cell, self.groups, self.snapshot = args, cell, groups, snapshot
        self.channel = ctl.ControlChannel(store, f"cell{cell}")
        self.stream = MicroStepStream(store, args.num_cells, lease_s=float(getattr(args, "cell_lease_s", 60.0)))
        torch.manual_seed(args.seed)
        model = load_hf_model(model_dir)
        model.train()
        self.train_step = build_train_step(args, model)
        if self.train_step.model is not model:  # Megatron holds converted copies of the weights
            del model
        self.params = self.train_step.params
        self.shapes = [(p.shape, p.dtype) for p in self.params]
        self.model_dir = str(model_dir)
        self.training = TrainingState(self.params, self.train_step.optimizer)
        self.engine = EngineServer(EngineConfig(model_dir=str(model_dir),
                                                max_running_requests=max(args.rollout_concurrency_per_cell, 1),
                                                random_seed=args.seed + 1000 * cell,
                                                weight_version=str(getattr(args, "start_version", 0)))).start()
        self.client = EngineClient(self.engine.url, timeout=600.0)
        self.roles = CellRoles(cell, f"engine-{cell}", self.client, None, self.training)
        self.engine_version = int(getattr(args, "start_version", 0))
        self.steps_trained = 0
        if optimizer_state is not None:
            self.train_step.optimizer.load_state_dict(torch.load(optimizer_state, weights_only=True))
        if initial_role == "training":
            self.client.release_memory_occupation(["weights", "kv_cache"])
            self.roles.role = "training"
        else:
            self.training.offload()

    # ------------------------------------------------------------------ helpers

    def _ack(self, command: str, ok: bool = True, detail: str = "", **timings: float) -> None:
        self.channel.send("rank0", ctl.Ack(self.cell, command, ok, {k: float(v) for k, v in timings.items()}, detail))

    def _scratch(self) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in self.shapes]

    def _named(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Snapshot-layout tensors under the engine's (HF) names."""
        return self.train_step.hf_named(tensors)

    # ------------------------------------------------------------------ commands

    def to_train(self, msg: ctl.ToTrain) -> None:
        tr = self.roles.to_train(None)
        self._ack("to_train", switch_s=tr.latency_s, **tr.phases_s)

    def to_rollout(self, msg: ctl.ToRollout) -> None:
        scratch = self._scratch()
        v = self.snapshot.pull(scratch, at_least=msg.version)
        tr = self.roles.to_rollout(str(v), self._named(scratch))
        self.engine_version = v
        self._ack("to_rollout", switch_s=tr.latency_s, version=v, **tr.phases_s)

    def publish(self, msg: ctl.Publish) -> None:
        if self.roles.role != "rollout" or self.engine_version >= msg.version:
            self._ack("publish", load_s=0.0, version=self.engine_version)
            return
        t0 = time.perf_counter()
        scratch = self._scratch()
        v = self.snapshot.pull(scratch, at_least=msg.version)
        self.client.update_weights_from_tensor(self._named(scratch), weight_version=str(v))
        self.engine_version = v
        self._ack("publish", load_s=time.perf_counter() - t0, version=v)

    def join_batch(self, msg: ctl.JoinBatch) -> None:
        """Take part in step ``msg.step`` (module docstring)."""
        step, cell, st = msg.step, self.cell, self.stream
        t0 = time.perf_counter()
        if st._has(f"s/{step}/window"):
            self._ack("join", ok=False, detail="window closed", step=step)
            return
        if cell != 0:
            if self.snapshot.pull(self.params, exact=step) is None:
                self._ack("join", ok=False, detail="snapshot moved on", step=step)
                return
            if cell > 1:  # joins stay a contiguous prefix; give up once the window closed
                while not st._has(f"s/{step}/joined/{cell - 1}"):
                    if st._has(f"s/{step}/window"):
                        self._ack("join", ok=False, detail="window closed", step=step)
                        return
                    time.sleep(st.poll_s)
            st.register_joined(step, cell, timeout_s=60)
        t_join = time.perf_counter()
        stats = ObjectiveStats()
        tokens = {"row": 0, "forward": 0, "pass": 0}
        self.train_step.zero_grad()

        def run_item(payload) -> float:
            from gyre.training.step import apply_log_ratio_sums

            items = decode_work_item(payload)
            sums, pass_tokens = self.train_step.precompute_log_ratio_sums(items)
            apply_log_ratio_sums(items, sums)
            _, s = self.train_step.accumulate(items)
            stats.merge(s)
            tokens["row"] += sum(m.row_tokens for m in items)
            tokens["forward"] += sum(m.forward_tokens for m in items)
            tokens["pass"] += pass_tokens
            return s.loss_sum

        count, _ = consume_stream(st, step, cell, run_item)
        t_consumed = time.perf_counter()
        k = st.wait_window(step, timeout_s=3600)
        norm = None
        summed = None
        if cell <= k:
            vec = [float(getattr(stats, f)) for f in ADDITIVE_STATS] + [float(v) for v in tokens.values()]
            update = self._core_update if cell == 0 else None
            norm, summed = reduce_and_update(self.params, k, self.groups, vec, update,
                                             grads=self.train_step.grad_tensors())
        self.train_step.zero_grad()
        t_reduced = time.perf_counter()
        if cell == 0:
            self.snapshot.server.publish(self.params, version=step + 1)
        self.steps_trained += 1
        out: dict[str, float] = {"step": step, "micro_steps_here": count, "window": k,
                                 "join_s": t_join - t0, "consume_s": t_consumed - t_join,
                                 "update_s": t_reduced - t_consumed, "time_s": time.perf_counter() - t0}
        if cell == 0 and summed is not None:
            total = ObjectiveStats(**{f: type(getattr(stats, f))(v) for f, v in zip(ADDITIVE_STATS, summed)})
            total.rho_max = stats.rho_max  # the core's own maximum (not reduced)
            out.update({k_: v for k_, v in total.metrics().items()})
            out.update(normaliser=float(total.normaliser), row_tokens=summed[len(ADDITIVE_STATS)],
                       forward_tokens=summed[len(ADDITIVE_STATS) + 1],
                       log_ratio_pass_tokens=summed[len(ADDITIVE_STATS) + 2],
                       grad_norm=float("nan") if norm is None else float(norm))
        self._ack("step", **out)

    def _core_update(self, summed: Sequence[float]) -> float | None:
        normaliser = summed[ADDITIVE_STATS.index("normaliser")]
        if normaliser <= 0:  # nothing counted: no update, no decay, no momentum
            return None
        return self.train_step.optimizer_step(int(round(normaliser)))

    # ------------------------------------------------------------------ loop

    def run(self, idle_timeout_s: float = 6 * 3600) -> None:
        """Carry out control messages until ``Shutdown``."""
        handlers = {ctl.ToTrain: self.to_train, ctl.ToRollout: self.to_rollout, ctl.Publish: self.publish,
                    ctl.JoinBatch: self.join_batch, ctl.SaveCheckpoint: self.save_checkpoint}
        try:
            while True:
                msg = self.channel.recv(timeout_s=idle_timeout_s)
                if isinstance(msg, ctl.Shutdown):
                    self._ack("shutdown")
                    return
                try:
                    handlers[type(msg)](msg)
                except Exception as exc:
                    logger.exception("cell %d: %s failed", self.cell, msg.kind)
                    self._ack(msg.kind, ok=False, detail=f"{type(exc).__name__}: {exc}")
                    raise
        finally:
            self.engine.stop()

    def save_checkpoint(self, msg: ctl.SaveCheckpoint) -> None:
        t0 = time.perf_counter()
        self._ack("save", detail=self.save(msg.directory), save_s=time.perf_counter() - t0)

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


def wait_key(store, key: str, timeout_s: float) -> None:
    store.wait([key], timedelta(seconds=timeout_s))
