"""Rank 0's pool of execution slots: one Ray actor per slot a node offers, placed by Ray.

Each node of the fleet offers slots as the Ray custom resource :data:`SLOT_RESOURCE` (``ray start
--resources '{"gyre_execution_slot": 8}'``). The pool keeps one :class:`SlotActor` (a
:class:`~gyre.fleet.node.SlotAgent` in a Ray actor that requests one slot and no CPU) per slot the
cluster offers: Ray places each actor on a node with a free slot. An execution takes a free slot
(:meth:`SlotPool.acquire` waits for one), runs on it, and gives it back when its assessment is over.
A slot whose actor died (its node was lost) is dropped; the pool asks for new actors whenever the
cluster offers more slots than it holds (a node joined), at most once a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from gyre.fleet.node import SlotAgent

__all__ = ["SLOT_RESOURCE", "Slot", "SlotActor", "SlotPool"]

logger = logging.getLogger(__name__)

#: The Ray custom resource a node's execution slots are counted in.
SLOT_RESOURCE = "gyre_execution_slot"


@ray.remote(num_cpus=0, max_concurrency=8, max_restarts=0)
class SlotActor(SlotAgent):
    """A :class:`~gyre.fleet.node.SlotAgent` as a Ray actor, told its node's id."""

    def __init__(self, harness_factory: Callable[[], Any], run_label: str) -> None:
        super().__init__(harness_factory, run_label, ray.get_runtime_context().get_node_id())


@dataclass(eq=False)
class Slot:
    """One placed slot actor and where it runs (:meth:`SlotAgent.describe`)."""

    actor: Any
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return str(self.info.get("node_id", ""))

    def __str__(self) -> str:
        return f"{self.info.get('host', '?')}/{self.node_id[:12]}"


class SlotPool:
    """The slots rank 0 holds (module docstring). Thread-safe.

    Args:
        harness_factory: what each slot builds its harness with (shipped to the nodes).
        run_label: the run's label (slot directories, sandboxes).
        refill_every_s: how often at most the pool compares its slots with the cluster's.
    """

    def __init__(self, harness_factory: Callable[[], Any], run_label: str, *, refill_every_s: float = 1.0) -> None:
        self.factory, self.label, self.refill_every_s = harness_factory, run_label, refill_every_s
        self._cond = threading.Condition()
        self._free: list[Slot] = []
        self._busy: set[Slot] = set()
        self._pending: dict[Any, Any] = {}     # describe() ref -> actor
        self._next_refill = 0.0
        self._alive_nodes: set[str] = set()
        self._closed = False
        self.created = 0
        self.lost = 0

    # ------------------------------------------------------------------ placement

    def offered(self) -> int:
        """Slots the cluster's live nodes offer now."""
        return int(ray.cluster_resources().get(SLOT_RESOURCE, 0))

    def _refill(self) -> None:
        """Called under the lock: place new slot actors for slots the pool does not hold, and take
        in the placed ones."""
        now = time.monotonic()
        if now >= self._next_refill:
            self._next_refill = now + self.refill_every_s
            self._alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            dead = [s for s in self._free if s.node_id not in self._alive_nodes]
            for s in dead:
                self._free.remove(s)
                self.lost += 1
            held = len(self._free) + len(self._busy) + len(self._pending)
            for _ in range(self.offered() - held):
                actor = SlotActor.options(resources={SLOT_RESOURCE: 1}).remote(self.factory, self.label)
                self._pending[actor.describe.remote()] = actor
                self.created += 1
        if self._pending:
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
            for ref in ready:
                actor = self._pending.pop(ref)
                try:
                    self._free.append(Slot(actor, ray.get(ref)))
                except ray.exceptions.RayError as exc:
                    logger.warning("a fleet slot failed to start: %s", exc)
                    self.lost += 1

    def acquire(self, cancelled: Callable[[], bool] = lambda: False, poll_s: float = 0.05) -> Slot | None:
        """A free slot, waiting until one is (``None`` once ``cancelled()`` is true or the pool closed)."""
        with self._cond:
            while not self._closed and not cancelled():
                self._refill()
                if self._free:
                    slot = self._free.pop(0)
                    self._busy.add(slot)
                    return slot
                self._cond.wait(poll_s)
        return None

    def give_back(self, slot: Slot) -> None:
        """``slot`` is free again."""
        with self._cond:
            if slot in self._busy:
                self._busy.discard(slot)
                self._free.append(slot)
                self._cond.notify()

    def discard(self, slot: Slot) -> None:
        """``slot``'s actor died (its node was lost): the pool forgets it."""
        with self._cond:
            if slot in self._busy:
                self._busy.discard(slot)
                self.lost += 1
        try:
            ray.kill(slot.actor)
        except Exception:  # already gone
            pass

    def counts(self) -> dict[str, int]:
        """Slots free, busy and being placed; actors created; slots lost."""
        with self._cond:
            return {"free": len(self._free), "busy": len(self._busy), "pending": len(self._pending),
                    "created": self.created, "lost": self.lost}

    def wait_for_slots(self, n: int, timeout_s: float) -> int:
        """Wait until ``n`` slots are placed (or ``timeout_s`` passed); returns how many are."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                self._refill()
                placed = len(self._free) + len(self._busy)
            if placed >= n or time.monotonic() > deadline:
                return placed
            time.sleep(0.05)

    def shutdown(self) -> None:
        """End every slot actor (their guards kill what they left and remove their directories)."""
        with self._cond:
            self._closed = True
            actors = [s.actor for s in (*self._free, *self._busy)] + list(self._pending.values())
            self._free.clear()
            self._busy.clear()
            self._pending.clear()
            self._cond.notify_all()
        for actor in actors:
            try:
                ray.get(actor.close.remote(), timeout=10)
            except Exception:
                pass
            try:
                ray.kill(actor)
            except Exception:
                pass
