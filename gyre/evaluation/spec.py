"""Build an evaluator from a task's evaluator spec (plain data from the task file).

Spec shapes (YAML/JSON mappings)::

    {type: executable, command: "pytest -q --junitxml={junit_xml}" | [argv...],
     scoring: junit | exit_code | stdout_score | "pkg.mod:fn",     # default: --custom-rm-path, else junit
     timeout_s: 300, env: {..}, junit_skipped: fail | exclude, name: tests}
    {type: judge, rubric: "...", model: policy, score_scale: 10, max_turns: 8, max_tokens: 1024,
     timeout_s: 300, base_url: "http://host:port/v1", name: judge}
    {type: composite, components: [{weight: 0.7, <spec>}, {weight: 0.3, <spec>}]}

Extension point by dotted path, slime style: ``scoring`` (or ``--custom-rm-path`` when a task
names no rule) is ``module:function`` or ``module.function`` taking a
:class:`~gyre.evaluation.CheckResult`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from gyre.evaluation.assessment import Evaluator
from gyre.evaluation.composite import CompositeEvaluator
from gyre.evaluation.executable import ExecutableCheck
from gyre.evaluation.judge import AgenticJudge

__all__ = ["evaluator_from_spec"]


def evaluator_from_spec(
    spec: Mapping[str, Any],
    *,
    default_rule: str | None = None,
    default_timeout_s: float = 300.0,
    judge_base_url: str | None = None,
    judge_model: str | None = None,
    judge_api_key: str | None = None,
    eval_root: str | os.PathLike[str] | None = None,
    command_runner: Callable[..., Any] | None = None,
) -> Evaluator:
    """Build the evaluator a task spec describes (module docstring).

    Args:
        default_rule: scoring rule when an executable spec names none (``--custom-rm-path``).
        default_timeout_s: per-check limit when the spec names none (``--eval-timeout-s``).
        judge_base_url: OpenAI-compatible base URL (``http://host:port/v1``) of judges whose spec
            names no ``base_url`` (in the main job: the run's proxy, or ``--judge-base-url``).
        judge_model: ``model`` of judges whose spec names none (default ``policy``).
        judge_api_key: key judges send instead of the execution's key (``--judge-api-key-env``).
        eval_root: where executable checks create evaluation directories.
        command_runner: runs executable checks' commands (``None``: as ordinary processes;
            see :class:`~gyre.evaluation.ExecutableCheck`).

    Raises:
        ValueError: unknown type, missing fields, or a judge without ``judge_base_url``.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"evaluator spec must be a mapping, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind == "executable":
        if "command" not in spec:
            raise ValueError("executable evaluator spec needs 'command'")
        return ExecutableCheck(
            spec["command"],
            scoring=spec.get("scoring") or default_rule or "junit",
            timeout_s=float(spec.get("timeout_s", default_timeout_s)),
            env={str(k): str(v) for k, v in (spec.get("env") or {}).items()},
            junit_skipped=spec.get("junit_skipped", "fail"),
            readonly_source=spec.get("readonly_source", "auto"),
            eval_root=eval_root,
            name=spec.get("name", "executable"),
            command_runner=command_runner,
        )
    if kind == "judge":
        if "rubric" not in spec:
            raise ValueError("judge evaluator spec needs 'rubric'")
        base = spec.get("base_url") or judge_base_url
        if not base:
            raise ValueError("judge evaluator needs the proxy base URL (judge_base_url)")
        return AgenticJudge(
            base, rubric=str(spec["rubric"]), model=spec.get("model") or judge_model or "policy",
            api_key=judge_api_key,
            timeout_s=float(spec.get("timeout_s", default_timeout_s)), max_turns=int(spec.get("max_turns", 8)),
            max_tokens=int(spec.get("max_tokens", 1024)),
            score_scale=float(spec.get("score_scale", 1.0)), name=spec.get("name", "judge"),
        )
    if kind == "composite":
        comps = spec.get("components") or []
        if not comps:
            raise ValueError("composite evaluator spec needs 'components'")
        built = [(evaluator_from_spec({k: v for k, v in c.items() if k != "weight"}, default_rule=default_rule,
                                      default_timeout_s=default_timeout_s, judge_base_url=judge_base_url,
                                      judge_model=judge_model, judge_api_key=judge_api_key,
                                      eval_root=eval_root, command_runner=command_runner),
                  float(c.get("weight", 1.0))) for c in comps]
        return CompositeEvaluator(built, name=spec.get("name", "composite"))
    raise ValueError(f"unknown evaluator type {kind!r}; expected executable, judge or composite")
