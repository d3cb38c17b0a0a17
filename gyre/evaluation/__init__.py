"""Evaluator interface, executable checks, agentic judge, partial scoring, reward validity.

Every closed execution is assessed on its preserved workspace (paper §5.2). Flow for one::

    ws = preserve_workspace(live_dir, snapshot_dir)                 # harness launcher, at closure
    closure = ExecutionClosure(execution_id, TerminationStatus.TIMEOUT, ws, instruction, key)
    evaluator = EvaluatorSettings.from_args(args).build(task, proxy_url + "/v1")   # custom rule, judge
    outcome = reward_manager.assess(closure, evaluator, retry_until=deadline)    # retries, provenance log
    events = trajectory_buffer.record_outcome(outcome, tree)        # gyre.buffer: readiness

Modules: :mod:`~gyre.evaluation.assessment` (interface), :mod:`~gyre.evaluation.executable`
(tests on a workspace copy), :mod:`~gyre.evaluation.judge` (model with a rubric, role
``evaluator``), :mod:`~gyre.evaluation.composite`, :mod:`~gyre.evaluation.validity` (pure retry
policy), :mod:`~gyre.evaluation.provenance` (append-only assessment log),
:mod:`~gyre.evaluation.rewards` (shell: outcomes, exclusion, placeholders),
:mod:`~gyre.evaluation.workspace` (snapshots, digests), :mod:`~gyre.evaluation.process`
(process-group runner), :mod:`~gyre.evaluation.junit`, :mod:`~gyre.evaluation.spec`,
:mod:`~gyre.evaluation.settings` (the run's flags that shape evaluators).
"""

from gyre.evaluation.assessment import Assessment, AssessmentStatus, EvaluationTarget, Evaluator, Unresolved
from gyre.evaluation.composite import CompositeEvaluator
from gyre.evaluation.executable import (
    BUILTIN_RULES,
    CheckResult,
    ExecutableCheck,
    exit_code_rule,
    stdout_score_rule,
    fraction_passed_rule,
    load_callable,
    resolve_scoring_rule,
)
from gyre.evaluation.judge import AgenticJudge, parse_score
from gyre.evaluation.junit import JUnitCounts, JUnitParseError, parse_junit_file, parse_junit_xml
from gyre.evaluation.process import CommandRun, readonly_mounts_supported, run_command
from gyre.evaluation.provenance import AssessmentLog, AssessmentRecord
from gyre.evaluation.rewards import (
    ExecutionClosure,
    ExecutionOutcome,
    OutcomeStatus,
    RewardManager,
    TerminationStatus,
    placeholder_tree,
)
from gyre.evaluation.settings import EvaluatorSettings
from gyre.evaluation.spec import evaluator_from_spec
from gyre.evaluation.validity import ActionKind, AttemptInfo, NextAction, RetryPolicy, RetryState
from gyre.evaluation.workspace import PreservedWorkspace, preserve_workspace, tree_digest

__all__ = [
    "ActionKind",
    "AgenticJudge",
    "Assessment",
    "AssessmentLog",
    "AssessmentRecord",
    "AssessmentStatus",
    "AttemptInfo",
    "BUILTIN_RULES",
    "CheckResult",
    "CommandRun",
    "CompositeEvaluator",
    "EvaluationTarget",
    "Evaluator",
    "EvaluatorSettings",
    "ExecutableCheck",
    "ExecutionClosure",
    "ExecutionOutcome",
    "JUnitCounts",
    "JUnitParseError",
    "NextAction",
    "OutcomeStatus",
    "PreservedWorkspace",
    "RetryPolicy",
    "RetryState",
    "RewardManager",
    "TerminationStatus",
    "Unresolved",
    "evaluator_from_spec",
    "exit_code_rule",
    "stdout_score_rule",
    "fraction_passed_rule",
    "load_callable",
    "parse_junit_file",
    "parse_junit_xml",
    "parse_score",
    "placeholder_tree",
    "preserve_workspace",
    "readonly_mounts_supported",
    "resolve_scoring_rule",
    "run_command",
    "tree_digest",
]
