"""``mini-swe-agent``: the SWE-agent team's minimal agent, unmodified (PyPI ``mini-swe-agent``).

Installed into its own virtual environment (it brings litellm and friends). Command,
tool-calling mode::

    mini -m openai/<model> -t "<instruction>" -y --exit-immediately -c mini.yaml \
         -c model.model_kwargs.api_base=<proxy>/v1 [-c agent.step_limit=N] -o <exec>/trajectory.json

with ``OPENAI_API_KEY`` = the execution's key, ``MSWEA_CONFIGURED=true``,
``MSWEA_COST_TRACKING=ignore_errors`` (unknown models have no price), ``MSWEA_SILENT_STARTUP=1``,
``LITELLM_LOCAL_MODEL_COST_MAP=True`` (no download) and its global config dir inside the
execution's home. It runs each command in a subshell of its working directory (the
workspace) and stops when a command prints ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``; the final
message is the submission from the trajectory file.

Roles: mini-swe-agent has no sub-agents, no compaction and no auxiliary calls (traces): every
call is main.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gyre.harness.execution import LaunchContext, LaunchSpec
from gyre.harness.install import HarnessPackage, PackagedHarness
from gyre.harness.roles import RoleRules

__all__ = ["MiniSweAgentHarness", "MINI_SWE_AGENT_PACKAGE", "MINI_SWE_AGENT_ROLES"]

MINI_SWE_AGENT_PACKAGE = HarnessPackage("pypi", "mini-swe-agent", "2.4.6", "mini", "mini-swe-agent")

MINI_SWE_AGENT_ROLES = RoleRules("mini-swe-agent", (), notes="no sub-agents, compaction or auxiliary calls; "
                                 "no session headers (plain openai-python through litellm).")


class MiniSweAgentHarness(PackagedHarness):
    """mini-swe-agent in tool-calling mode (module docstring).

    Args:
        version / binary: as for :class:`~gyre.harness.ClaudeCodeHarness` (``$GYRE_MINI_SWE_AGENT_BIN``).
        model: model name (sent as ``openai/<model>``; default: the endpoint's).
        step_limit: ``agent.step_limit`` (0: none).
        config: config file names / ``key=value`` overrides passed with ``-c`` after ``mini.yaml``.
    """

    name = "mini-swe-agent"
    package = MINI_SWE_AGENT_PACKAGE
    binary_env = "GYRE_MINI_SWE_AGENT_BIN"
    title = "mini-swe-agent"
    roles = MINI_SWE_AGENT_ROLES

    def __init__(self, *, version: str | None = None, binary: str | None = None, model: str | None = None,
                 step_limit: int = 0, config: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(version=version, binary=binary, **kwargs)
        self.model, self.step_limit, self.config = model, step_limit, list(config)

    def build_command(self, ctx: LaunchContext) -> LaunchSpec:
        exe = self.installed_executable()
        cfg_dir = ctx.dirs.home / ".config" / "mini-swe-agent"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        argv = [str(exe), "-m", f"openai/{self.model or ctx.endpoint.model}", "-t", ctx.task.instruction, "-y",
                "--exit-immediately", "-c", "mini.yaml", "-c",
                f"model.model_kwargs.api_base={ctx.endpoint.openai_base_url}",
                "-c", f"agent.step_limit={self.step_limit}", "-c", "agent.cost_limit=0"]
        for c in self.config:
            argv += ["-c", c]
        argv += ["-o", str(ctx.dirs.root / "trajectory.json")]
        env = {"OPENAI_API_KEY": ctx.endpoint.api_key, "MSWEA_CONFIGURED": "true",
               "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_GLOBAL_CONFIG_DIR": str(cfg_dir),
               "MSWEA_SILENT_STARTUP": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        return LaunchSpec(argv, env)

    def final_message(self, ctx: LaunchContext) -> str | None:
        try:
            data = json.loads((ctx.dirs.root / "trajectory.json").read_text())
        except (OSError, ValueError):
            return None
        info = data.get("info") if isinstance(data, dict) else None
        sub = info.get("submission") if isinstance(info, dict) else None
        return sub if isinstance(sub, str) else None
