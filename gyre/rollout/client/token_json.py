"""JSON text of a long token-id array, written by table lookup instead of number formatting.

SGLang's HTTP API takes a prompt as a JSON list of ids, and a black-box harness's prompt grows to
~700k tokens, so rank 0 writes that list on every call.  orjson formats the numbers one by one;
this module looks each id up in a table of fixed-width decimal slots instead: 7 characters, the
number right-aligned after spaces, then a comma (``"   1234,"``), gathered by one numpy ``take``
of 8-byte words. The spaces are JSON whitespace, so any JSON parser reads the same list; the text
is 8 bytes per id instead of ~6.3, which gives back part of the gain when it is sent (the times
are in docs/proxy.md, "The prompt sent to the engine").

:func:`dumps_with_ids` serialises a request body whose ``input_ids`` is a 1-D integer array
this way, into one buffer (optionally handed out as it is, without a copy into ``bytes``), and
everything else with orjson; bodies it cannot help (short, negative or very large ids, batched
prompts) go to orjson whole.

The table is built once per process, for the largest id seen so far (at least 2**17 slots, 1 MiB);
building it takes several times its size for a moment. :func:`prepare_table` builds it ahead for a
vocabulary, so that no call pays for it (the proxy does at its start).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import orjson

#: Below this many ids orjson is as fast as the lookup.
MIN_IDS = 4096
#: Widest table built: 2**20 slots (8 MiB), for vocabularies of up to 1,048,576 ids.
MAX_TABLE = 1 << 20
_SLOT = 8          # bytes per id: 7 characters of right-aligned decimal digits, then a comma
_DIGITS = _SLOT - 1

_lock = threading.Lock()
_table = np.zeros(0, np.uint64)


def decimal_slots(size: int) -> np.ndarray:
    """The table: ``size`` 8-byte slots as ``uint64`` words, slot ``i`` holding ``f"{i:>7},"``."""
    if not 0 <= size <= 10 ** _DIGITS:
        raise ValueError(f"a table of {size} slots does not fit {_DIGITS} digits")
    values = np.arange(size, dtype=np.int64)
    chars = np.full((size, _SLOT), ord(" "), dtype=np.uint8)
    chars[:, _DIGITS] = ord(",")
    for place in range(_DIGITS):
        digit = (values // 10 ** place) % 10
        shown = values >= 10 ** place if place else np.ones(size, dtype=bool)
        chars[:, _DIGITS - 1 - place] = np.where(shown, ord("0") + digit, ord(" "))
    return chars.view(np.uint64).reshape(size)


def _table_for(max_id: int) -> np.ndarray | None:
    global _table
    table = _table
    if max_id < len(table):
        return table
    if max_id >= MAX_TABLE:
        return None
    size = 1 << max(17, int(max_id).bit_length())
    with _lock:
        if len(_table) < size:
            _table = decimal_slots(size)
        return _table


def prepare_table(vocab_size: int) -> bool:
    """Build the table for the ids of a ``vocab_size``-token vocabulary now, unless it is built;
    whether the table covers them (``False`` for a vocabulary wider than ``MAX_TABLE``)."""
    return vocab_size <= 0 or _table_for(vocab_size - 1) is not None


def ids_text(ids: np.ndarray, out: np.ndarray | None = None) -> memoryview | None:
    """``ids`` (1-D, integer) as the inside of a JSON list (no brackets), gathered into ``out``
    (``uint64``, one word per id) when given; ``None`` when the table cannot write them (no ids,
    negative ids, or ids of ``MAX_TABLE`` and above)."""
    if len(ids) == 0 or int(ids.min()) < 0:
        return None
    table = _table_for(int(ids.max()))
    if table is None:
        return None
    # mode="clip": no bounds check (the ids were checked against the table), so ``out`` is
    # written directly instead of through a buffered copy
    slots = np.take(table, ids if ids.dtype.kind == "i" else ids.astype(np.intp), out=out, mode="clip")
    return memoryview(slots).cast("B")[:-1]          # no comma after the last id


#: The body's start, 16 bytes (spaces before the bracket), so that the slots after it are 8-byte aligned.
_HEAD = b'{"input_ids":  ['


def dumps_with_ids(body: Any, option: int = 0, *, buffer: bool = False) -> bytes | memoryview:
    """``body`` as JSON bytes, as ``orjson.dumps(body, option=option)`` would write it up to
    whitespace and key order; a long 1-D integer array under ``"input_ids"`` is written by
    :func:`ids_text` straight into the body's buffer. With ``buffer`` that body comes back as a
    ``memoryview`` of the buffer, not copied into ``bytes`` (aiohttp sends a memoryview as it is,
    httpx does not take one)."""
    ids = body.get("input_ids") if isinstance(body, dict) else None
    if not (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind in "iu" and len(ids) >= MIN_IDS):
        return orjson.dumps(body, option=option)
    rest = orjson.dumps({k: v for k, v in body.items() if k != "input_ids"}, option=option)
    tail = b"," + rest[1:] if len(rest) > 2 else b"}"
    end = len(_HEAD) + _SLOT * len(ids)
    buf = np.empty(end + len(tail), np.uint8)        # pages are touched only as they are written
    if ids_text(ids, out=buf[len(_HEAD):end].view(np.uint64)) is None:
        return orjson.dumps(body, option=option)
    buf[:len(_HEAD)] = np.frombuffer(_HEAD, np.uint8)
    buf[end - 1] = ord("]")                              # the last id's comma
    buf[end:] = np.frombuffer(tail, np.uint8)
    return memoryview(buf) if buffer else buf.tobytes()
