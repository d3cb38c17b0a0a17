"""Checks of JSON request bodies shared by the SGLang-native parsers (:mod:`gyre.rollout.api.sglang_api`,
:mod:`gyre.rollout.api.sglang_control_api`): each raises :class:`ProtocolError` with a one-line
message, which the embedded server answers with HTTP 400."""

from __future__ import annotations

import math
from typing import Any, Mapping


class ProtocolError(ValueError):
    """A request body that breaks the contract; the server answers HTTP 400 with ``{"error": ...}``."""


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def want_int(name: str, x: Any, lo: int | None = None, hi: int | None = None) -> int:
    if not is_int(x):
        raise ProtocolError(f"{name} must be an integer, got {type(x).__name__} {x!r}"[:300])
    if lo is not None and x < lo:
        raise ProtocolError(f"{name} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise ProtocolError(f"{name} must be <= {hi}, got {x}")
    return x


def want_float(name: str, x: Any, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float:
    if not is_number(x):
        raise ProtocolError(f"{name} must be a finite number, got {x!r}"[:300])
    x = float(x)
    if lo is not None and (x < lo or (lo_open and x == lo)):
        raise ProtocolError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {x}")
    if hi is not None and x > hi:
        raise ProtocolError(f"{name} must be <= {hi}, got {x}")
    return x


def want_bool(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise ProtocolError(f"{name} must be true or false, got {x!r}"[:300])
    return x


def want_object(name: str, x: Any) -> dict:
    if not isinstance(x, dict):
        raise ProtocolError(f"{name} must be a JSON object, got {type(x).__name__}")
    return x


def check_keys(name: str, body: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        raise ProtocolError(f"{name}: unknown field(s) {', '.join(unknown)[:200]}")


def opt_bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    return False if value is None else want_bool(key, value)
