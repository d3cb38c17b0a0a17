"""Harness adapters (claude-code, codex, mini-swe-agent, reference agent) and workspaces.

How the main job runs one execution (each in its own thread; all calls are thread-safe)::

    harness = harness_from_args(args)                          # once; then harness.ensure_installed()
    ex = proxy.register_execution(execution_id, task_id=task.id, harness=harness.name,
                                  role_rules=harness.roles)            # the adapter's role rules
    result = harness.run(task, args.run_dir, execution_id,     # workspace -> child -> closure
                         ProxyEndpoint(proxy.url, ex.api_key),
                         timeout_s=task.timeout_s or args.execution_timeout_s,
                         model_calls=lambda: proxy.counters(execution_id)["calls"],
                         on_launch=lambda r: running.update({execution_id: r}))  # r.cancel() later
    outcome = reward_manager.assess(result.closure(task, ex.api_key), task.build_evaluator(...))
    proxy.close_execution(execution_id)                        # after a judge has used the key

The interface and the execution lifecycle are in :mod:`gyre.harness.base`; the child process
(process group, time limit, isolation) in :mod:`gyre.harness.process`; role declarations in
:mod:`gyre.harness.roles`; installs from the registries in :mod:`gyre.harness.install`; Gyre's
own agent in :mod:`gyre.harness.reference_agent`.
"""

from gyre.harness.base import (
    FINAL_MESSAGE_KEY,
    ExecutionDir,
    Harness,
    HarnessResult,
    HarnessUnavailable,
    LaunchContext,
    LaunchSpec,
    ProxyEndpoint,
    RunningExecution,
    executions_root,
)
from gyre.harness.claude_code import CLAUDE_CODE_PACKAGE, CLAUDE_CODE_ROLES, ClaudeCodeHarness
from gyre.harness.codex import CODEX_PACKAGE, CODEX_ROLES, CodexHarness, codex_config_toml
from gyre.harness.command import CommandHarness
from gyre.harness.install import HarnessInstallError, HarnessPackage, ensure_package, harness_cache_dir
from gyre.harness.mini_swe_agent import MINI_SWE_AGENT_PACKAGE, MINI_SWE_AGENT_ROLES, MiniSweAgentHarness
from gyre.harness.process import HarnessProcess, ProcessExit, isolation_supported
from gyre.harness.reference import REFERENCE_ROLES, ReferenceHarness
from gyre.harness.registry import HARNESSES, harness_from_args, make_harness
from gyre.harness.roles import RoleRule, RoleRules, classify_role, request_texts

__all__ = [
    "CLAUDE_CODE_PACKAGE",
    "CLAUDE_CODE_ROLES",
    "CODEX_PACKAGE",
    "CODEX_ROLES",
    "ClaudeCodeHarness",
    "CodexHarness",
    "CommandHarness",
    "ExecutionDir",
    "FINAL_MESSAGE_KEY",
    "HARNESSES",
    "Harness",
    "HarnessInstallError",
    "HarnessPackage",
    "HarnessProcess",
    "HarnessResult",
    "HarnessUnavailable",
    "LaunchContext",
    "LaunchSpec",
    "MINI_SWE_AGENT_PACKAGE",
    "MINI_SWE_AGENT_ROLES",
    "MiniSweAgentHarness",
    "ProcessExit",
    "ProxyEndpoint",
    "REFERENCE_ROLES",
    "ReferenceHarness",
    "RoleRule",
    "RoleRules",
    "RunningExecution",
    "classify_role",
    "codex_config_toml",
    "ensure_package",
    "executions_root",
    "harness_cache_dir",
    "harness_from_args",
    "isolation_supported",
    "make_harness",
    "request_texts",
]
