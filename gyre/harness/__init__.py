"""Harness adapters (claude-code, codex, mini-swe-agent, reference agent) and workspaces.

How the main job runs one execution (each in its own thread; all calls are thread-safe)::

    harness = harness_from_args(args); harness.ensure_installed()           # once
    ex = proxy.register_execution(execution_id, task_id=task.id, harness=harness.name,
                                  role_rules=harness.roles)
    result = harness.run(task, args.run_dir, execution_id, ProxyEndpoint(proxy.url, ex.api_key),
                         timeout_s=..., model_calls=..., on_launch=...)     # workspace -> child -> closure
    outcome = reward_manager.assess(result.closure(task, ex.api_key), task.build_evaluator(...))
    proxy.close_execution(execution_id)                                     # after a judge used the key

The interface and lifecycle are in :mod:`gyre.harness.base` (an execution's data in
:mod:`gyre.harness.execution`), the child process in :mod:`gyre.sandbox` (the backends it runs
in), role declarations in :mod:`gyre.harness.roles`, registry installs in
:mod:`gyre.harness.install`, adapters by name in :mod:`gyre.harness.registry`. The adapters:
:mod:`gyre.harness.claude_code`, :mod:`gyre.harness.codex`, :mod:`gyre.harness.mini_swe_agent`,
:mod:`gyre.harness.command` (any program) and :mod:`gyre.harness.reference` (Gyre's own agent,
:mod:`gyre.harness.reference_agent`). Names are imported lazily (PEP 562), so a harness child does
not pay for imports it never uses.
"""

import importlib

_LAZY = {
    "CLAUDE_CODE_PACKAGE": "gyre.harness.claude_code",
    "CLAUDE_CODE_ROLES": "gyre.harness.claude_code",
    "CODEX_PACKAGE": "gyre.harness.codex",
    "CODEX_ROLES": "gyre.harness.codex",
    "ClaudeCodeHarness": "gyre.harness.claude_code",
    "CodexHarness": "gyre.harness.codex",
    "CommandHarness": "gyre.harness.command",
    "ExecutionDir": "gyre.harness.execution",
    "ExecutionUnresolved": "gyre.harness.base",
    "FINAL_MESSAGE_KEY": "gyre.harness.execution",
    "HARNESSES": "gyre.harness.registry",
    "Harness": "gyre.harness.base",
    "HarnessConfig": "gyre.harness.registry",
    "HarnessInstallError": "gyre.harness.install",
    "HarnessPackage": "gyre.harness.install",
    "HarnessResult": "gyre.harness.execution",
    "HarnessUnavailable": "gyre.harness.base",
    "LaunchContext": "gyre.harness.execution",
    "LaunchSpec": "gyre.harness.execution",
    "MINI_SWE_AGENT_PACKAGE": "gyre.harness.mini_swe_agent",
    "MINI_SWE_AGENT_ROLES": "gyre.harness.mini_swe_agent",
    "MiniSweAgentHarness": "gyre.harness.mini_swe_agent",
    "PackagedHarness": "gyre.harness.install",
    "ProcessExit": "gyre.sandbox.process",
    "ProxyEndpoint": "gyre.harness.execution",
    "REFERENCE_ROLES": "gyre.harness.reference",
    "ReferenceHarness": "gyre.harness.reference",
    "RoleRule": "gyre.harness.roles",
    "RoleRules": "gyre.harness.roles",
    "RunningExecution": "gyre.harness.base",
    "classify_role": "gyre.harness.roles",
    "codex_config_toml": "gyre.harness.codex",
    "ensure_package": "gyre.harness.install",
    "executions_root": "gyre.harness.execution",
    "harness_cache_dir": "gyre.harness.execution",
    "harness_from_args": "gyre.harness.registry",
    "harness_from_config": "gyre.harness.registry",
    "isolation_supported": "gyre.sandbox.process",
    "load_harness_class": "gyre.harness.registry",
    "make_harness": "gyre.harness.registry",
    "request_texts": "gyre.harness.roles",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gyre.harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)
