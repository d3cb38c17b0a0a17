"""Executable checks on real tiny pytest workspaces: scoring rules, unresolved cases, isolation, limits."""

from __future__ import annotations

import math
import os
import textwrap
import time
from pathlib import Path

import pytest

from gyre.evaluation import (
    AssessmentStatus,
    EvaluationTarget,
    ExecutableCheck,
    ExecutionClosure,
    OutcomeStatus,
    RetryPolicy,
    RewardManager,
    TerminationStatus,
    preserve_workspace,
    readonly_mounts_supported,
    tree_digest,
)

from .helpers import JUNIT_3_OF_4 as JUNIT, FAST_ENV, PYTEST_CMD, PYTHON, FakeClock, canned_command, write_workspace


def check(**kw) -> ExecutableCheck:
    kw.setdefault("timeout_s", 60.0)
    kw.setdefault("env", FAST_ENV)
    return ExecutableCheck(kw.pop("command", PYTEST_CMD), **kw)


def target_for(ws, attempt: int = 1) -> EvaluationTarget:
    return EvaluationTarget("exec-1", ws.path, ws.ref, ws.branch, attempt)


@pytest.fixture
def preserved(workspace, tmp_path):
    return preserve_workspace(workspace, tmp_path / "snap", branch="main")


def test_fraction_passed_three_of_four(preserved, tmp_path):
    before = tree_digest(preserved.path)
    a = check(eval_root=tmp_path / "evals").evaluate(target_for(preserved))
    assert a.status is AssessmentStatus.VALID and a.score == 0.75
    assert a.assessed_ref == preserved.ref and preserved.ref == before
    assert a.details["junit"] == {"tests": 4, "passed": 3, "failures": 1, "errors": 0, "skipped": 0}
    assert a.details["returncode"] == 1 and a.duration_s > 0
    assert tree_digest(preserved.path) == before
    assert list((tmp_path / "evals").iterdir()) == []  # evaluation directory removed


def test_all_pass_and_valid_zero(tmp_path):
    ws = preserve_workspace(write_workspace(tmp_path / "ok", passing=4), tmp_path / "s1")
    assert check().evaluate(target_for(ws)).score == 1.0
    broken = write_workspace(tmp_path / "bad")
    (broken / "calc.py").write_text("raise ImportError('broken by the agent')\n")
    ws0 = preserve_workspace(broken, tmp_path / "s0")
    a = check().evaluate(target_for(ws0))
    assert a.status is AssessmentStatus.VALID and a.score == 0.0  # a collection error is a real 0
    assert a.details["junit"]["errors"] >= 1


def test_exit_code_rule(preserved):
    assert check(command=canned_command(rc=1), scoring="exit_code").evaluate(target_for(preserved)).score == 0.0
    assert check(command=canned_command(rc=0), scoring="exit_code").evaluate(target_for(preserved)).score == 1.0
    ok = preserved
    a = check(command=["sh", "-c", "exit 127"], scoring="exit_code").evaluate(target_for(ok))
    assert a.status is AssessmentStatus.UNRESOLVED and math.isnan(a.score)
    a = check(command=["/no/such/binary"], scoring="exit_code").evaluate(target_for(ok))
    assert a.status is AssessmentStatus.UNRESOLVED  # 127 from the read-only wrapper, or could not start


def test_stdout_score_rule(preserved):
    def run(script):
        return check(command=["sh", "-c", script], scoring="stdout_score").evaluate(target_for(preserved))

    a = run("echo grading; echo; echo 0.1; echo")  # last non-empty line, whatever the exit status
    assert a.status is AssessmentStatus.VALID and a.score == 0.1
    assert run("echo 1.0; exit 1").score == 1.0
    for bad in ("echo not-a-number", "true", "echo 1.0; exit 127", "echo inf"):
        a = run(bad)
        assert a.status is AssessmentStatus.UNRESOLVED and math.isnan(a.score), bad


RULES = """
from gyre.evaluation import Unresolved

def half_if_any_pass(result):
    return (0.5 if result.junit.passed else 0.0), {"custom": True}

class Rules:
    @staticmethod
    def by_exit(result):
        return 1.0 - min(result.returncode, 1)

def crashes(result):
    raise RuntimeError("rule bug")

def undecided(result):
    raise Unresolved("cannot tell")

def nothing(result):
    return None

def nan(result):
    return float("nan")
"""


def test_custom_rules_by_dotted_path(tmp_path, preserved, monkeypatch):
    (tmp_path / "my_rules.py").write_text(RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    cmd = canned_command()
    a = check(command=cmd, scoring="my_rules:half_if_any_pass").evaluate(target_for(preserved))
    assert (a.status, a.score, a.details["custom"]) == (AssessmentStatus.VALID, 0.5, True)
    assert check(command=cmd, scoring="my_rules.Rules.by_exit").evaluate(target_for(preserved)).score == 0.0
    assert check(command=cmd, scoring=lambda r: r.junit.passed / 8).evaluate(target_for(preserved)).score == 3 / 8
    for rule, reason in [("my_rules:crashes", "crashed"), ("my_rules:undecided", "cannot tell"),
                         ("my_rules:nothing", "no score"), ("my_rules:nan", "nan")]:
        a = check(command=cmd, scoring=rule).evaluate(target_for(preserved))
        assert a.status is AssessmentStatus.UNRESOLVED, rule
        assert reason in a.details["reason"], (rule, a.details["reason"])
    with pytest.raises(ModuleNotFoundError):
        check(scoring="no_such_module:rule")


def test_output_parse_failures_are_unresolved(preserved):
    cases = {
        "no report": ["sh", "-c", "exit 0"],
        "not xml": ["sh", "-c", "echo 'not xml' > \"$GYRE_EVAL_JUNIT_XML\""],
        "no tests": ["sh", "-c", "echo '<testsuite tests=\"0\"/>' > \"$GYRE_EVAL_JUNIT_XML\""],
    }
    for name, cmd in cases.items():
        a = check(command=cmd).evaluate(target_for(preserved))
        assert a.status is AssessmentStatus.UNRESOLVED and math.isnan(a.score), name
    # a shell-string command with placeholders works like an argv; other braces are left alone
    a = check(command="f() {{ :; }}; f; cp {eval_dir}/../canned.xml {junit_xml}").evaluate(target_for(preserved))
    assert a.status is AssessmentStatus.UNRESOLVED  # no such file: cp failed, no report
    a = check(command="test -d {workspace} && printf '%s' '" + JUNIT + "' > {junit_xml}").evaluate(
        target_for(preserved))
    assert a.score == 0.75


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_runs_forever_is_killed_at_its_limit_whole_group(preserved, tmp_path):
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os, signal, subprocess, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)          # forces the SIGKILL escalation
        child = subprocess.Popen(["sh", "-c", "trap '' TERM; while :; do sleep 0.05; done"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        while True:
            time.sleep(0.05)
    """)
    t0 = time.monotonic()
    a = check(command=[PYTHON, "-c", script], timeout_s=1.0, kill_grace_s=0.3).evaluate(target_for(preserved))
    elapsed = time.monotonic() - t0
    assert a.status is AssessmentStatus.UNRESOLVED and "limit" in a.details["reason"]
    assert a.details["timed_out"] is True and a.details["returncode"] is None
    assert 1.0 <= elapsed < 5.0
    leader, child = map(int, pids.read_text().split())
    deadline = time.monotonic() + 2
    while (_alive(leader) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(leader) and not _alive(child)


def test_background_process_left_by_a_finished_command_is_killed(preserved, tmp_path):
    pid_file = tmp_path / "bg.pid"
    cmd = ["sh", "-c", f"sleep 1000 & echo $! > {pid_file}; exit 0"]
    a = check(command=cmd, scoring="exit_code").evaluate(target_for(preserved))
    assert a.score == 1.0
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 2
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid)


def test_evaluator_cannot_write_outside_its_workspace_copy(tmp_path):
    live = tmp_path / "live"
    snap = tmp_path / "snap"
    probe = textwrap.dedent(f"""
        import os
        from pathlib import Path

        ORIGINAL = Path({str(snap)!r})

        def test_writes_land_in_the_copy():
            cwd = Path.cwd()
            assert cwd != ORIGINAL and ORIGINAL not in cwd.parents
            for var in ("HOME", "TMPDIR"):
                d = Path(os.environ[var])
                assert d.parent == cwd.parent  # inside the evaluation directory
                (d / "x.txt").write_text("scratch")
            Path("made_by_test.txt").write_text("in the copy")
            try:
                (ORIGINAL / "calc.py").write_text("def mul(a, b): return a * b\\n")
                (ORIGINAL / "planted.txt").write_text("escaped")
            except OSError:
                pass
    """)
    write_workspace(live, extra_tests=probe)
    ws = preserve_workspace(live, snap)
    before = tree_digest(snap)
    a = check().evaluate(target_for(ws))
    if readonly_mounts_supported():
        assert a.status is AssessmentStatus.VALID, a.details
        assert a.details["isolation"] == "copy+readonly-source"
        assert a.score == 4 / 5  # the probe test passes, mul still fails
        assert tree_digest(snap) == before
        assert not (snap / "planted.txt").exists() and not (snap / "made_by_test.txt").exists()
    else:  # without mount namespaces the write is not prevented, but it is detected
        assert a.status is AssessmentStatus.UNRESOLVED and a.details.get("source_modified")


def test_modification_of_the_source_is_detected_without_readonly_mounts(preserved):
    cmd = ["sh", "-c", f"echo tampered >> {preserved.path}/calc.py; exit 0"]
    a = check(command=cmd, scoring="exit_code", readonly_source="off").evaluate(target_for(preserved))
    assert a.status is AssessmentStatus.UNRESOLVED and a.details["source_modified"] is True
    assert a.details["isolation"] == "copy"
    # the preserved state no longer matches its ref: every later attempt is unresolved
    a = check().evaluate(target_for(preserved, attempt=2))
    assert a.status is AssessmentStatus.UNRESOLVED and "changed since preservation" in a.details["reason"]


def test_timed_out_execution_scores_like_a_completed_one(workspace, tmp_path):
    """Partial scoring: same preserved work -> same reward, whatever the termination."""
    manager = RewardManager(RetryPolicy(max_retries=0))
    outcomes = {}
    for term in (TerminationStatus.TIMEOUT, TerminationStatus.COMPLETED):
        ws = preserve_workspace(workspace, tmp_path / f"snap-{term.value}")
        closure = ExecutionClosure(f"exec-{term.value}", term, ws)
        outcomes[term] = manager.assess(closure, check())
    for term, out in outcomes.items():
        assert (out.status, out.reward, out.termination) == (OutcomeStatus.VALID, 0.75, term)
    assert len({o.assessed_ref for o in outcomes.values()}) == 1  # identical content, identical ref


def test_real_check_that_crashes_twice_then_succeeds(preserved, tmp_path):
    counter = tmp_path / "attempts"
    flaky = ("n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; "
             "[ $n -ge 3 ] || {{ echo 'evaluator infrastructure crashed' >&2; exit 3; }}; "
             "exec {{python}} -m pytest -q -p no:cacheprovider --junitxml={{junit_xml}}").format(c=counter)
    clock = FakeClock()
    manager = RewardManager(RetryPolicy(max_retries=3, backoff_s=1.0), clock=clock, sleep=clock.sleep)
    out = manager.assess(ExecutionClosure("exec-1", TerminationStatus.COMPLETED, preserved), check(command=flaky))
    assert (out.status, out.reward, out.attempts) == (OutcomeStatus.VALID, 0.75, 3)
    recs = manager.log.records("exec-1")
    assert [(r.attempt, r.status.value) for r in recs] == [(1, "unresolved"), (2, "unresolved"), (3, "valid")]
    assert "crashed" in recs[0].details["stderr_tail"]
    assert clock.sleeps == [1.0, 2.0]


def test_attempt_timeout_lowers_the_limit(preserved):
    a = check(command=["sleep", "5"], timeout_s=60.0, kill_grace_s=0.1).evaluate(target_for(preserved), timeout_s=0.3)
    assert a.status is AssessmentStatus.UNRESOLVED and a.details["timed_out"]
    assert a.duration_s < 3


def test_missing_workspace_and_bad_config(tmp_path):
    a = check().evaluate(EvaluationTarget("e", tmp_path / "gone", "ref"))
    assert a.status is AssessmentStatus.UNRESOLVED and "not found" in a.details["reason"]
    with pytest.raises(ValueError):
        ExecutableCheck([], timeout_s=1)
    with pytest.raises(ValueError):
        ExecutableCheck(PYTEST_CMD, readonly_source="maybe")
    with pytest.raises(ValueError):
        ExecutableCheck(PYTEST_CMD, timeout_s=0)


def test_keep_eval_dirs_for_debugging(preserved, tmp_path):
    a = check(command=canned_command(), keep_eval_dirs=True, eval_root=tmp_path / "ev").evaluate(target_for(preserved))
    d = Path(a.details["eval_dir"])
    assert (d / "junit.xml").is_file() and (d / "workspace" / "calc.py").is_file()
    assert d.name.startswith("exec-1-a1-") and os.path.dirname(d) == str(tmp_path / "ev")


def test_readonly_mount_failure_at_run_time_falls_back_or_is_unresolved(preserved, tmp_path, monkeypatch):
    """A filesystem refusing the bind mount: "auto" runs the check without it, "require" does not."""
    from gyre.evaluation import executable, process

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "mount").write_text("#!/bin/sh\nexit 32\n")  # every mount fails
    (fake_bin / "fake-unshare").write_text('#!/bin/sh\n[ "$1" = "--" ] && shift\nexec "$@"\n')
    for f in fake_bin.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setattr(process, "_readonly_prefix", lambda: (str(fake_bin / "fake-unshare"),))
    monkeypatch.setattr(executable, "readonly_mounts_supported", lambda: True)
    a = check(command=canned_command(), readonly_source="auto").evaluate(target_for(preserved))
    assert a.status is AssessmentStatus.VALID and a.score == 0.75 and a.details["isolation"] == "copy"
    a = check(command=canned_command(), readonly_source="require").evaluate(target_for(preserved))
    assert a.status is AssessmentStatus.UNRESOLVED and "read-only mount" in a.details["reason"]
