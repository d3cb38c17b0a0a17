"""The value types of Gyre's flags (argparse ``type=`` callables) and the names they accept.

Each raises :class:`argparse.ArgumentTypeError` with the reason, which argparse and the
``--config`` loader (:mod:`gyre.arguments.config_file`) turn into one line naming the flag or key.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from gyre.sandbox.spec import Environment, parse_size

ROLES = ("main", "subagent", "compaction", "auxiliary", "evaluator")
PLACEMENTS = ("elastic", "async", "colocate")
HARNESS_NAMES = ("reference", "claude-code", "codex", "mini-swe-agent")


class ArgumentError(Exception):
    """A bad flag, config key or value; :func:`gyre.arguments.parse_args` turns it into exit status 2."""


def host_port(text: str) -> str:
    """``HOST:PORT`` with a port in [1, 65535]."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def ratio_above_one(text: str) -> float:
    """A number > 1."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not v > 1:
        raise argparse.ArgumentTypeError(f"must be > 1, got {text}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def size(text: str) -> int:
    """A size in bytes (``32m``, ``4g``, ...; :func:`gyre.sandbox.spec.parse_size`), at least 1."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def size_or_none(text: str) -> int | None:
    """A size in bytes, or ``None`` for ``none``, ``0`` or ``off`` (no limit)."""
    if text.strip().lower() in ("none", "0", "off"):
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def environment(text: str) -> str:
    """A task environment (:class:`gyre.sandbox.spec.Environment`), in its canonical spelling."""
    try:
        return Environment.parse(text).describe()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def role_list(text: str | Sequence[str]) -> list[str]:
    """Role classes of :data:`ROLES`, comma-separated (or a YAML list), none repeated."""
    items = [r.strip() for r in text.split(",")] if isinstance(text, str) else [str(r) for r in text]
    for r in items:
        if r not in ROLES:
            raise argparse.ArgumentTypeError(f"unknown role {r!r} (expected one of {', '.join(ROLES)})")
    if len(set(items)) != len(items):
        raise argparse.ArgumentTypeError("roles must not repeat")
    return items
