"""JUnit parsing, tree digests and snapshots, the composite evaluator, evaluator specs, the process runner."""

from __future__ import annotations

import math
import os

import pytest

from gyre.evaluation import (
    AgenticJudge,
    Assessment,
    AssessmentStatus,
    CompositeEvaluator,
    EvaluationTarget,
    Evaluator,
    ExecutableCheck,
    JUnitCounts,
    JUnitParseError,
    evaluator_from_spec,
    parse_junit_file,
    parse_junit_xml,
    preserve_workspace,
    run_command,
    tree_digest,
)

from .helpers import JUNIT_3_OF_4, canned_command

# --------------------------------------------------------------------------- junit


def test_junit_counts_per_testcase():
    c = parse_junit_xml(JUNIT_3_OF_4)
    assert c == JUnitCounts(tests=4, failures=1, errors=0, skipped=0) and c.passed == 3
    assert c.fraction_passed() == 0.75
    xml = """<testsuite tests="5"><testcase name="a"/><testcase name="b"><skipped/></testcase>
      <testcase name="c"><error message="collection"/></testcase><testcase name="d"><failure/><error/></testcase>
      <testcase name="e"/></testsuite>"""
    c = parse_junit_xml(xml)
    assert (c.tests, c.failures, c.errors, c.skipped, c.passed) == (5, 0, 2, 1, 2)
    assert c.fraction_passed("fail") == 2 / 5 and c.fraction_passed("exclude") == 2 / 4
    with pytest.raises(ValueError):
        c.fraction_passed("ignore")


def test_junit_suite_attributes_fallback_and_errors(tmp_path):
    xml = '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1"/><testsuite tests="2"/></testsuites>'
    assert parse_junit_xml(xml) == JUnitCounts(5, 1, 0, 1)
    with pytest.raises(ZeroDivisionError):
        parse_junit_xml('<testsuite tests="0"/>').fraction_passed()
    for bad in ("not xml", "<html/>"):
        with pytest.raises(JUnitParseError):
            parse_junit_xml(bad)
    with pytest.raises(JUnitParseError, match="no JUnit report"):
        parse_junit_file(tmp_path / "missing.xml")


# --------------------------------------------------------------------------- workspaces


def test_tree_digest_and_preserve(tmp_path):
    live = tmp_path / "live"
    (live / "pkg").mkdir(parents=True)
    (live / "pkg" / "a.py").write_text("x = 1\n")
    (live / "b.txt").write_text("b")
    os.symlink("pkg/a.py", live / "link")
    d0 = tree_digest(live)
    snap = preserve_workspace(live, tmp_path / "snap", branch="gyre/exec-1")
    assert snap.ref == d0 and snap.branch == "gyre/exec-1" and os.path.islink(snap.path / "link")
    assert tree_digest(snap.path) == d0
    (live / "b.txt").write_text("c")
    assert tree_digest(live) != d0  # content
    (live / "b.txt").write_text("b")
    assert tree_digest(live) == d0
    os.chmod(live / "b.txt", 0o755)
    assert tree_digest(live) != d0  # executable bit
    os.chmod(live / "b.txt", 0o644)
    (live / "empty").mkdir()
    assert tree_digest(live) != d0  # new directory
    with pytest.raises(FileExistsError):
        preserve_workspace(live, snap.path)
    with pytest.raises(FileNotFoundError):
        preserve_workspace(tmp_path / "nope", tmp_path / "x")


# --------------------------------------------------------------------------- composite


class Fixed(Evaluator):
    def __init__(self, name, score):
        self.name, self.score = name, score

    def evaluate(self, target, *, timeout_s=None):
        if self.score is None:
            return Assessment.unresolved("cannot tell", target.assessed_ref)
        if isinstance(self.score, Exception):
            raise self.score
        return Assessment.valid_score(self.score, target.assessed_ref)


def test_composite_weighted_and_unresolved(tmp_path):
    t = EvaluationTarget("e", tmp_path, "ref-1")
    a = CompositeEvaluator([(Fixed("tests", 0.75), 3.0), (Fixed("judge", 0.25), 1.0)]).evaluate(t)
    assert a.status is AssessmentStatus.VALID and a.score == pytest.approx((3 * 0.75 + 0.25) / 4)
    assert [c["evaluator"] for c in a.details["components"]] == ["tests", "judge"]
    for bad in (None, RuntimeError("x")):
        a = CompositeEvaluator([(Fixed("tests", 1.0), 1.0), (Fixed("judge", bad), 1.0)]).evaluate(t)
        assert a.status is AssessmentStatus.UNRESOLVED and math.isnan(a.score)  # a missing part is not a 0
        assert "judge" in a.details["reason"]
    with pytest.raises(ValueError):
        CompositeEvaluator([])
    with pytest.raises(ValueError):
        CompositeEvaluator([(Fixed("t", 1.0), 0.0)])


def test_evaluator_from_spec(tmp_path):
    ev = evaluator_from_spec({"type": "executable", "command": canned_command(), "timeout_s": 5, "name": "tests"})
    assert isinstance(ev, ExecutableCheck) and ev.rule_name == "junit" and ev.timeout_s == 5
    ev = evaluator_from_spec({"type": "executable", "command": "true"}, default_rule="exit_code")
    assert ev.rule_name == "exit_code"  # --custom-rm-path when the task names no rule
    comp = evaluator_from_spec(
        {"type": "composite", "components": [
            {"weight": 0.7, "type": "executable", "command": canned_command()},
            {"weight": 0.3, "type": "judge", "rubric": "be fair"}]},
        judge_base_url="http://127.0.0.1:1/v1")
    assert isinstance(comp, CompositeEvaluator)
    assert [type(e) for e, _ in comp.components] == [ExecutableCheck, AgenticJudge]
    assert [w for _, w in comp.components] == [0.7, 0.3]
    ws = preserve_workspace(_mkws(tmp_path), tmp_path / "snap")
    a = evaluator_from_spec({"type": "executable", "command": canned_command()}).evaluate(
        EvaluationTarget("e", ws.path, ws.ref))
    assert a.score == 0.75
    for bad in ({"type": "oracle"}, {"type": "executable"}, {"type": "judge", "rubric": "r"}, {"type": "composite"}):
        with pytest.raises(ValueError):
            evaluator_from_spec(bad)


def _mkws(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    (d / "f.txt").write_text("x")
    return d


# --------------------------------------------------------------------------- process runner


def test_run_command_basics(tmp_path):
    out, err = tmp_path / "o", tmp_path / "e"
    r = run_command(["sh", "-c", "echo hi; echo oops >&2; exit 3"], cwd=tmp_path, env={"PATH": os.environ["PATH"]},
                    timeout_s=5, stdout_path=out, stderr_path=err)
    assert (r.returncode, r.timed_out) == (3, False) and out.read_text() == "hi\n" and err.read_text() == "oops\n"
    with pytest.raises(ValueError):
        run_command(["true"], cwd=tmp_path, env={}, timeout_s=0, stdout_path=out, stderr_path=err)
    with pytest.raises(OSError):
        run_command(["/no/such/cmd"], cwd=tmp_path, env={}, timeout_s=1, stdout_path=out, stderr_path=err)
