"""Harness adapters by name (``--harness``) and their construction from the run's arguments."""

from __future__ import annotations

import argparse
from typing import Any

from gyre.harness.base import Harness
from gyre.harness.claude_code import ClaudeCodeHarness
from gyre.harness.codex import CodexHarness
from gyre.harness.command import CommandHarness
from gyre.harness.mini_swe_agent import MiniSweAgentHarness
from gyre.harness.reference import ReferenceHarness

__all__ = ["HARNESSES", "make_harness", "harness_from_args"]

#: ``--harness`` choices and their adapters (``command`` is for tests and custom programs).
HARNESSES: dict[str, type[Harness]] = {
    "reference": ReferenceHarness,
    "claude-code": ClaudeCodeHarness,
    "codex": CodexHarness,
    "mini-swe-agent": MiniSweAgentHarness,
    "command": CommandHarness,
}


def make_harness(name: str, **options: Any) -> Harness:
    """The adapter called ``name`` with ``options`` (its constructor's keyword arguments).

    Raises:
        ValueError: unknown name (the message lists the known ones) or bad options.
    """
    try:
        cls = HARNESSES[name]
    except KeyError:
        raise ValueError(f"unknown harness {name!r} (known: {', '.join(HARNESSES)})") from None
    return cls(**options)


def harness_from_args(args: argparse.Namespace, *, context_window: int | None = None) -> Harness:
    """The run's harness from ``--harness`` and the harness flags of :mod:`gyre.arguments`.

    ``context_window`` (tokens; default ``--seq-length``) is the policy's context: the reference
    agent compacts at ``--reference-compact-threshold-tokens`` (default 75 % of it), Codex is
    configured with it (Claude Code reacts to the proxy's "prompt is too long" instead)."""
    common: dict[str, Any] = {"isolation": getattr(args, "harness_isolation", "auto"),
                              "default_timeout_s": args.execution_timeout_s}
    max_turns = getattr(args, "harness_max_turns", None)
    if args.harness == "reference":
        tools = getattr(args, "reference_tools", None)
        threshold = getattr(args, "reference_compact_threshold_tokens", None)
        if threshold is None:
            threshold = int(0.75 * (context_window or args.seq_length))
        opts: dict[str, Any] = {"compact_threshold_tokens": threshold,
                                "max_tokens": getattr(args, "rollout_max_new_tokens", None)}
        if tools:
            opts["tools"] = [t for t in tools.split(",") if t]
        if max_turns:
            opts["max_turns"] = max_turns
        if getattr(args, "reference_system_prompt", None) is not None:
            opts["system_prompt"] = args.reference_system_prompt
        return ReferenceHarness(**opts, **common)
    if args.harness == "claude-code":
        return ClaudeCodeHarness(max_turns=max_turns, **common)
    if args.harness == "codex":
        return CodexHarness(context_window=context_window or getattr(args, "seq_length", None), **common)
    if args.harness == "mini-swe-agent":
        return MiniSweAgentHarness(step_limit=max_turns or 0, **common)
    return make_harness(args.harness, **common)
