"""The standalone pool of the main job: rollout-only engines on rank 0 (``--standalone-engines K``).

The scheduler sends executions to route :data:`~gyre.scheduler.events.STANDALONE` as to one
destination of capacity ``c_s`` (``--standalone-concurrency``); the pool's ``K`` embedded engines
are registered with the proxy as ``standalone-{i}``.  :class:`StandaloneRoutes` turns a route id
into an engine id: ``engine-{c}`` for cell ``c``; for the pool, the engine the execution already
has or else the least loaded one (ties: the lowest index).

:class:`StandalonePool` owns the engines (same model directory as the cells, seeds after the
cells'), and loads a published version into all of them from the core's snapshot (read over
Mooncake like any cell) in one background thread; it reports on the ``rank0`` control inbox like a
cell, as cell :data:`~gyre.scheduler.events.STANDALONE`: :class:`~gyre.training.control.Published`
once every engine serves the version, :class:`~gyre.training.control.Failed` if a load fails.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from gyre.runtime import pipeline
from gyre.scheduler.events import STANDALONE
from gyre.training import control as ctl

logger = logging.getLogger(__name__)


def standalone_engine_id(i: int) -> str:
    """The proxy's engine id of the pool's engine ``i``."""
    return f"standalone-{i}"


class StandaloneRoutes:
    """Engine ids for the scheduler's routes; remembers which pool engine serves which execution.

    Args:
        engine_ids: the pool's engine ids (empty: no pool).
    """

    def __init__(self, engine_ids: Sequence[str] = ()):
        self.engine_ids = list(engine_ids)
        self.assigned: dict[str, str] = {}  # execution id -> pool engine id

    def engine_for(self, execution_id: str, dest: int) -> str:
        """The engine id of route ``dest`` for ``execution_id``: ``engine-{dest}`` for a cell (the
        execution leaves the pool); for :data:`STANDALONE` the pool engine it already has, else the
        least loaded one.

        Raises:
            RuntimeError: ``dest`` is :data:`STANDALONE` and the pool has no engine.
        """
        if dest != STANDALONE:
            self.assigned.pop(execution_id, None)
            return f"engine-{dest}"
        if execution_id not in self.assigned:
            if not self.engine_ids:
                raise RuntimeError("the scheduler routed an execution to the standalone pool, which has no engine")
            load = self.load()
            self.assigned[execution_id] = min(self.engine_ids, key=lambda e: load[e])
        return self.assigned[execution_id]

    def release(self, execution_id: str) -> None:
        """The execution closed: it no longer counts on its pool engine."""
        self.assigned.pop(execution_id, None)

    def load(self) -> dict[str, int]:
        """Executions assigned to each pool engine."""
        counts = collections.Counter(self.assigned.values())
        return {e: counts[e] for e in self.engine_ids}

    def publish(self, version: int) -> set[int]:
        """Reply ids a publication of ``version`` waits for besides the cells': none (no engine to load)."""
        return set()


class StandalonePool(StandaloneRoutes):
    """The pool's engines and their publication (module docstring).

    Args:
        servers: started :class:`gyre.rollout.embedded.server.EngineServer` objects (engine ``i``
            is ``servers[i]``).
        snapshot: :class:`gyre.runtime.cell_worker.Snapshot` reading the core's snapshot.
        train_step: names the snapshot's tensors for the engines (``hf_named``).
        shapes: ``(shape, dtype)`` of each of the training replica's parameters (taken before it
            was offloaded: an offloaded replica's parameters are empty).
        channel: a :class:`gyre.training.control.ControlChannel` (its own store client) the
            replies are sent on, to ``rank0``.
        version: the version the engines serve at start.
    """

    def __init__(self, servers: Sequence[Any], snapshot, train_step, shapes: Sequence[tuple],
                 channel: ctl.ControlChannel, *, version: int = 0):
        super().__init__([standalone_engine_id(i) for i in range(len(servers))])
        self.servers, self.snapshot, self.train_step, self.channel = list(servers), snapshot, train_step, channel
        self.clients = [s.client() for s in self.servers]
        self.version = version
        self.shapes = list(shapes)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-standalone-load")

    @classmethod
    def start(cls, k: int, model_dir: str, *, concurrency: int, seed: int, num_cells: int, snapshot, train_step,
              shapes: Sequence[tuple], channel: ctl.ControlChannel, version: int = 0) -> "StandalonePool":
        """Start ``k`` embedded engines on ``model_dir`` serving ``version``: engine ``i`` seeded
        ``seed + 1000 * (num_cells + i)`` (after the cells' ``seed + 1000 * c``), with
        ``ceil(concurrency / k)`` running requests (least-loaded routing puts no more on one)."""
        from gyre.rollout.embedded.config import EngineConfig
        from gyre.rollout.embedded.server import EngineServer

        per_engine = max(math.ceil(concurrency / k), 1)
        servers = [EngineServer(EngineConfig(model_dir=str(model_dir), max_running_requests=per_engine,
                                             random_seed=seed + 1000 * (num_cells + i),
                                             weight_version=str(version))).start() for i in range(k)]
        return cls(servers, snapshot, train_step, shapes, channel, version=version)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def publish(self, version: int) -> set[int]:
        """Start loading snapshot ``>= version`` into every engine; returns the reply ids to wait
        for: ``{STANDALONE}`` (nothing when the pool has no engine)."""
        if not self.servers:
            return set()
        self._loader.submit(self._load, version)
        return {STANDALONE}

    def _load(self, version: int) -> None:
        try:
            t0 = time.perf_counter()
            if self.version < version:
                scratch = [torch.empty(shape, dtype=dtype) for shape, dtype in self.shapes]
                self.version = pipeline.publish_to_engines(self.snapshot, self.clients, self.train_step, scratch,
                                                           at_least=version)
            self.channel.send("rank0", ctl.Published(STANDALONE, self.version, time.perf_counter() - t0))
        except Exception as exc:
            logger.exception("standalone pool: loading version %d failed", version)
            self.channel.send("rank0", ctl.Failed(STANDALONE, "load_weights", f"{type(exc).__name__}: {exc}"))

    def server_info(self) -> list[dict[str, Any]]:
        """Each engine's id, URL and served ``weight_version`` (from its ``/get_server_info``), once
        the loads already started are done."""
        self._loader.submit(lambda: None).result()
        return [{"engine_id": e, "url": s.url, "weight_version": c.get_server_info().get("weight_version")}
                for e, s, c in zip(self.engine_ids, self.servers, self.clients)]

    def stop(self) -> None:
        """Wait for a load in progress, then stop the engines."""
        self._loader.shutdown(wait=True)
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.stop()
