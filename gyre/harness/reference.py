"""``reference``: Gyre's own agent (:mod:`gyre.harness.reference_agent`) as a child process.

Command: ``<python> -m gyre.harness.reference_agent --base-url <proxy>/v1 --model <m>
--instruction-file <exec>/home/instruction.txt --workdir <workspace> ...`` with ``GYRE_API_KEY``
in its environment and Gyre's source directory on ``PYTHONPATH``. Its final answer lands in
``final_message.txt``, its JSONL transcript in ``agent_transcript.jsonl``.

Roles: every request carries ``X-Gyre-Role`` (``main`` / ``subagent`` / ``compaction``) and
``X-Gyre-Agent-Id``; without the headers, the compaction prompt (``Context compaction:``) and the
sub-agent system prompt (``You are a sub-agent``) identify them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre.harness.base import Harness
from gyre.harness.execution import LaunchContext, LaunchSpec
from gyre.harness.reference_agent.tools import ALL_TOOLS
from gyre.harness.roles import RoleRule, RoleRules

__all__ = ["ReferenceHarness", "REFERENCE_ROLES"]

#: Gyre's source root (the directory holding the ``gyre`` package).
_SOURCE_ROOT = Path(__file__).resolve().parents[2]

REFERENCE_ROLES = RoleRules("reference", (
    RoleRule("compaction", header="x-gyre-role", header_pattern=r"^compaction$", description="role header"),
    RoleRule("subagent", header="x-gyre-role", header_pattern=r"^subagent$", description="role header"),
    RoleRule("auxiliary", header="x-gyre-role", header_pattern=r"^auxiliary$", description="role header"),
    RoleRule("compaction", prompt_pattern=r"^Context compaction:", description="compaction prompt"),
    RoleRule("subagent", prompt_pattern=r"^You are a sub-agent", prompt_scope="system",
             description="sub-agent system prompt"),
), notes="X-Gyre-Role is authoritative; X-Gyre-Agent-Id names the context owner (main, sub-1, ...).")


class ReferenceHarness(Harness):
    """The reference agent (module docstring).

    Args:
        max_turns / max_subagent_turns: model calls of the main agent / each sub-agent.
        compact_threshold_tokens: context size (tokens) above which the agent compacts (0: never).
        tools: tool names offered (subset of :data:`~gyre.harness.reference_agent.ALL_TOOLS`).
        system_prompt: replaces the default system prompt (``""``: none).
        max_tokens / temperature: sent with every request when set.
        bash_timeout_s: limit of one shell command (seconds).
        python: interpreter that runs the agent (default: this one).
        **kwargs: :class:`~gyre.harness.Harness` options.

    Raises:
        ValueError: unknown tool names or a bad limit.
    """

    name = "reference"
    roles = REFERENCE_ROLES

    def __init__(self, *, max_turns: int = 30, max_subagent_turns: int = 10, compact_threshold_tokens: int = 0,
                 tools: Sequence[str] = ALL_TOOLS, system_prompt: str | None = None, max_tokens: int | None = None,
                 temperature: float | None = None, bash_timeout_s: float = 60.0, python: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        unknown = [t for t in tools if t not in ALL_TOOLS]
        if unknown:
            raise ValueError(f"unknown reference-agent tools {unknown} (known: {', '.join(ALL_TOOLS)})")
        if max_turns < 1 or max_subagent_turns < 1 or compact_threshold_tokens < 0:
            raise ValueError("max_turns/max_subagent_turns must be >= 1 and compact_threshold_tokens >= 0")
        self.max_turns, self.max_subagent_turns = max_turns, max_subagent_turns
        self.compact_threshold_tokens = compact_threshold_tokens
        self.tools = list(tools)
        self.system_prompt, self.max_tokens, self.temperature = system_prompt, max_tokens, temperature
        self.bash_timeout_s = bash_timeout_s
        self.python = python or sys.executable

    def build_command(self, ctx: LaunchContext) -> LaunchSpec:
        instr = ctx.dirs.home / "instruction.txt"
        instr.write_text(ctx.task.instruction)
        argv = [self.python, "-m", "gyre.harness.reference_agent", "--base-url", ctx.endpoint.openai_base_url,
                "--model", ctx.endpoint.model, "--instruction-file", str(instr), "--workdir", str(ctx.dirs.workspace),
                "--tools", ",".join(self.tools), "--max-turns", str(self.max_turns),
                "--max-subagent-turns", str(self.max_subagent_turns),
                "--compact-threshold-tokens", str(self.compact_threshold_tokens),
                "--bash-timeout-s", str(self.bash_timeout_s),
                "--final-message-file", str(ctx.dirs.final_message_path),
                "--transcript-file", str(ctx.dirs.root / "agent_transcript.jsonl")]
        if self.system_prompt is not None:
            argv += ["--system-prompt", self.system_prompt]
        if self.max_tokens is not None:
            argv += ["--max-tokens", str(self.max_tokens)]
        if self.temperature is not None:
            argv += ["--temperature", str(self.temperature)]
        return LaunchSpec(argv, {"GYRE_API_KEY": ctx.endpoint.api_key, "PYTHONPATH": str(_SOURCE_ROOT),
                                 "PYTHONDONTWRITEBYTECODE": "1"})
