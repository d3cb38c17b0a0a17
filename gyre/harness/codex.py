"""``codex``: OpenAI's Codex CLI, unmodified (npm ``@openai/codex``).

Command::

    codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox --json \
        --output-last-message <exec>/final_message.txt "<instruction>"   < /dev/null

with ``CODEX_HOME`` = ``<exec>/home/.codex`` holding a generated ``config.toml``: a model
provider ``gyre`` at ``<proxy>/v1`` with ``wire_api = "responses"`` and ``env_key =
"GYRE_API_KEY"``, approvals ``never``, sandbox ``danger-full-access``, update checks, analytics,
feedback and OpenTelemetry off. Stdin is closed (otherwise it waits for more input).

Roles (from the traces): compaction requests say ``"request_kind":"compaction"`` in
``x-codex-turn-metadata`` (and carry "CONTEXT CHECKPOINT COMPACTION" in the last user
message); sub-agent threads send ``x-openai-subagent``; everything else is main.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gyre.harness.execution import LaunchContext, LaunchSpec
from gyre.harness.install import HarnessPackage, PackagedHarness
from gyre.harness.roles import RoleRule, RoleRules

__all__ = ["CodexHarness", "CODEX_PACKAGE", "CODEX_ROLES", "codex_config_toml"]

CODEX_PACKAGE = HarnessPackage("npm", "@openai/codex", "0.171.0", "codex", "codex")

CODEX_ROLES = RoleRules("codex", (
    RoleRule("compaction", header="x-codex-turn-metadata", header_pattern=r'"request_kind"\s*:\s*"compaction"',
             description="turn metadata of the local (memento) compaction request"),
    RoleRule("compaction", prompt_pattern=r"CONTEXT CHECKPOINT COMPACTION", description="compaction prompt"),
    RoleRule("subagent", header="x-openai-subagent", description="spawned agent threads"),
    RoleRule("auxiliary", no_tools=True, description="tool-less helper requests"),
), notes="session-id is the parent thread for sub-agents; x-codex-window-id increments after compaction.")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def codex_config_toml(base_url: str, model: str, *, env_key: str = "GYRE_API_KEY",
                      settings: Mapping[str, Any] | None = None) -> str:
    """The ``config.toml`` of one execution (module docstring); ``settings`` adds top-level keys
    (e.g. ``model_context_window``, ``model_auto_compact_token_limit``)."""
    top = {"model": model, "model_provider": "gyre", "approval_policy": "never",
           "sandbox_mode": "danger-full-access", "check_for_update_on_startup": False, **(settings or {})}
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    lines += ["", "[model_providers.gyre]", 'name = "gyre"', f"base_url = {_toml_value(base_url)}",
              f"env_key = {_toml_value(env_key)}", 'wire_api = "responses"', "request_max_retries = 4",
              "stream_max_retries = 3", "stream_idle_timeout_ms = 600000",
              "", "[analytics]", "enabled = false", "", "[feedback]", "enabled = false",
              "", "[otel]", 'exporter = "none"', ""]
    return "\n".join(lines)


class CodexHarness(PackagedHarness):
    """Codex CLI in ``exec`` mode (module docstring).

    Args:
        version / binary: as for :class:`~gyre.harness.ClaudeCodeHarness` (``$GYRE_CODEX_BIN``).
        model: model name in the config (default: the endpoint's).
        context_window: the policy's context size (tokens) -> ``model_context_window``; Codex
            then compacts by itself at ``auto_compact_tokens`` (default 80 % of the window ->
            ``model_auto_compact_token_limit``). Codex does not compact when the proxy answers
            "prompt is too long" -- it exits -- so set this to the proxy's limit or below.
        settings: extra top-level ``config.toml`` keys (override the above).
        extra_args: appended before the instruction.
    """

    name = "codex"
    package = CODEX_PACKAGE
    binary_env = "GYRE_CODEX_BIN"
    title = "Codex"
    roles = CODEX_ROLES

    def __init__(self, *, version: str | None = None, binary: str | None = None, model: str | None = None,
                 context_window: int | None = None, auto_compact_tokens: int | None = None,
                 settings: Mapping[str, Any] | None = None, extra_args: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(version=version, binary=binary, **kwargs)
        self.model, self.extra_args = model, list(extra_args)
        base: dict[str, Any] = {}
        if context_window is not None:
            if context_window < 1:
                raise ValueError(f"context_window must be >= 1, got {context_window}")
            base["model_context_window"] = int(context_window)
            base["model_auto_compact_token_limit"] = int(auto_compact_tokens or 0.8 * context_window)
        elif auto_compact_tokens is not None:
            base["model_auto_compact_token_limit"] = int(auto_compact_tokens)
        self.settings = {**base, **(settings or {})}

    def build_command(self, ctx: LaunchContext) -> LaunchSpec:
        exe = self.installed_executable()
        codex_home = ctx.dirs.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config_toml(
            ctx.endpoint.openai_base_url, self.model or ctx.endpoint.model, settings=self.settings))
        argv = [str(exe), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--json",
                "--output-last-message", str(ctx.dirs.final_message_path), *self.extra_args, ctx.task.instruction]
        return LaunchSpec(argv, {"CODEX_HOME": str(codex_home), "GYRE_API_KEY": ctx.endpoint.api_key})
