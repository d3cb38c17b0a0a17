"""Streaming training with dynamic membership (paper §4.4).

One optimizer step consumes a *stream* of micro-steps. The core cell (0) trains from the start;
satellite cells join while the stream is in progress (ascending order), pull the core's weight
snapshot, and claim micro-steps from a shared queue; every micro-step counts exactly once. When
the stream is drained the join window closes, the participants ``{0..k}`` sum their gradients
over the prefix group for ``k`` (:mod:`gyre.training.prefix_groups`), and the core normalises
(``1/|E|``), clips, performs **one** optimizer update and broadcasts the new parameters. Each
micro-step's gradient is already weighted per token, so the update does not depend on who
processed what or when.

A participant whose heartbeat is older than the lease is *dead*; a dead cell ``d`` excludes
every cell ``>= d`` from the step (their micro-steps are queued again, their gradients
discarded) and the window closes at ``k < d``. :class:`StreamLedger` is that bookkeeping as a
pure object; :class:`MicroStepStream` is the TCPStore shell around it.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

logger = logging.getLogger(__name__)

MicroStepFn = Callable[[Any], float]
"""Runs forward/backward on one micro-step payload, accumulating into ``.grad``; returns its loss
contribution (already weighted per token, *not* divided by ``|E|``)."""


# --------------------------------------------------------------------------- pure core


@dataclass
class StreamLedger:
    """Core-side bookkeeping of one step's micro-steps (pure; no I/O, time injected).

    A micro-step ``m`` is queued as generation 0; if the cell holding it is excluded it is queued
    again as generation ``g + 1``.  It counts as done when its current generation was finished by a
    cell below the exclusion line.
    """

    num_cells: int
    closed: bool = False
    excluded_from: int | None = None
    generation: dict[int, int] = field(default_factory=dict)
    claimed_by: dict[tuple[int, int], int] = field(default_factory=dict)
    finished_by: dict[tuple[int, int], int] = field(default_factory=dict)
    requeued: list[tuple[int, int]] = field(default_factory=list)

    def add(self, m: int) -> int:
        """Register micro-step ``m`` (generation 0); returns the generation."""
        if m in self.generation:
            raise ValueError(f"micro-step {m} already queued")
        if self.closed:
            raise ValueError("stream is closed")
        self.generation[m] = 0
        return 0

    def close(self) -> None:
        self.closed = True

    def valid_cell(self, cell: int) -> bool:
        return self.excluded_from is None or cell < self.excluded_from

    def on_claim(self, m: int, g: int, cell: int) -> None:
        self.claimed_by[(m, g)] = cell

    def on_finish(self, m: int, g: int, cell: int) -> None:
        self.finished_by.setdefault((m, g), cell)

    def exclude(self, cell: int) -> list[tuple[int, int]]:
        """Exclude ``cell`` and every cell above it; return ``(m, new_generation)`` to queue again."""
        if cell == 0:
            raise ValueError("the core cell cannot be excluded from its own step")
        self.excluded_from = cell if self.excluded_from is None else min(self.excluded_from, cell)
        out = []
        for m, g in list(self.generation.items()):
            holder = self.finished_by.get((m, g), self.claimed_by.get((m, g)))
            if holder is not None and not self.valid_cell(holder):
                self.generation[m] = g + 1
                out.append((m, g + 1))
        self.requeued += out
        return out

    def done(self) -> set[int]:
        """Micro-steps whose current generation was finished by a valid cell."""
        return {m for m, g in self.generation.items()
                if (m, g) in self.finished_by and self.valid_cell(self.finished_by[(m, g)])}

    def drained(self) -> bool:
        return self.closed and len(self.done()) == len(self.generation)

    def window(self, joined: Sequence[int]) -> int:
        """Highest participating cell: the longest joined prefix below the exclusion line."""
        k = 0
        while k + 1 < self.num_cells and (k + 1) in joined and self.valid_cell(k + 1):
            k += 1
        return k


def dead_cells(heartbeats: dict[int, float], now: float, lease_s: float) -> list[int]:
    """Cells whose last heartbeat is older than ``lease_s`` seconds (pure)."""
    return sorted(c for c, t in heartbeats.items() if now - t > lease_s)


# --------------------------------------------------------------------------- store shell


def encode_payload(obj: Any) -> bytes:
    """``torch.save`` bytes of a micro-step payload (tensors, lists, dicts)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def decode_payload(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class MicroStepStream:
    """TCPStore-backed shared micro-step queue.

    Store keys for step ``s`` (``torch.distributed.TCPStore``)::

        s/{s}/q/{j}          queue position j -> (micro-step id m, generation g, payload)
        s/{s}/reserve        positions handed to the producer (counter)
        s/{s}/claim          claim counter: add() returns the position a consumer takes
        s/{s}/c/{m}/{g}      cell that claimed generation g of micro-step m
        s/{s}/d/{m}/{g}      cell that finished generation g of micro-step m
        s/{s}/hb/{c}         heartbeat of cell c (monotonic-free wall time, seconds)
        s/{s}/excluded       lowest excluded cell (absent: none)
        s/{s}/final          the stream is closed and drained
        s/{s}/join/{c}       the scheduler asks cell c to join;  s/{s}/joined/{c}: c may claim
        s/{s}/window         highest participating cell k

    Args:
        store: a ``torch.distributed.Store`` every rank reaches.
        num_cells: K.
        poll_s: polling interval while waiting (seconds).
        lease_s: heartbeat age after which a participant is dead (seconds).
        clock: wall-clock source (``time.time``), injectable for tests.
    """

    def __init__(self, store, num_cells: int, poll_s: float = 0.002, lease_s: float = 30.0,
                 clock: Callable[[], float] = time.time):
        self.store = store
        self.num_cells = num_cells
        self.poll_s = poll_s
        self.lease_s = lease_s
        self.clock = clock

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    # -- producer (core)
    def put(self, step: int, m: int, payload: Any, generation: int = 0) -> int:
        """Append micro-step ``m`` (generation ``generation``); returns its queue position."""
        j = self.store.add(f"s/{step}/reserve", 1) - 1
        self.store.set(f"s/{step}/q/{j}", encode_payload({"m": m, "g": generation, "payload": payload}))
        return j

    def finalize(self, step: int) -> None:
        self.store.set(f"s/{step}/final", b"1")

    def heartbeat(self, step: int, cell: int) -> None:
        self.store.set(f"s/{step}/hb/{cell}", repr(self.clock()).encode())

    def excluded_from(self, step: int) -> int | None:
        return int(self.store.get(f"s/{step}/excluded")) if self._has(f"s/{step}/excluded") else None

    # -- consumers
    def claim(self, step: int, cell: int, timeout_s: float = 600.0) -> tuple[int, int, Any] | None:
        """Take the next queue position; wait for its micro-step, the stream's end or exclusion.

        Returns ``(m, generation, payload)``, or ``None`` when the stream is final or ``cell`` is
        excluded.

        Raises:
            TimeoutError: nothing happened within ``timeout_s``.
        """
        j = self.store.add(f"s/{step}/claim", 1) - 1
        key = f"s/{step}/q/{j}"
        deadline = time.monotonic() + timeout_s
        while True:
            excl = self.excluded_from(step)
            if excl is not None and cell >= excl:
                return None
            if self._has(key):
                item = decode_payload(self.store.get(key))
                self.store.set(f"s/{step}/c/{item['m']}/{item['g']}", str(cell).encode())
                return item["m"], item["g"], item["payload"]
            if self._has(f"s/{step}/final"):
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}: cell {cell} waited {timeout_s}s at queue position {j}")
            time.sleep(self.poll_s)

    def finish(self, step: int, m: int, g: int, cell: int) -> None:
        self.store.compare_set(f"s/{step}/d/{m}/{g}", "", str(cell))

    # -- membership
    def request_join(self, step: int, cell: int) -> None:
        self.store.set(f"s/{step}/join/{cell}", b"1")

    def wait_join_request(self, step: int, cell: int, timeout_s: float = 600.0) -> bool:
        """Block until the core asks ``cell`` to join (True) or the window closes first (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._has(f"s/{step}/join/{cell}"):
                return True
            if self.window_closed(step):
                return False
            time.sleep(self.poll_s)
        raise TimeoutError(f"step {step}: cell {cell} got neither a join request nor a closed window")

    def register_joined(self, step: int, cell: int, timeout_s: float = 600.0) -> None:
        """Mark ``cell`` as a participant (after its predecessor, keeping the prefix contiguous)."""
        if cell > 1:
            self.store.wait([f"s/{step}/joined/{cell - 1}"], timedelta(seconds=timeout_s))
        self.heartbeat(step, cell)
        self.store.set(f"s/{step}/joined/{cell}", b"1")

    def has_joined(self, step: int, cell: int) -> bool:
        """Whether ``cell`` registered as a participant of step ``step``."""
        return self._has(f"s/{step}/joined/{cell}")

    def window_closed(self, step: int) -> bool:
        """Whether the join window of step ``step`` is closed (no cell may join any more)."""
        return self._has(f"s/{step}/window")

    def wait_window(self, step: int, timeout_s: float = 600.0) -> int:
        self.store.wait([f"s/{step}/window"], timedelta(seconds=timeout_s))
        return int(self.store.get(f"s/{step}/window"))

    # -- the core's coordinator
    def coordinator(self, step: int) -> "StepCoordinator":
        """An incremental coordinator of step ``step`` (see :class:`StepCoordinator`)."""
        return StepCoordinator(self, step)

    def coordinate(self, step: int, payloads: Sequence[Any], stop: threading.Event | None = None) -> "StreamLedger":
        """Queue ``payloads`` (micro-step ids 0..n-1), watch claims, completions and heartbeats,
        re-queue the work of dead participants, finalize once drained, close the join window.

        Runs on the core (a thread beside its own consumer loop).  Returns the ledger, whose
        ``window`` result is stored under ``s/{step}/window``.
        """
        coord = self.coordinator(step)
        for payload in payloads:
            coord.add(payload)
        coord.close(timeout_s=float("inf"), stop=stop)
        return coord.ledger


class StepCoordinator:
    """Core-side coordinator of one step whose micro-steps arrive over time.

    ``add`` queues a micro-step as soon as its group is enqueued; ``poll`` (call it regularly)
    reads claims, completions and heartbeats, re-queues the work of dead participants and returns
    the micro-steps newly done, as ``(m, cell)``; ``close`` finalizes the drained stream and closes
    the join window, returning the highest participating cell ``k``.
    """

    def __init__(self, stream: MicroStepStream, step: int):
        self.stream = stream
        self.step = step
        self.ledger = StreamLedger(stream.num_cells)
        self.payloads: dict[int, Any] = {}
        self._reported: set[int] = set()
        self.window: int | None = None

    def add(self, payload: Any) -> int:
        """Queue one micro-step; returns its id ``m``."""
        m = len(self.payloads)
        self.ledger.add(m)
        self.payloads[m] = payload
        self.stream.put(self.step, m, payload)
        return m

    def poll(self) -> list[tuple[int, int]]:
        """One round of bookkeeping; returns ``(m, cell)`` for micro-steps newly done."""
        st, step, ledger = self.stream, self.step, self.ledger
        for m, g in list(ledger.generation.items()):
            if (m, g) not in ledger.claimed_by and st._has(f"s/{step}/c/{m}/{g}"):
                ledger.on_claim(m, g, int(st.store.get(f"s/{step}/c/{m}/{g}")))
            if (m, g) not in ledger.finished_by and st._has(f"s/{step}/d/{m}/{g}"):
                ledger.on_finish(m, g, int(st.store.get(f"s/{step}/d/{m}/{g}")))
        joined = [c for c in range(1, st.num_cells) if st.has_joined(step, c)]
        beats = {c: float(st.store.get(f"s/{step}/hb/{c}")) for c in joined
                 if ledger.valid_cell(c) and st._has(f"s/{step}/hb/{c}")}
        dead = dead_cells(beats, st.clock(), st.lease_s)
        if dead:
            requeue = ledger.exclude(dead[0])
            st.store.set(f"s/{step}/excluded", str(ledger.excluded_from).encode())
            logger.warning("step %d: cell %d is dead (heartbeat older than %.1fs); excluding cells >= %d "
                           "and re-queueing %d micro-steps", step, dead[0], st.lease_s,
                           ledger.excluded_from, len(requeue))
            for m, g in requeue:
                st.put(step, m, self.payloads[m], generation=g)
                self._reported.discard(m)
        done = ledger.done()
        new = sorted(done - self._reported)
        self._reported |= set(new)
        return [(m, ledger.finished_by[(m, ledger.generation[m])]) for m in new]

    def close(self, timeout_s: float = 60.0, stop: threading.Event | None = None) -> int:
        """No more micro-steps: wait until the queued ones are done (polling; at most ``timeout_s``
        or until ``stop`` is set), finalize the stream and store the window ``k``; returns ``k``."""
        st = self.stream
        self.ledger.close()
        deadline = time.monotonic() + timeout_s
        while not self.ledger.drained() and time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                break
            self.poll()
            time.sleep(st.poll_s)
        st.finalize(self.step)
        joined = [c for c in range(1, st.num_cells) if st.has_joined(step=self.step, cell=c)]
        self.window = self.ledger.window(joined)
        st.store.set(f"s/{self.step}/window", str(self.window).encode())
        return self.window


@dataclass
class StepResult:
    """What one streaming step did on this cell, for metrics and tests."""

    step: int
    participants: int
    processed_here: int
    loss_sum: float
    grad_norm: float | None = None


def consume_stream(stream: MicroStepStream, step: int, cell: int, fn: MicroStepFn,
                   on_processed: Callable[[int], None] | None = None,
                   heartbeat_s: float = 0.5) -> tuple[int, float]:
    """Claim and process micro-steps until the stream is final (or this cell is excluded).

    A background thread keeps this cell's heartbeat fresh every ``heartbeat_s`` seconds, so a long
    micro-step is not mistaken for a dead cell.  Returns ``(count, loss_sum)``.
    """
    stop = threading.Event()

    def beat():
        while not stop.wait(heartbeat_s):
            stream.heartbeat(step, cell)

    beater = threading.Thread(target=beat, daemon=True, name=f"gyre-heartbeat-{cell}")
    beater.start()
    count, loss_sum = 0, 0.0
    try:
        while (got := stream.claim(step, cell)) is not None:
            m, g, payload = got
            loss_sum += float(fn(payload))
            stream.finish(step, m, g, cell)
            count += 1
            if on_processed is not None:
                on_processed(count)
    finally:
        stop.set()
        beater.join()
    return count, loss_sum


def _flat_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for p, g in zip(params, grads)])


def reduce_and_update(params: Sequence[torch.Tensor], k: int, groups, stats: Sequence[float],
                      update: Callable[[Sequence[float]], float | None] | None,
                      grads: Sequence[torch.Tensor] | None = None) -> tuple[float | None, list[float]]:
    """Sum gradients and the additive ``stats`` (e.g. the normaliser ``|E|``, loss sums) over the
    participants ``{0..k}``; the core (``update`` given) then runs ``update(summed_stats)`` -- which
    normalises, clips and performs the one optimizer update, returning the grad norm -- and its
    parameters are broadcast to the participants.

    ``grads``: where each parameter's gradient lives when it is not ``p.grad`` (Megatron DDP's
    ``main_grad`` buffers); the core's summed gradients are written back into them in place.
    With ``grads=None`` the summed gradients become ``p.grad`` on the core and every ``p.grad`` is
    cleared afterwards; with ``grads`` given the caller zeroes its buffers before the next step.

    Returns ``(grad norm or None, summed stats)``; every participant receives the summed stats.
    """
    import torch.distributed as dist

    group = groups.group(k) if k > 0 else None
    src = list(grads) if grads is not None else [p.grad for p in params]
    stats_t = torch.tensor(list(stats), dtype=torch.float32, device=params[0].device)
    flat = torch.cat([_flat_grads(params, src), stats_t])
    if group is not None:
        dist.all_reduce(flat, group=group)
    n = len(flat) - len(stats)
    summed = [float(x) for x in flat[n:]]
    norm = None
    if update is not None:
        offset = 0
        with torch.no_grad():
            for i, p in enumerate(params):
                chunk = flat[offset:offset + p.numel()].view_as(p)
                if grads is not None and grads[i] is not None:
                    grads[i].copy_(chunk)
                else:
                    p.grad = chunk.clone()
                offset += p.numel()
        norm = update(summed)
    if group is not None:
        core_rank = groups.members(k)[0]
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=core_rank, group=group)
    if grads is None:
        for p in params:
            p.grad = None
    return norm, summed
