"""``--config FILE.yaml``: flag defaults from a YAML mapping, type-checked like the flags.

Keys are flag names with ``-`` or ``_`` (``steps-per-burst`` or ``steps_per_burst``); an unknown
key, a value of the wrong type or outside the flag's choices is an :class:`ArgumentError` naming
the key.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gyre.arguments.values import ArgumentError, positive_int, role_list


def _actions_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}


def _coerce(action: argparse.Action, key: str, value: Any) -> Any:
    """Type-check one YAML value the way the flag would; raise ArgumentError naming ``key``."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                           argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ArgumentError(f"config key '{key}': expected true or false, got {value!r}")
        return value
    if value is None:
        return None
    numeric = action.type in (int, float, positive_int)
    if isinstance(value, dict) or (isinstance(value, list) and action.type is not role_list):
        raise ArgumentError(f"config key '{key}': expected a scalar, got {type(value).__name__}")
    if isinstance(value, bool) and numeric:
        raise ArgumentError(f"config key '{key}': expected a number, got {value!r}")
    try:
        if isinstance(value, list):
            converted = role_list(value)
        else:
            converted = action.type(str(value)) if action.type is not None else value
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ArgumentError(f"config key '{key}': invalid value {value!r} ({exc})") from None
    if action.choices is not None and converted not in action.choices:
        raise ArgumentError(
            f"config key '{key}': invalid choice {value!r} (choose from {', '.join(map(str, action.choices))})")
    return converted


def load_config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Read ``path`` (YAML mapping of flag names to values) into ``{dest: value}``.

    Raises:
        ArgumentError: unreadable file, not a mapping, unknown key or invalid value.
    """
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ArgumentError(f"config {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ArgumentError(f"config {path}:{where} not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(f"config {path}: expected a mapping of flag names to values")
    actions = _actions_by_key(parser)
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions:
            raise ArgumentError(f"config key '{key}': unknown (not a flag of {parser.prog})")
        out[dest] = _coerce(actions[dest], str(key), value)
    return out
