"""The example task sets load cleanly, materialise, and their evaluators work: each reference
solution scores 1.0 and the untouched workspace scores what its broken tests say."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gyre.evaluation import EvaluationTarget, preserve_workspace
from gyre.tasks import load_tasks, materialize_workspace

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tasks"


@pytest.fixture(scope="module")
def tasks():
    res = load_tasks(EXAMPLES)
    assert [str(p) for p in res.problems] == []
    return res.by_id()


def score(task, tmp_path: Path, work=None, metadata=None) -> float:
    live = materialize_workspace(task.workspace, tmp_path / "live")
    if work is not None:
        work(live)
    snap = preserve_workspace(live, tmp_path / "snap")
    ev = task.build_evaluator(eval_root=tmp_path)
    a = ev.evaluate(EvaluationTarget("x-1", snap.path, snap.ref, metadata={**task.metadata, **(metadata or {})}))
    assert a.valid, a.details
    return a.score


def test_sets_and_counts(tasks):
    sets = {}
    for t in tasks.values():
        sets.setdefault(t.metadata["set"], []).append(t.id)
    assert {k: len(v) for k, v in sets.items()} == {"bugfix": 4, "nl2repo": 1, "terminal": 4, "toy": 20, "judge": 2,
                                                        "arith": 200}
    for t in tasks.values():
        if t.metadata["set"] == "judge":  # a model reads the workspace: no evaluator-only file to hide
            assert t.evaluator["type"] == "judge" and t.evaluator["rubric"].startswith("10: ")
            continue
        assert t.hidden, f"{t.id} hides nothing from the harness"
        assert t.evaluator["type"] == "executable"


def test_every_workspace_materialises(tasks, tmp_path):
    for t in tasks.values():
        ws = materialize_workspace(t.workspace, tmp_path / t.id)
        for hidden in t.hidden:  # the workspace holds no evaluator-only file
            for f in hidden.rglob("test_*.py") if hidden.is_dir() else []:
                assert not (ws / f.name).exists() or f.parent.name == "tests", f
    spec = (tmp_path / "nl2repo-inikit" / "SPEC.md").read_text()
    assert "inikit.loads" in spec
    assert "return ordered[n // 2]" in (tmp_path / "bugfix-median-even" / "textkit" / "stats.py").read_text()


def test_toy_sum_task(tasks, tmp_path):
    t = tasks["toy-add-6-7"]
    assert t.instruction == "What is 6+7? Write the result to answer.txt"
    assert score(t, tmp_path / "a", lambda ws: (ws / "answer.txt").write_text("13\n")) == 1.0
    assert score(t, tmp_path / "b", lambda ws: (ws / "answer.txt").write_text("12")) == 0.0
    assert score(t, tmp_path / "c") == 0.0


def test_toy_largest_tasks(tasks, tmp_path):
    largest = sorted(t for t in tasks if t.startswith("toy-largest-"))
    assert len(largest) == 8
    for tid in largest:  # every RL list holds one 9 among four digits in 1..8
        digits = tid.removeprefix("toy-largest-")
        assert len(digits) == 5 and digits.count("9") == 1 and "0" not in digits
        assert tasks[tid].instruction == f"What is the largest of {' '.join(digits)}? Write the result to answer.txt"
    t = tasks[largest[0]]
    assert score(t, tmp_path / "a", lambda ws: (ws / "answer.txt").write_text("9\n")) == 1.0
    assert score(t, tmp_path / "b", lambda ws: (ws / "answer.txt").write_text("8")) == 0.0


def test_toy_reply_task(tasks, tmp_path):
    t = tasks["toy-reply-river"]
    assert score(t, tmp_path / "a", metadata={"final_message": " River.\n"}) == 1.0
    assert score(t, tmp_path / "b", metadata={"final_message": "rivers"}) == 0.0
    assert score(t, tmp_path / "c") == 0.0


def run_solution(script: Path):
    return lambda ws: subprocess.run(["bash", "-e", str(script)], cwd=ws, check=True)


@pytest.mark.slow
@pytest.mark.parametrize("task_id, untouched", [
    ("term-hello-file", 0.0), ("term-csv-to-json", 0.2), ("term-organize-logs", 0.2),
    ("term-word-frequency", 0.0)])
def test_terminal_tasks(tasks, tmp_path, task_id, untouched):
    t = tasks[task_id]
    assert score(t, tmp_path / "u") == pytest.approx(untouched)
    assert score(t, tmp_path / "s", run_solution(t.task_dir / "solutions" / f"{task_id}.sh")) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("task_id", ["bugfix-median-even", "bugfix-slugify", "bugfix-parse-kv", "bugfix-two-bugs"])
def test_bugfix_tasks_partial_credit(tasks, tmp_path, task_id):
    t = tasks[task_id]
    assert score(t, tmp_path / "u") == pytest.approx((15 - t.metadata["broken_tests"]) / 15)

    def fix(ws):
        for rel, _ in t.workspace.files:
            shutil.copy(t.task_dir / "repo" / rel, ws / rel)

    assert score(t, tmp_path / "s", fix) == 1.0
    if task_id == "bugfix-two-bugs":  # fixing one of the two bugs earns partial credit
        def fix_one(ws):
            shutil.copy(t.task_dir / "repo" / "textkit/stats.py", ws / "textkit/stats.py")

        assert score(t, tmp_path / "h", fix_one) == pytest.approx(14 / 15)


@pytest.mark.slow
def test_nl2repo_hidden_tests(tasks, tmp_path):
    t = tasks["nl2repo-inikit"]
    assert not list(t.task_dir.joinpath("ws_inikit").rglob("test_*"))
    assert score(t, tmp_path / "u") == 0.0
    sol = t.task_dir / "solutions" / "inikit"
    assert score(t, tmp_path / "s", lambda ws: shutil.copytree(sol, ws / "inikit")) == 1.0

    def half(ws):  # a package without the CLI and with a broken dumps: partial credit
        shutil.copytree(sol, ws / "inikit")
        (ws / "inikit" / "__main__.py").unlink()
        init = ws / "inikit" / "__init__.py"
        init.write_text(init.read_text().replace('out.append("\\n")', "pass"))

    assert score(t, tmp_path / "h", half) == pytest.approx(10 / 12)


def test_judge_tasks_build_judges_on_the_given_endpoint(tasks):
    from gyre.evaluation import AgenticJudge, EvaluatorSettings

    ev = EvaluatorSettings().build(tasks["judge-docstring"], "http://127.0.0.1:8000/v1")
    assert isinstance(ev, AgenticJudge) and ev.url == "http://127.0.0.1:8000/v1/chat/completions"
    assert (ev.model, ev.score_scale, ev.max_turns, ev.max_tokens, ev.timeout_s) == ("policy", 10.0, 2, 64, 60.0)
    assert "ValueError" in ev.rubric and ev.api_key is None  # the execution's key is used
    other = EvaluatorSettings(judge_base_url="http://judge:9/v1", judge_model="m").build(tasks["judge-docstring"],
                                                                                       "http://127.0.0.1:8000/v1")
    assert (other.url, other.model, other.api_key) == ("http://judge:9/v1/chat/completions", "m", "none")
