"""The control plane: typed commands from rank 0 to cells and typed replies back.

Messages are small dataclasses encoded as JSON and carried over a ``torch.distributed.TCPStore``
(one transport, no ad-hoc sockets).  Each endpoint has an inbox: a counter key ``ctl/{box}/n``
that senders bump atomically to reserve a slot, and one key per message ``ctl/{box}/{i}``.  A
receiver reads its slots in order, so delivery is FIFO per inbox and exactly once per reader.

Inboxes: ``cell{c}`` for commands to cell ``c``; ``rank0`` for the cells' replies.

Commands carry out what the scheduler decided (its own records in :mod:`gyre.scheduler.events`
have other names): :class:`SwitchToTraining`, :class:`SwitchToRollout`, :class:`JoinStep`,
:class:`LoadWeights`, :class:`SaveCheckpoint`, :class:`Shutdown`.  Replies say what happened:
:class:`Switched`, :class:`StepDone`, :class:`JoinSkipped`, :class:`Published`, :class:`Saved`,
:class:`Stopped`, :class:`Failed`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class ControlMessage:
    """Base of every control message; ``kind`` names the concrete type on the wire."""

    kind: ClassVar[str] = "message"


# --------------------------------------------------------------------------- commands (rank 0 -> cell)


@dataclass(slots=True)
class SwitchToTraining(ControlMessage):
    """Cell ``cell`` leaves rollout to train step ``step`` (its engine releases its memory)."""

    kind: ClassVar[str] = "switch_to_training"
    cell: int
    step: int


@dataclass(slots=True)
class SwitchToRollout(ControlMessage):
    """Cell ``cell`` returns to rollout and serves weights of version ``>= version``."""

    kind: ClassVar[str] = "switch_to_rollout"
    cell: int
    version: int


@dataclass(slots=True)
class JoinStep(ControlMessage):
    """A training cell takes part in the stream of step ``step`` (satellites pull snapshot ``version`` first)."""

    kind: ClassVar[str] = "join_step"
    cell: int
    step: int
    version: int


@dataclass(slots=True)
class LoadWeights(ControlMessage):
    """A rollout cell's engine loads the weights of version ``>= version`` from the core's snapshot."""

    kind: ClassVar[str] = "load_weights"
    version: int


@dataclass(slots=True)
class SaveCheckpoint(ControlMessage):
    """The core writes its policy and optimizer state to ``directory`` (between steps)."""

    kind: ClassVar[str] = "save_checkpoint"
    directory: str


@dataclass(slots=True)
class Shutdown(ControlMessage):
    """The cell stops its engine and leaves its loop."""

    kind: ClassVar[str] = "shutdown"
    reason: str = ""


# --------------------------------------------------------------------------- replies (cell -> rank 0)


@dataclass(slots=True)
class Switched(ControlMessage):
    """Cell ``cell`` now has role ``role`` (``"training"`` or ``"rollout"``); ``latency_s`` is the
    whole switch, ``phases_s`` its phases; ``version`` the engine's weights after a switch to rollout."""

    kind: ClassVar[str] = "switched"
    cell: int
    role: str
    latency_s: float
    phases_s: dict[str, float] = field(default_factory=dict)
    version: int | None = None


@dataclass(slots=True)
class SwitchFailed(ControlMessage):
    """Cell ``cell`` could not switch into ``role`` and is back in its previous role; ``detail`` is
    the error (the switch may be commanded again)."""

    kind: ClassVar[str] = "switch_failed"
    cell: int
    role: str
    detail: str


@dataclass(slots=True)
class StepDone(ControlMessage):
    """Cell ``cell`` finished its part of step ``step``.

    Every participant reports its own micro-step count and timings; the core (cell 0) also reports
    the step's statistics summed over the participants (``None`` elsewhere), among them
    ``compute_s``: seconds spent inside micro-steps (claiming and waiting left out).
    """

    kind: ClassVar[str] = "step_done"
    cell: int
    step: int
    micro_steps_here: int
    window: int
    join_s: float
    consume_s: float
    update_s: float
    time_s: float
    loss: float | None = None
    executions: float | None = None
    targets: float | None = None
    clip_fraction: float | None = None
    clip_fraction_high: float | None = None
    clip_fraction_low: float | None = None
    token_clip_fraction: float | None = None
    rho_mean: float | None = None
    rho_max: float | None = None
    rho_capped_fraction: float | None = None
    train_inference_mismatch: float | None = None
    entropy: float | None = None
    normaliser: float | None = None
    row_tokens: float | None = None
    forward_tokens: float | None = None
    log_ratio_pass_tokens: float | None = None
    compute_s: float | None = None
    grad_norm: float | None = None

    def metrics(self) -> dict[str, float]:
        """The fields that carry a value, by name (the step's metrics on the core)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "cell" and getattr(self, f.name) is not None}


@dataclass(slots=True)
class JoinSkipped(ControlMessage):
    """Cell ``cell`` did not take part in step ``step`` (``reason``: the window closed, the snapshot moved on)."""

    kind: ClassVar[str] = "join_skipped"
    cell: int
    step: int
    reason: str


@dataclass(slots=True)
class Published(ControlMessage):
    """Cell ``cell``'s engine serves weights of ``version`` (``load_s`` 0 when nothing had to load);
    ``cell`` -1 (``STANDALONE``): every engine of the standalone pool on rank 0 serves it."""

    kind: ClassVar[str] = "published"
    cell: int
    version: int
    load_s: float


@dataclass(slots=True)
class Saved(ControlMessage):
    """The core wrote checkpoint ``directory``."""

    kind: ClassVar[str] = "saved"
    cell: int
    directory: str
    save_s: float


@dataclass(slots=True)
class Stopped(ControlMessage):
    """Cell ``cell`` left its loop (reply to :class:`Shutdown`)."""

    kind: ClassVar[str] = "stopped"
    cell: int


@dataclass(slots=True)
class Failed(ControlMessage):
    """Cell ``cell`` (-1: the standalone pool) could not carry out a ``command`` (its ``kind``);
    ``detail`` is the error."""

    kind: ClassVar[str] = "failed"
    cell: int
    command: str
    detail: str


MESSAGE_TYPES: dict[str, type[ControlMessage]] = {
    cls.kind: cls for cls in (SwitchToTraining, SwitchToRollout, JoinStep, LoadWeights, SaveCheckpoint, Shutdown,
                              Switched, SwitchFailed, StepDone, JoinSkipped, Published, Saved, Stopped, Failed)
}


def encode(msg: ControlMessage) -> bytes:
    """JSON bytes ``{"kind": ..., **fields}``."""
    return json.dumps({"kind": msg.kind, **dataclasses.asdict(msg)}, sort_keys=True).encode()


def decode(data: bytes) -> ControlMessage:
    """Inverse of :func:`encode`.

    Raises:
        ValueError: unknown ``kind`` or fields that do not match its dataclass.
    """
    obj = json.loads(data)
    kind = obj.pop("kind", None)
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown control message kind {kind!r}")
    try:
        return cls(**obj)
    except TypeError as exc:
        raise ValueError(f"bad {kind} message: {exc}") from None


class ControlChannel:
    """One endpoint's view of the TCPStore-backed inboxes.

    Args:
        store: the shared ``torch.distributed.Store``.
        inbox: this endpoint's inbox name (``"rank0"`` or ``f"cell{c}"``).
    """

    def __init__(self, store, inbox: str, poll_s: float = 0.002):
        self.store = store
        self.inbox = inbox
        self.poll_s = poll_s
        self._next = 0

    def send(self, to: str, msg: ControlMessage) -> None:
        i = self.store.add(f"ctl/{to}/n", 1) - 1
        self.store.set(f"ctl/{to}/{i}", encode(msg))

    def poll(self) -> ControlMessage | None:
        """The next message of this inbox, or ``None`` if none has arrived."""
        key = f"ctl/{self.inbox}/{self._next}"
        if not self.store.check([key]):
            return None
        self._next += 1
        msg = decode(self.store.get(key))
        self.store.delete_key(key)
        return msg

    def collect(self, kind: type[ControlMessage], cells: int, timeout_s: float) -> set[int]:
        """Receive until ``cells`` distinct cells sent a ``kind`` reply (others are dropped) or
        ``timeout_s`` passed; returns the cells heard from."""
        heard: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(heard) < cells and time.monotonic() < deadline:
            msg = self.poll()
            if msg is None:
                time.sleep(self.poll_s)
            elif isinstance(msg, kind):
                heard.add(msg.cell)
        return heard

    def recv(self, timeout_s: float = 600.0) -> ControlMessage:
        """Block for the next message (polling with a growing interval up to 20 ms, in Python, so
        signal handlers run while a cell waits).

        Raises:
            TimeoutError: nothing arrived within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        delay = self.poll_s
        while (msg := self.poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.inbox}: no control message within {timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return msg
