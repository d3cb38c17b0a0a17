"""Reward validity: the pure retry policy, the RewardManager shell, placeholders, assessment provenance."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from gyre.arguments import parse_args
from gyre.evaluation import (
    ActionKind,
    Assessment,
    AssessmentLog,
    AssessmentRecord,
    AssessmentStatus,
    EvaluationTarget,
    Evaluator,
    ExecutionClosure,
    ExecutionOutcome,
    OutcomeStatus,
    PreservedWorkspace,
    RetryPolicy,
    RetryState,
    RewardManager,
    TerminationStatus,
    placeholder_tree,
)
from gyre.trajectory import materialize, sample_trajectories

from .helpers import FakeClock

U, V = AssessmentStatus.UNRESOLVED, AssessmentStatus.VALID


# --------------------------------------------------------------------------- pure policy


def test_backoff_schedule_and_default_budget():
    p = RetryPolicy(max_retries=4, attempt_timeout_s=10, backoff_s=1, backoff_factor=2, backoff_max_s=3)
    assert [p.backoff(k) for k in range(1, 5)] == [1, 2, 3, 3]
    assert p.max_attempts == 5
    assert p.budget_s == 5 * 10 + (1 + 2 + 3 + 3)
    with pytest.raises(ValueError):
        p.backoff(0)
    for bad in (dict(max_retries=-1), dict(attempt_timeout_s=0), dict(backoff_factor=0.5), dict(budget_s=0)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


def test_retry_state_walks_attempts_waits_and_exhaustion():
    s = RetryState(RetryPolicy(max_retries=2, attempt_timeout_s=10, backoff_s=1, budget_s=100))
    act = s.next_action(0.0)
    assert (act.kind, act.attempt, act.timeout_s) == (ActionKind.EVALUATE, 1, 10)
    assert s.begin(0.0) == 1
    with pytest.raises(RuntimeError):
        s.next_action(1.0)  # attempt 1 still running
    s.finish(U, 3.0)
    act = s.next_action(3.5)
    assert (act.kind, act.attempt, act.not_before) == (ActionKind.WAIT, 2, 4.0)
    with pytest.raises(RuntimeError):
        s.begin(3.5)  # too early
    assert s.begin(4.0) == 2
    s.finish(U, 6.0)
    assert s.next_action(6.0).not_before == 8.0  # backoff doubles
    assert s.begin(9.0) == 3
    s.finish(U, 9.5)
    act = s.next_action(1000.0)
    assert act.kind is ActionKind.EXHAUSTED and "3 attempts" in act.reason
    assert [a.attempt for a in s.attempts] == [1, 2, 3]


def test_retry_state_stops_at_the_first_valid_attempt():
    s = RetryState(RetryPolicy(max_retries=5))
    s.begin(0.0)
    s.finish(V, 1.0)
    assert s.resolved and s.next_action(2.0).kind is ActionKind.VALID
    with pytest.raises(RuntimeError):
        s.begin(2.0)
    with pytest.raises(RuntimeError):
        s.finish(V, 3.0)


def test_budget_limits_attempts_and_their_timeouts():
    s = RetryState(RetryPolicy(max_retries=10, attempt_timeout_s=10, backoff_s=1, backoff_factor=1, budget_s=25))
    s.begin(0.0)
    s.finish(U, 10.0)
    act = s.next_action(10.0)
    assert act.kind is ActionKind.WAIT and act.timeout_s == 10
    s.begin(11.0)
    s.finish(U, 21.0)
    act = s.next_action(22.0)
    assert act.kind is ActionKind.EVALUATE and act.timeout_s == pytest.approx(3.0)  # only 3 s of budget left
    s.begin(22.0)
    s.finish(U, 24.5)
    act = s.next_action(24.5)  # the backoff would end at 25.5 >= deadline 25
    assert act.kind is ActionKind.EXHAUSTED and "budget" in act.reason


def test_the_execution_deadline_bounds_retries_but_not_the_first_attempt():
    s = RetryState(RetryPolicy(max_retries=10, attempt_timeout_s=10, backoff_s=1, backoff_factor=1), retry_until=5.0)
    act = s.next_action(7.0)  # already past the execution's deadline: the first attempt still runs, at full limit
    assert act.kind is ActionKind.EVALUATE and act.timeout_s == 10
    s.begin(7.0)
    s.finish(U, 8.0)
    act = s.next_action(8.0)
    assert act.kind is ActionKind.EXHAUSTED and act.reason == "unresolved after 1 attempts; the execution's time budget is spent"
    s = RetryState(RetryPolicy(max_retries=10, attempt_timeout_s=10, backoff_s=1, backoff_factor=1), retry_until=14.0)
    s.begin(0.0)
    s.finish(U, 10.0)
    act = s.next_action(11.0)
    assert act.kind is ActionKind.EVALUATE and act.timeout_s == pytest.approx(3.0)  # the retry ends at the deadline
    s.begin(11.0)
    s.finish(U, 13.5)
    assert s.next_action(13.5).kind is ActionKind.EXHAUSTED  # the backoff would end at 14.5 >= 14


def test_policy_from_args():
    p = RetryPolicy.from_args(parse_args(["--eval-max-retries", "2", "--eval-timeout-s", "30",
                                          "--eval-retry-backoff-s", "0.5", "--eval-budget-s", "200"]))
    assert (p.max_retries, p.attempt_timeout_s, p.backoff_s, p.budget_s) == (2, 30.0, 0.5, 200.0)
    assert RetryPolicy.from_args(parse_args([])).budget_s == RetryPolicy(3, 300.0, 5.0).default_budget_s()


# --------------------------------------------------------------------------- the shell


class Scripted(Evaluator):
    """Plays a script of outcomes: a float (valid score), None (unresolved) or an exception to raise.
    Each attempt takes ``cost_s`` seconds of the fake clock."""

    def __init__(self, script, clock: FakeClock, cost_s: float = 2.0, name: str = "tests"):
        self.script, self.clock, self.cost_s, self.name = list(script), clock, cost_s, name
        self.seen: list[tuple[EvaluationTarget, float | None]] = []

    def evaluate(self, target, *, timeout_s=None):
        self.seen.append((target, timeout_s))
        self.clock.advance(self.cost_s)
        step = self.script.pop(0) if self.script else RuntimeError("script exhausted")
        if isinstance(step, BaseException):
            raise step
        if step is None:
            return Assessment.unresolved("could not parse", target.assessed_ref, duration_s=self.cost_s)
        return Assessment.valid_score(step, target.assessed_ref, {"n": len(self.seen)}, self.cost_s)


def closure(eid="exec-1", term=TerminationStatus.COMPLETED):
    ws = PreservedWorkspace(Path("/nonexistent"), "sha256:abc", "feature-x")
    return ExecutionClosure(eid, term, ws, instruction="fix it", execution_key="key-1")


def manager(clock, **policy):
    policy.setdefault("backoff_s", 1.0)
    return RewardManager(RetryPolicy(**policy), clock=clock, sleep=clock.sleep)


def test_crashes_twice_then_succeeds_records_three_attempts(clock):
    ev = Scripted([RuntimeError("boom"), RuntimeError("boom again"), 0.75], clock)
    m = manager(clock, max_retries=3)
    out = m.assess(closure(), ev)
    assert (out.status, out.reward, out.attempts, out.assessed_ref, out.branch) == (
        OutcomeStatus.VALID, 0.75, 3, "sha256:abc", "feature-x")
    recs = m.log.records("exec-1")
    assert [(r.attempt, r.status, r.designated) for r in recs] == [(1, U, True), (2, U, True), (3, V, True)]
    assert "boom" in recs[0].details["reason"] and math.isnan(recs[0].score)
    assert m.log.designated("exec-1") is recs[2] and recs[2].score == 0.75
    assert clock.sleeps == [1.0, 2.0]
    # every attempt saw the same preserved state; attempt numbers count up
    assert {(t.workspace, t.assessed_ref) for t, _ in ev.seen} == {(closure().workspace.path, "sha256:abc")}
    assert [t.attempt for t, _ in ev.seen] == [1, 2, 3]
    assert ev.seen[0][0].execution_key == "key-1" and ev.seen[0][0].instruction == "fix it"


def test_always_crashing_evaluator_is_excluded_after_the_budget(clock):
    ev = Scripted([RuntimeError("down")] * 10, clock)
    m = manager(clock, max_retries=3)
    out = m.assess(closure(), ev)
    assert out.status is OutcomeStatus.EXCLUDED and out.reward is None and not out.has_reward
    assert out.attempts == 4 and "4 attempts" in out.reason
    assert len(m.log.records("exec-1")) == 4 and m.log.designated("exec-1") is None
    assert all(r.status is U for r in m.log.records("exec-1"))


def test_time_budget_exhaustion_and_shrinking_timeouts(clock):
    ev = Scripted([None] * 10, clock, cost_s=10.0)
    m = manager(clock, max_retries=10, attempt_timeout_s=10, backoff_factor=1.0, budget_s=25)
    out = m.assess(closure(), ev)
    assert out.status is OutcomeStatus.EXCLUDED and "budget" in out.reason
    assert [round(t, 6) for _, t in ev.seen] == [10.0, 10.0, 3.0]  # attempt 3 gets what the budget left


def test_a_non_assessment_return_is_unresolved(clock):
    class Bad(Evaluator):
        name = "bad"

        def evaluate(self, target, *, timeout_s=None):
            return 0.5

    out = manager(clock, max_retries=1).assess(closure(), Bad())
    assert out.status is OutcomeStatus.EXCLUDED and out.attempts == 2


def test_unresolved_then_valid_zero_is_a_real_zero(clock):
    out = manager(clock, max_retries=2).assess(closure(), Scripted([None, 0.0], clock))
    assert (out.status, out.reward, out.attempts) == (OutcomeStatus.VALID, 0.0, 2)


def test_termination_status_is_recorded_beside_the_reward_never_seen_by_the_evaluator(clock):
    m = manager(clock)
    rewards = {}
    for term in TerminationStatus:
        if term is TerminationStatus.SETUP_FAILED:
            continue
        ev = Scripted([0.5], clock)
        out = m.assess(closure(f"e-{term.value}", term), ev)
        rewards[term] = (out.reward, out.termination)
        (target, _), = ev.seen
        assert not any("termination" in f.name or "elapsed" in f.name for f in dataclasses.fields(target))
    assert rewards == {t: (0.5, t) for t in rewards}


def test_auxiliary_assessments_are_recorded_but_never_supply_the_reward(clock):
    m = manager(clock)
    out = m.assess(closure(), Scripted([0.25], clock, name="tests"),
                   auxiliary=[Scripted([1.0], clock, name="style"), Scripted([RuntimeError("x")], clock, name="lint")])
    assert out.reward == 0.25
    recs = m.log.records("exec-1")
    assert [(r.evaluator, r.designated, r.status) for r in recs] == [("tests", True, V), ("style", False, V),
                                                                       ("lint", False, U)]
    assert m.log.designated("exec-1").evaluator == "tests"


def test_placeholder_for_complete_failures(clock):
    m = manager(clock)
    c = ExecutionClosure("exec-9", TerminationStatus.SETUP_FAILED, None)
    out = m.assess(c, Scripted([], clock))
    assert (out.status, out.reward, out.has_reward, out.attempts) == (OutcomeStatus.PLACEHOLDER, 0.0, True, 0)
    rec = m.log.designated("exec-9")
    assert rec.evaluator == "placeholder" and rec.score == 0.0 and rec.attempt == 0
    # the dummy trajectory: an empty tree -> no admitted trajectory, no rows, no tokens
    tree = placeholder_tree("exec-9")
    adm = sample_trajectories(tree, np.random.default_rng(0))
    assert adm.trajectories == [] and adm.num_targets == 0
    assert materialize(tree, adm, advantage=-1.0) == []


def test_outcome_invariants():
    with pytest.raises(ValueError, match="never a zero"):
        ExecutionOutcome("e", OutcomeStatus.EXCLUDED, 0.0, TerminationStatus.TIMEOUT)
    with pytest.raises(ValueError):
        ExecutionOutcome("e", OutcomeStatus.VALID, None, TerminationStatus.TIMEOUT)
    with pytest.raises(ValueError):
        ExecutionOutcome("e", OutcomeStatus.VALID, math.nan, TerminationStatus.TIMEOUT)
    with pytest.raises(ValueError):
        ExecutionOutcome("e", OutcomeStatus.PLACEHOLDER, 1.0, TerminationStatus.SETUP_FAILED)
    with pytest.raises(ValueError):
        Assessment(math.inf, AssessmentStatus.VALID, "r")
    assert math.isnan(Assessment(0.3, AssessmentStatus.UNRESOLVED, "r").score)  # unresolved carries no score


# --------------------------------------------------------------------------- provenance


def rec(eid, attempt, status=V, score=1.0, designated=True, evaluator="tests", details=None):
    return AssessmentRecord(eid, evaluator, designated, attempt, f"sha256:{attempt}", "main", status,
                            score if status is V else math.nan, 0.1, float(attempt), details or {})


def test_log_is_append_only_and_never_overwrites(tmp_path):
    log = AssessmentLog()
    d = {"k": [1]}
    first = log.append(rec("a", 1, U, details=d))
    d["k"].append(2)  # mutating the caller's dict does not reach the stored record
    log.append(rec("b", 1))
    log.append(rec("a", 2, V, 0.5))
    log.append(rec("a", 3, V, 0.9))  # a later valid assessment does not replace the designated one
    assert first.details == {"k": [1]}
    assert [r.attempt for r in log.records("a")] == [1, 2, 3]
    assert log.designated("a").score == 0.5 and log.attempts("a") == 3 and len(log) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.score = 1.0  # type: ignore[misc]
    assert isinstance(log.records(), tuple)


def test_log_jsonl_roundtrip(tmp_path):
    path = tmp_path / "assessments.jsonl"
    log = AssessmentLog(path)
    log.append(rec("a", 1, U, details={"reason": "timeout"}))
    log.append(rec("a", 2, V, 0.75, details={"junit": {"tests": 4}}))
    log.close()
    again = AssessmentLog.load(path)
    assert again.records() == log.records()
    assert math.isnan(again.records("a")[0].score)
    again.append(rec("b", 1))
    again.close()
    assert len(path.read_text().splitlines()) == 3
