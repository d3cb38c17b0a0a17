"""Addressing the places of a JSON value by path, for the request fuzzers (tests and bench/chaos.py)."""

from __future__ import annotations

import json
from typing import Any, Iterator


def json_paths(v: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every place of ``v`` as a tuple of keys / indices, the root ``()`` first."""
    yield prefix
    if isinstance(v, dict):
        for k, x in v.items():
            yield from json_paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from json_paths(x, prefix + (i,))


def json_replaced(v: Any, path: tuple, new: Any) -> Any:
    """A copy of ``v`` with the value at ``path`` replaced by ``new``."""
    if not path:
        return new
    v = json.loads(json.dumps(v))
    cur = v
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = new
    return v


def json_deleted(v: Any, path: tuple) -> Any:
    """A copy of ``v`` without the value at ``path`` (not the root)."""
    v = json.loads(json.dumps(v))
    cur = v
    for p in path[:-1]:
        cur = cur[p]
    del cur[path[-1]]
    return v
