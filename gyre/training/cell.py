"""A cell's harness-preserving role transitions (paper §4.3).

**Rollout -> training** (:meth:`CellRoles.to_train`): the proxy stops routing to this cell's
engine (every execution pinned to it is rerouted to the destination the scheduler reserved), the
requests still running on it are aborted and transparently retried by the proxy at the
destination (which recomputes the whole context, unless the proxy copies the KV first:
``--rollout-kv-migration``); the engine
pauses generation in ``abort`` mode (a request that reached it after the proxy's abort is aborted
too, and later ones wait), flushes its prefix cache until that succeeds (SGLang flushes, and may
release memory, only when nothing runs or waits), releases all of its memory --
weights, KV cache and CUDA graphs (``release_memory_occupation``, :data:`ENGINE_MEMORY_TAGS`) --
and the training parameters and optimizer buffers are restored.

**Training -> rollout** (:meth:`CellRoles.to_rollout`), in the order that keeps the peak memory
low on a GPU: the engine resumes its weights' memory and loads the current published weights with
their version, then the training state is offloaded, then the engine resumes its KV cache and CUDA
graphs (the bulk of its memory) and continues generation (requests that waited run now); the
scheduler may route executions to it afterwards.

A transition that fails rolls back (the cell keeps its role) and raises :class:`SwitchFailedError`.
Backend processes (the engine server) and communication groups stay alive across transitions.
Each transition's latency (seconds) is measured and recorded as a :class:`Transition` for the
metrics sink and the timeline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol

import torch

from gyre.rollout.client.engine_client import flush_when_idle
from gyre.rollout.weights import push_weight_buckets

logger = logging.getLogger(__name__)


#: Memory an engine gives up while its cell trains (SGLang's ``release_memory_occupation`` tags).
ENGINE_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class RouteControl(Protocol):
    """What a cell needs from the proxy (``gyre.proxy.server.ProxyServer`` satisfies it)."""

    def reroute_engine(self, source: str, destination: str) -> list[str]: ...

    def abort_engine(self, engine_id: str) -> int: ...


class EngineControl(Protocol):
    """What a cell needs from its engine (``gyre.rollout.client.engine_client.EngineClient`` satisfies it)."""

    def pause_generation(self, mode: str = "abort") -> dict: ...

    def continue_generation(self) -> dict: ...

    def release_memory_occupation(self, tags=None) -> dict: ...

    def resume_memory_occupation(self, tags=None) -> dict: ...

    def flush_cache(self) -> None: ...

    def update_weights_from_tensor(self, named_tensors=None, *, weight_version: str, **kw) -> dict: ...


class SwitchFailedError(RuntimeError):
    """A role switch did not complete and the cell is back in its previous role (it can be retried)."""


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (pinned when ``t`` is on a GPU, so the copy back is asynchronous)."""
    if t.device.type == "cpu":
        return t.detach().to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t.detach())


def _main_params(optimizer) -> list[torch.Tensor]:
    """The fp32 main parameters a mixed-precision Megatron optimizer keeps beside the model's
    (``fp32_from_float16_groups``, of every optimizer a ``ChainedOptimizer`` chains)."""
    out: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer is not None else []):
        for group in getattr(opt, "fp32_from_float16_groups", None) or []:
            out.extend(group)
    return out


class TrainingState:
    """Training parameters and optimizer buffers that leave memory while the cell serves rollouts.

    ``offload()`` copies every parameter and optimizer-state tensor into a host snapshot and frees
    the live storage (``param.data`` becomes an empty tensor); ``restore()`` copies them back.
    ``grad_buffers`` (Megatron DDP's contiguous gradient buffers, which every ``main_grad`` views)
    are not copied: they are zeroed before each step anyway, so offloading frees their storage in
    place (``untyped_storage().resize_(0)``, the views stay attached) and restoring re-allocates it
    zeroed.  Mixed-precision optimizers' fp32 main parameters (Megatron's
    ``fp32_from_float16_groups``, of each chained optimizer) are copied and freed like the
    parameters.  On the CPU default both the copy and the live storage are host memory; a CUDA
    tensor's copy is in pinned host memory, and offloading empties the CUDA allocator's cache.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None = None,
                 grad_buffers: Iterable[torch.Tensor] = ()):
        self.params = list(params)
        self.optimizer = optimizer
        self.grad_buffers = list(grad_buffers)
        self._grad_bytes = [b.untyped_storage().nbytes() for b in self.grad_buffers]
        self._saved: list[torch.Tensor] | None = None
        self._saved_opt: list[tuple[dict, str, torch.Tensor, torch.device]] = []
        self.main_params = _main_params(optimizer)
        self._saved_main: list[torch.Tensor] = []
        self.resident = True

    def offload(self) -> None:
        if not self.resident:
            return
        self._saved = [_to_host(p) for p in self.params]
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._saved_opt = []
        if self.optimizer is not None:
            for _, state in self.optimizer.state.items():  # Megatron's optimizers: a ProxyDict (no values())
                for k, v in list(state.items()):
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        self._saved_opt.append((state, k, _to_host(v), v.device))
                        state[k] = torch.empty(0, dtype=v.dtype, device=v.device)
        self._saved_main = [_to_host(t) for t in self.main_params]
        for t in self.main_params:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        for b in self.grad_buffers:
            b.untyped_storage().resize_(0)
        self.resident = False
        if any(p.device.type == "cuda" for p in self.params):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand the freed blocks back, for the engine to resume into

    def host_tensors(self) -> list[torch.Tensor]:
        """The policy's tensors wherever they are now: the parameters, or their offloaded copies."""
        return list(self.params) if self.resident else list(self._saved)

    def restore(self) -> None:
        if self.resident:
            return
        assert self._saved is not None
        for p, saved in zip(self.params, self._saved):
            p.data = saved.to(p.device, non_blocking=True)
        for state, k, v, device in self._saved_opt:
            state[k] = v.to(device, non_blocking=True)
        for t, saved in zip(self.main_params, self._saved_main):
            t.data = saved.to(t.device, non_blocking=True)
        for b, nbytes in zip(self.grad_buffers, self._grad_bytes):
            b.untyped_storage().resize_(nbytes)
            b.zero_()
        self._saved, self._saved_opt, self._saved_main = None, [], []
        self.resident = True
        if any(p.device.type == "cuda" for p in self.params):
            torch.cuda.synchronize()  # the pinned copies may go once the copies have landed


@dataclass
class Transition:
    """One measured role change of a cell (seconds since the epoch and durations in seconds)."""

    cell: int
    direction: str  # "rollout->training" | "training->rollout"
    started_at: float
    latency_s: float
    rerouted: int = 0
    aborted: int = 0
    version: str | None = None
    phases_s: dict[str, float] = field(default_factory=dict)


class CellRoles:
    """Carries out ``to_train`` / ``to_rollout`` for one cell (see the module docstring).

    Args:
        cell: cell index.
        engine_id: the proxy's id of this cell's engine.
        engine: control client of this cell's engine.
        proxy: route control (``None`` when another process moves the routes).
        training: the cell's :class:`TrainingState` (``None``: nothing to restore).
        clock: ``time.perf_counter``-like, injectable.
        on_transition: callback receiving each :class:`Transition` (metrics, timeline).
    """

    def __init__(self, cell: int, engine_id: str, engine: EngineControl, proxy: RouteControl | None,
                 training: TrainingState | None = None, clock: Callable[[], float] = time.perf_counter,
                 on_transition: Callable[[Transition], None] | None = None):
        self.cell = cell
        self.engine_id = engine_id
        self.engine = engine
        self.proxy = proxy
        self.training = training
        self.clock = clock
        self.on_transition = on_transition
        self.role = "rollout"
        self.transitions: list[Transition] = []
        self.release_attempts = 3
        self.idle_timeout_s = 30.0

    def _emit(self, tr: Transition) -> Transition:
        self.transitions.append(tr)
        logger.info("cell %d %s in %.3fs (rerouted %d, aborted %d)", tr.cell, tr.direction, tr.latency_s,
                    tr.rerouted, tr.aborted)
        if self.on_transition is not None:
            self.on_transition(tr)
        return tr

    def to_train(self, destination: str | None) -> Transition:
        """Rollout -> training; ``destination`` is the engine id that takes over this cell's executions
        (``None``, or no ``proxy``: the routes were already moved, e.g. by rank 0 in a distributed run).

        Raises:
            RuntimeError: the cell is not serving rollouts.
            SwitchFailedError: the engine's memory could not be released after ``release_attempts``
                tries; generation was resumed and the cell still serves rollouts.
        """
        if self.role != "rollout":
            raise RuntimeError(f"cell {self.cell} is {self.role}, not rollout")
        t0, wall = self.clock(), time.time()
        moved, aborted = [], 0
        if self.proxy is not None and destination is not None:
            moved = self.proxy.reroute_engine(self.engine_id, destination)
            aborted = self.proxy.abort_engine(self.engine_id)
        t1 = self.clock()
        for attempt in range(1, self.release_attempts + 1):
            try:  # pausing in abort mode leaves nothing running, so the release cannot meet a request
                self.release_engine()
                break
            except Exception as exc:
                if attempt == self.release_attempts:
                    self.engine.continue_generation()  # back to serving; an error here propagates
                    raise SwitchFailedError(f"cell {self.cell} could not release its engine's memory "
                                            f"({attempt} attempts): {type(exc).__name__}: {exc}") from exc
                logger.warning("cell %d: releasing engine memory failed (attempt %d of %d), retrying: %s",
                               self.cell, attempt, self.release_attempts, exc)
                time.sleep(0.5 * attempt)
        t2 = self.clock()
        if self.training is not None:
            self.training.restore()
        t3 = self.clock()
        self.role = "training"
        return self._emit(Transition(self.cell, "rollout->training", wall, t3 - t0, len(moved), aborted,
                                     phases_s={"reroute_abort": t1 - t0, "release": t2 - t1, "restore": t3 - t2}))

    def _wait_until_idle(self) -> None:
        """Flush the engine's prefix cache until it succeeds (:func:`flush_when_idle`): SGLang's
        release asserts the same idleness and kills the server when it does not hold."""
        flush_when_idle(self.engine, self.idle_timeout_s)

    def release_engine(self) -> None:
        """Pause in ``abort`` mode, wait until the engine is idle, release all of its memory (a cell
        that starts as a trainer; :meth:`to_train` does the same with retries).  The role is the caller's."""
        self.engine.pause_generation("abort")
        self._wait_until_idle()
        self.engine.release_memory_occupation(list(ENGINE_MEMORY_TAGS))

    def to_rollout(self, version: str, named_weights: Mapping[str, torch.Tensor] | Iterable[Mapping]) -> Transition:
        """Training -> rollout, serving ``named_weights`` (HF names; a mapping, or buckets of them
        loaded one by one, :func:`gyre.rollout.weights.push_weight_buckets`) as ``version``.

        Raises:
            RuntimeError: the cell is not training.
            SwitchFailedError: the engine could not resume, load or continue; its memory was
                released again and the training state restored: the cell still trains.
        """
        if self.role != "training":
            raise RuntimeError(f"cell {self.cell} is {self.role}, not training")
        t0, wall = self.clock(), time.time()
        t = [t0]
        resumed: list[str] = []
        offloaded = False
        try:
            self.engine.resume_memory_occupation(["weights"])
            resumed.append("weights")
            t.append(self.clock())
            if isinstance(named_weights, Mapping):
                self.engine.update_weights_from_tensor(named_weights, weight_version=str(version))
            else:  # buckets
                push_weight_buckets(self.engine, named_weights, str(version), live=False)
            t.append(self.clock())
            if self.training is not None:
                self.training.offload()
                offloaded = True
            t.append(self.clock())
            self.engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
            resumed += ["kv_cache", "cuda_graph"]
            self.engine.continue_generation()
        except Exception as exc:  # roll back; an error while rolling back propagates
            if resumed:
                self.engine.pause_generation("abort")
                self.engine.release_memory_occupation(resumed)
            if offloaded:
                self.training.restore()
            raise SwitchFailedError(f"cell {self.cell} could not bring its engine back: "
                                    f"{type(exc).__name__}: {exc}") from exc
        t.append(self.clock())
        self.role = "rollout"
        return self._emit(Transition(self.cell, "training->rollout", wall, t[4] - t0, version=str(version),
                                     phases_s=dict(zip(("resume_weights", "load_weights", "offload", "resume_kv"),
                                                       (b - a for a, b in zip(t, t[1:]))))))
