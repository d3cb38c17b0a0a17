"""``claude-code``: Anthropic's Claude Code CLI, unmodified (npm ``@anthropic-ai/claude-code``).

:class:`ClaudeCodeHarness` runs ``claude -p "<instruction>"`` in print mode with JSON output,
pointed at the proxy (``ANTHROPIC_BASE_URL``) with the execution's key, non-essential traffic
and telemetry off; the final answer is the ``result`` of the JSON object it prints.

Compaction: Claude Code compacts *reactively* when the proxy answers HTTP 400 "prompt is too
long" (the proxy's ``max_context_tokens``), and proactively when its context passes
``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` percent of the window it assumes for the model (1M tokens
for an unknown model name; ``autocompact_pct``).

Roles (from request logs): compaction requests append "...create a detailed summary of the
conversation so far..." to the last user message; sub-agent requests carry
``x-claude-code-agent-id``; requests without tools (title generation, interactive mode only)
are auxiliary; everything else is main.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gyre.harness.execution import LaunchContext, LaunchSpec
from gyre.harness.install import HarnessPackage, PackagedHarness
from gyre.harness.roles import RoleRule, RoleRules

__all__ = ["ClaudeCodeHarness", "CLAUDE_CODE_PACKAGE", "CLAUDE_CODE_ROLES"]

#: The version the traces were recorded with.
CLAUDE_CODE_PACKAGE = HarnessPackage("npm", "@anthropic-ai/claude-code", "2.1.332", "claude", "claude-code")

CLAUDE_CODE_ROLES = RoleRules("claude-code", (
    RoleRule("compaction", prompt_pattern=r"create a detailed summary of the conversation so far",
             description="auto-compaction prompt appended to the last user message"),
    RoleRule("subagent", header="x-claude-code-agent-id", description="only sub-agent requests carry it"),
    RoleRule("auxiliary", no_tools=True, description="title generation and other tool-less helpers"),
), notes="X-Claude-Code-Session-Id is shared by main and sub-agents; system block 1 (billing header) "
         "changes between roles and must be ignored when matching prefixes.")


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


class ClaudeCodeHarness(PackagedHarness):
    """Claude Code in headless mode::

        claude -p "<instruction>" --dangerously-skip-permissions --output-format json [--model M] [--max-turns N]

    with ``HOME`` = the execution's home, ``ANTHROPIC_BASE_URL`` = the proxy root,
    ``ANTHROPIC_API_KEY`` = the execution's key, and non-essential traffic, telemetry,
    auto-update and error reporting off (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``,
    ``DISABLE_TELEMETRY``, ``DISABLE_AUTOUPDATER``, ``DISABLE_ERROR_REPORTING``);
    ``IS_SANDBOX=1`` lets the permission bypass run as root.

    Args:
        version: npm version to install (default: the traced one).
        binary: a preinstalled ``claude`` (default ``$GYRE_CLAUDE_CODE_BIN``, else the cache).
        model: ``--model`` (default: the endpoint's model name).
        max_turns: ``--max-turns``, when set.
        autocompact_pct: ``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` (1-100), when set.
        extra_args: appended to the command.
        **kwargs: :class:`~gyre.harness.Harness` options.
    """

    name = "claude-code"
    package = CLAUDE_CODE_PACKAGE
    binary_env = "GYRE_CLAUDE_CODE_BIN"
    title = "Claude Code"
    roles = CLAUDE_CODE_ROLES

    def __init__(self, *, version: str | None = None, binary: str | None = None, model: str | None = None,
                 max_turns: int | None = None, autocompact_pct: int | None = None, extra_args: Sequence[str] = (),
                 **kwargs: Any) -> None:
        super().__init__(version=version, binary=binary, **kwargs)
        self.model, self.max_turns, self.extra_args = model, max_turns, list(extra_args)
        if autocompact_pct is not None and not 1 <= autocompact_pct <= 100:
            raise ValueError(f"autocompact_pct must be in [1, 100], got {autocompact_pct}")
        self.autocompact_pct = autocompact_pct

    def build_command(self, ctx: LaunchContext) -> LaunchSpec:
        exe = self.installed_executable()
        argv = [str(exe), "-p", ctx.task.instruction, "--dangerously-skip-permissions", "--output-format", "json",
                "--model", self.model or ctx.endpoint.model]
        if self.max_turns is not None:
            argv += ["--max-turns", str(self.max_turns)]
        argv += self.extra_args
        env = {"ANTHROPIC_BASE_URL": ctx.endpoint.anthropic_base_url, "ANTHROPIC_API_KEY": ctx.endpoint.api_key,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
               "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1", "IS_SANDBOX": "1"}
        if self.autocompact_pct is not None:
            env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] = str(self.autocompact_pct)
        return LaunchSpec(argv, env)

    def final_message(self, ctx: LaunchContext) -> str | None:
        try:
            text = ctx.dirs.log_path.read_text(errors="replace")
        except OSError:
            return None
        obj = last_json_object(text)
        if obj is None or obj.get("type") != "result":
            return None
        result = obj.get("result")
        return result if isinstance(result, str) else None
