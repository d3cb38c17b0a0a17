"""Harness adapters by name or dotted path (``--harness``) and their construction from the run's arguments.

``--harness`` is one of the names in :data:`HARNESSES` or a dotted path ``pkg.module:Class`` to a
:class:`~gyre.harness.Harness` subclass, imported with :func:`gyre.evaluation.load_callable` (the
loader of tasks' ``scoring: pkg.mod:fn`` rules). :class:`HarnessConfig` holds the harness flags
of :mod:`gyre.arguments`, read once from the parsed arguments; :func:`harness_from_config` builds
the adapter from it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from gyre.harness.base import Harness, HarnessUnavailable
from gyre.harness.claude_code import ClaudeCodeHarness
from gyre.harness.codex import CodexHarness
from gyre.harness.command import CommandHarness
from gyre.harness.mini_swe_agent import MiniSweAgentHarness
from gyre.harness.reference import ReferenceHarness
from gyre.sandbox import (BackendUnavailable, Environment, ExecutionBackend, Limits, make_backend,
                          resolve_backend_name)

__all__ = ["HARNESSES", "HarnessConfig", "make_harness", "load_harness_class", "harness_from_config",
           "harness_from_args", "backend_from_config"]

#: Harness names and their adapters (``command`` is for tests and custom programs).
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


def load_harness_class(spec: str) -> type[Harness]:
    """The adapter class named ``spec``: a key of :data:`HARNESSES` or a dotted path ``pkg.module:Class``.

    Raises:
        ValueError: neither a known name nor a dotted path.
        ImportError / AttributeError: the module or the class is not found (or the module fails
            to import: whatever it raises).
        TypeError: the object is not a :class:`~gyre.harness.Harness` subclass.
    """
    if spec in HARNESSES:
        return HARNESSES[spec]
    if ":" not in spec and "." not in spec:
        raise ValueError(f"unknown harness {spec!r} (known: {', '.join(HARNESSES)}, or a dotted path "
                         f"'pkg.module:Class')")
    from gyre.evaluation import load_callable

    cls = load_callable(spec)
    if not (isinstance(cls, type) and issubclass(cls, Harness)):
        raise TypeError(f"{spec} is not a gyre.harness.Harness subclass")
    return cls


@dataclass(frozen=True, slots=True)
class HarnessConfig:
    """The harness flags of :mod:`gyre.arguments` (same names, same defaults).

    * ``harness`` -- ``--harness``: a name of :data:`HARNESSES` or ``pkg.module:Class``.
    * ``isolation`` -- ``--harness-isolation`` (``auto`` | ``require`` | ``off``).
    * ``execution_timeout_s`` -- ``--execution-timeout-s``: the adapter's default time limit.
    * ``max_turns`` -- ``--harness-max-turns`` (``None``: the adapter's own limit).
    * ``reference_tools`` -- ``--reference-tools``, comma-separated (``None`` or empty: all).
    * ``reference_compact_threshold_tokens`` -- ``--reference-compact-threshold-tokens``
      (``None``: 75 % of the context window).
    * ``reference_system_prompt`` -- ``--reference-system-prompt`` (``None``: the agent's own).
    * ``max_new_tokens`` -- ``--rollout-max-new-tokens``: the reference agent's ``max_tokens``.
    * ``seq_length`` -- ``--seq-length``: the context window when the caller gives none.
    * ``execution_backend`` -- ``--execution-backend`` (``auto`` | ``local`` | ``bwrap`` | ``podman`` | ``docker``).
    * ``execution_network`` -- ``--execution-network``: sandboxes get ordinary networking.
    * ``pids_limit`` / ``memory_limit`` / ``workspace_limit`` -- ``--execution-pids-limit``,
      ``--execution-memory-limit``, ``--execution-workspace-limit`` (bytes; ``None``: none).
    * ``docker_host`` -- ``--docker-host``: the daemon of the docker backend.
    * ``task_environment`` -- ``--task-environment``: the environment of tasks that name none.
    """

    harness: str = "reference"
    isolation: str = "auto"
    execution_timeout_s: float = 600.0
    max_turns: int | None = None
    reference_tools: str | None = None
    reference_compact_threshold_tokens: int | None = None
    reference_system_prompt: str | None = None
    max_new_tokens: int | None = 512
    seq_length: int = 4096
    execution_backend: str = "auto"
    execution_network: bool = False
    pids_limit: int | None = 1024
    memory_limit: int | None = 4 << 30
    workspace_limit: int | None = 10 << 30
    docker_host: str | None = None
    task_environment: str = "host"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HarnessConfig":
        """From parsed Gyre arguments (:func:`gyre.arguments.parse_args`)."""
        return cls(harness=args.harness, isolation=args.harness_isolation,
                   execution_timeout_s=float(args.execution_timeout_s), max_turns=args.harness_max_turns,
                   reference_tools=args.reference_tools,
                   reference_compact_threshold_tokens=args.reference_compact_threshold_tokens,
                   reference_system_prompt=args.reference_system_prompt,
                   max_new_tokens=args.rollout_max_new_tokens, seq_length=args.seq_length,
                   execution_backend=args.execution_backend, execution_network=args.execution_network,
                   pids_limit=args.execution_pids_limit, memory_limit=args.execution_memory_limit,
                   workspace_limit=args.execution_workspace_limit, docker_host=args.docker_host,
                   task_environment=args.task_environment)


def backend_from_config(cfg: HarnessConfig) -> ExecutionBackend:
    """The execution backend ``cfg`` names (``auto``: bwrap where it works, else local with a warning).

    Raises:
        HarnessUnavailable: the backend cannot run here (one line with the reason).
    """
    name = resolve_backend_name(cfg.execution_backend)
    options: dict[str, Any] = {}
    if name == "local":
        options["isolation"] = cfg.isolation
    elif name == "docker" and cfg.docker_host:
        options["host"] = cfg.docker_host
    try:
        return make_backend(name, **options)
    except BackendUnavailable as exc:
        raise HarnessUnavailable(str(exc)) from None


def harness_from_config(cfg: HarnessConfig, *, context_window: int | None = None) -> Harness:
    """The adapter ``cfg`` describes.

    ``context_window`` (tokens; default ``cfg.seq_length``) is the policy's context: the reference
    agent compacts at ``reference_compact_threshold_tokens`` (default 75 % of it), Codex is
    configured with it (Claude Code reacts to the proxy's "prompt is too long" instead). Every
    adapter gets ``isolation`` and ``default_timeout_s``; a dotted-path class gets only those.
    """
    window = context_window or cfg.seq_length
    common: dict[str, Any] = {"isolation": cfg.isolation, "default_timeout_s": cfg.execution_timeout_s,
                              "backend": backend_from_config(cfg), "network": cfg.execution_network,
                              "limits": Limits(pids=cfg.pids_limit, memory_bytes=cfg.memory_limit,
                                               workspace_bytes=cfg.workspace_limit),
                              "default_environment": Environment.parse(cfg.task_environment)}
    if cfg.harness == "reference":
        threshold = cfg.reference_compact_threshold_tokens
        if threshold is None:
            threshold = int(0.75 * window)
        opts: dict[str, Any] = {"compact_threshold_tokens": threshold, "max_tokens": cfg.max_new_tokens}
        if cfg.reference_tools:
            opts["tools"] = [t for t in cfg.reference_tools.split(",") if t]
        if cfg.max_turns:
            opts["max_turns"] = cfg.max_turns
        if cfg.reference_system_prompt is not None:
            opts["system_prompt"] = cfg.reference_system_prompt
        return ReferenceHarness(**opts, **common)
    if cfg.harness == "claude-code":
        return ClaudeCodeHarness(max_turns=cfg.max_turns, **common)
    if cfg.harness == "codex":
        return CodexHarness(context_window=window, **common)
    if cfg.harness == "mini-swe-agent":
        return MiniSweAgentHarness(step_limit=cfg.max_turns or 0, **common)
    return load_harness_class(cfg.harness)(**common)


def harness_from_args(args: argparse.Namespace, *, context_window: int | None = None) -> Harness:
    """The run's harness: :func:`harness_from_config` of :meth:`HarnessConfig.from_args`."""
    return harness_from_config(HarnessConfig.from_args(args), context_window=context_window)
