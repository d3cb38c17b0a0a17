"""One thread's context as growable token arrays, so that each request's input is a prefix of
them and a request that continues the previous one is written after it, in place.

A thread of an execution (the main agent, a sub-agent) sends its whole context every call, and
each call's input is the previous call's input, its output and a few thousand new tokens. Built
by concatenation, every input is a fresh copy of the whole context: 700k tokens copied per call,
and one more full copy per thread held while the record is kept (by the session, the record
writer and the tree's insert index). A :class:`ContextBuffer` holds the context once. The input
of a request that continues the buffer's latest input whole is a longer view of the same arrays
(nothing before it is rewritten), and the tree can keep views of it instead of copies of the
same tokens (``TrajectoryTree.insert(share_input=True)``).

Pure: no locks; the caller serialises the requests of one execution.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ContextBuffer", "write_input"]

#: Spare room given to a new or grown buffer: a quarter of its length, at least this many tokens.
MIN_SPARE_TOKENS = 1024


def _capacity(n: int) -> int:
    return n + max(n // 4, MIN_SPARE_TOKENS)


class ContextBuffer:
    """``ids`` (``int32``) and ``prov`` (``int8``) arrays of one capacity; ``used`` tokens of them
    are claimed by inputs already handed out (``ids[:used]`` is the latest, the earlier ones are
    prefixes of it). Positions past ``used`` are free. ``copied_from``: the ``ids`` array this
    buffer's first tokens were copied from, while views of it may still be moved here (the
    caller clears it once the tree has moved them)."""

    __slots__ = ("ids", "prov", "used", "copied_from")

    def __init__(self, capacity: int) -> None:
        self.ids = np.empty(capacity, np.int32)
        self.prov = np.empty(capacity, np.int8)
        self.used = 0
        self.copied_from: np.ndarray | None = None

    @property
    def capacity(self) -> int:
        """Tokens the arrays hold."""
        return int(self.ids.shape[0])


def write_input(
    ids_parts: list[np.ndarray],
    prov_parts: list[np.ndarray],
    buffer: ContextBuffer | None = None,
    keep: int = 0,
) -> tuple[np.ndarray, np.ndarray, ContextBuffer, np.ndarray | None]:
    """Concatenate the parts into a context buffer; return ``(input_ids, input_provenance,
    buffer, replaced)``.

    ``input_ids``/``input_provenance`` are read-only views ``buffer.ids[:n]``/``buffer.prov[:n]``.
    With ``buffer`` given, the first part must be ``buffer.ids[:keep]`` (with its provenance):
    when nothing was written past it (``buffer.used == keep``) the other parts are written after
    it in place. When the buffer is full, or another input claimed the space after the first
    part, the first part is copied into a new, larger buffer (its ``copied_from``) and the rest
    written after it. ``replaced`` is the buffer's ``copied_from``: an array whose views of the
    first ``keep`` tokens can be moved to this input's buffer, or ``None``. Without ``buffer``,
    everything goes into a new one.

    Raises:
        ValueError: ``buffer`` is given and the first part is not ``buffer.ids[:keep]``.
    """
    total = sum(int(p.shape[0]) for p in ids_parts)
    start = 0
    if buffer is not None and keep > 0:
        first = ids_parts[0] if ids_parts else None
        if first is None or first.shape[0] != keep or first.ctypes.data != buffer.ids.ctypes.data:
            raise ValueError("the first part is not the kept prefix of the buffer")
        start = 1
        if buffer.used != keep or total > buffer.capacity:
            # full, or something claimed the space after the kept input: carry it over
            grown = ContextBuffer(_capacity(total))
            grown.ids[:keep] = buffer.ids[:keep]
            grown.prov[:keep] = buffer.prov[:keep]
            grown.copied_from = buffer.ids
            buffer = grown
    else:
        buffer, keep = ContextBuffer(_capacity(total)), 0
    pos = keep
    for ids, prov in zip(ids_parts[start:], prov_parts[start:]):
        m = int(ids.shape[0])
        buffer.ids[pos:pos + m] = ids
        buffer.prov[pos:pos + m] = prov
        pos += m
    buffer.used = total
    input_ids, input_prov = buffer.ids[:total], buffer.prov[:total]
    input_ids.flags.writeable = False
    input_prov.flags.writeable = False
    return input_ids, input_prov, buffer, buffer.copied_from
