"""``command``: any program as a harness (custom harnesses, tests).

The command gets the endpoint in its environment -- ``GYRE_BASE_URL`` (proxy root),
``GYRE_OPENAI_BASE_URL`` / ``OPENAI_BASE_URL`` (``.../v1``), ``ANTHROPIC_BASE_URL``,
``GYRE_API_KEY`` / ``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY``, ``GYRE_MODEL`` -- plus
``GYRE_INSTRUCTION`` (the task text), ``GYRE_WORKSPACE`` and ``GYRE_FINAL_MESSAGE_FILE``.
``{instruction}``, ``{workspace}`` and ``{final_message_file}`` in ``argv`` are replaced too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gyre.harness.base import Harness
from gyre.harness.execution import LaunchContext, LaunchSpec
from gyre.harness.roles import RoleRules

__all__ = ["CommandHarness"]


class CommandHarness(Harness):
    """Run ``argv`` (module docstring); ``roles`` defaults to "every call is main"."""

    name = "command"

    def __init__(self, argv: Sequence[str], *, roles: RoleRules | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not argv:
            raise ValueError("argv must not be empty")
        self.argv = [str(a) for a in argv]
        self.roles = roles or RoleRules("command")  # type: ignore[misc]

    def build_command(self, ctx: LaunchContext) -> LaunchSpec:
        ep = ctx.endpoint
        subst = {"{instruction}": ctx.task.instruction, "{workspace}": str(ctx.dirs.workspace),
                 "{final_message_file}": str(ctx.dirs.final_message_path)}
        argv = []
        for a in self.argv:
            for k, v in subst.items():
                a = a.replace(k, v)
            argv.append(a)
        env = {"GYRE_BASE_URL": ep.base_url, "GYRE_OPENAI_BASE_URL": ep.openai_base_url,
               "OPENAI_BASE_URL": ep.openai_base_url, "ANTHROPIC_BASE_URL": ep.anthropic_base_url,
               "GYRE_API_KEY": ep.api_key, "OPENAI_API_KEY": ep.api_key, "ANTHROPIC_API_KEY": ep.api_key,
               "GYRE_MODEL": ep.model, "GYRE_INSTRUCTION": ctx.task.instruction,
               "GYRE_WORKSPACE": str(ctx.dirs.workspace), "GYRE_FINAL_MESSAGE_FILE": str(ctx.dirs.final_message_path)}
        return LaunchSpec(argv, env)
