"""The control plane: typed role commands from rank 0 to cells and acknowledgements back (DESIGN.md §2).

Messages are small dataclasses encoded as JSON and carried over a ``torch.distributed.TCPStore``
(one transport, no ad-hoc sockets).  Each endpoint has an inbox: a counter key ``ctl/{box}/n``
that senders bump atomically to reserve a slot, and one key per message ``ctl/{box}/{i}``.  A
receiver reads its slots in order, so delivery is FIFO per inbox and exactly once per reader.

Inboxes: ``cell{c}`` for commands to cell ``c``; ``rank0`` for acknowledgements to the scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar


@dataclass(slots=True)
class ControlMessage:
    """Base of every control message; ``kind`` names the concrete type on the wire."""

    kind: ClassVar[str] = "message"


@dataclass(slots=True)
class ToTrain(ControlMessage):
    """Cell leaves rollout for training step ``step`` (DESIGN.md §4.3 rollout -> training)."""

    kind: ClassVar[str] = "to_train"
    cell: int
    step: int


@dataclass(slots=True)
class ToRollout(ControlMessage):
    """Cell returns to rollout and serves at weight version ``version``."""

    kind: ClassVar[str] = "to_rollout"
    cell: int
    version: int


@dataclass(slots=True)
class JoinBatch(ControlMessage):
    """A training satellite joins the stream of step ``step`` (pulls snapshot ``version`` first)."""

    kind: ClassVar[str] = "join_batch"
    cell: int
    step: int
    version: int


@dataclass(slots=True)
class Publish(ControlMessage):
    """Engines load the weights of ``version`` (from the core's snapshot)."""

    kind: ClassVar[str] = "publish"
    version: int


@dataclass(slots=True)
class SaveCheckpoint(ControlMessage):
    """The core writes its policy and optimizer state to ``directory`` (between steps)."""

    kind: ClassVar[str] = "save"
    directory: str


@dataclass(slots=True)
class Shutdown(ControlMessage):
    kind: ClassVar[str] = "shutdown"
    reason: str = ""


@dataclass(slots=True)
class Ack(ControlMessage):
    """A cell finished carrying out ``command``; ``timings`` in seconds (e.g. ``{"switch_s": 0.4}``)."""

    kind: ClassVar[str] = "ack"
    cell: int
    command: str
    ok: bool = True
    timings: dict[str, float] = field(default_factory=dict)
    detail: str = ""


MESSAGE_TYPES: dict[str, type[ControlMessage]] = {
    cls.kind: cls for cls in (ToTrain, ToRollout, JoinBatch, Publish, SaveCheckpoint, Shutdown, Ack)
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

    def recv(self, timeout_s: float = 600.0) -> ControlMessage:
        """Block for the next message.

        Raises:
            TimeoutError: nothing arrived within ``timeout_s``.
        """
        key = f"ctl/{self.inbox}/{self._next}"
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except Exception as exc:  # torch raises DistStoreError/RuntimeError on timeout
            raise TimeoutError(f"{self.inbox}: no control message within {timeout_s}s") from exc
        msg = self.poll()
        assert msg is not None
        return msg


def wait_for(channel: ControlChannel, predicate, timeout_s: float = 600.0) -> list[ControlMessage]:
    """Receive until ``predicate(msg)`` holds; return every message received (the last matches)."""
    got: list[ControlMessage] = []
    deadline = time.monotonic() + timeout_s
    while True:
        msg = channel.recv(max(deadline - time.monotonic(), 0.001))
        got.append(msg)
        if predicate(msg):
            return got


def message_fields(msg: ControlMessage) -> dict[str, Any]:
    return {"kind": msg.kind, **dataclasses.asdict(msg)}
