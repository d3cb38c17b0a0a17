"""load_tasks: file shapes, one clear line per problem, bad tasks skipped and counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.tasks import TaskLoadError, find_task_files, load_tasks

ROOT = Path(__file__).resolve().parents[2]
EXE = {"type": "executable", "command": "true", "scoring": "exit_code"}


def task(i, **over):
    return {"id": f"t{i}", "instruction": f"do {i}", "evaluator": EXE, **over}


def write_jsonl(path: Path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_good_and_bad_lines(tmp_path):
    f = write_jsonl(tmp_path / "tasks.jsonl", [
        task(1), "", "# a comment", "{not json", task(2, timeout_s="soon"), task(3), task(1), [1, 2]])
    res = load_tasks(f)
    assert [t.id for t in res.tasks] == ["t1", "t3"]
    assert res.skipped == 4 and len(res.problems) == 4
    lines = [str(p) for p in res.problems]
    assert lines[0].startswith(f"{f}:4: task #2: not valid JSON (")
    assert lines[1] == f"{f}:5: task 't2' field 'timeout_s': must be a number of seconds > 0, got 'soon'"
    assert lines[2] == f"{f}:7: task 't1' field 'id': duplicate id (first defined at {f}:1); skipped"
    assert lines[3] == f"{f}:8: task #6: a task must be a mapping, got list"
    assert res.tasks[0].source == f"{f}:1"


def test_two_of_four_malformed_lines_are_counted_with_file_and_line(tmp_path):
    f = write_jsonl(tmp_path / "tasks.jsonl", [task(1), "{broken", task(2), {"id": "t3", "instruction": "x"}])
    res = load_tasks(f)
    assert [t.id for t in res.tasks] == ["t1", "t2"]
    assert res.skipped == 2  # the count a run's summary reports
    assert [p.source for p in res.problems] == [f"{f}:2", f"{f}:4"]
    assert [str(p) for p in res.problems] == [
        f"{f}:2: task #2: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{f}:4: task 't3' field 'evaluator': missing (every task needs a way to be scored)"]


def test_json_task_lines(tmp_path):
    f = tmp_path / "c.tasks.json"
    f.write_text(json.dumps({"tasks": [task(1), task(2, timeout_s=-1)]}, indent=1))
    res = load_tasks(f)
    assert res.tasks[0].source == f"{f}:3" and res.skipped == 1
    (p,) = res.problems
    assert p.source == f"{f}:12" and p.field == "timeout_s"


def test_yaml_defaults_and_line_numbers(tmp_path):
    f = tmp_path / "set.tasks.yaml"
    f.write_text(
        "defaults:\n"
        "  timeout_s: 30\n"
        "  metadata: {set: s}\n"
        "  evaluator: {type: executable, command: 'true', scoring: exit_code}\n"
        "tasks:\n"
        "  - id: a\n"
        "    instruction: A\n"
        "    metadata: {level: 1}\n"
        "  - id: b\n"
        "    instruction: B\n"
        "    timeout_s: 5\n"
        "  - id: c\n"
        "    instrucion: typo\n")
    res = load_tasks(f)
    assert [t.id for t in res.tasks] == ["a", "b"]
    a, b = res.tasks
    assert a.timeout_s == 30 and a.metadata == {"set": "s", "level": 1} and a.evaluator["command"] == "true"
    assert b.timeout_s == 5 and b.source == f"{f}:9"
    assert [str(p) for p in res.problems] == [
        f"{f}:12: task 'c' field 'instrucion': unknown field (allowed: id, instruction, workspace, evaluator, "
        "timeout_s, hidden, metadata, environment)",
        f"{f}:12: task 'c' field 'instruction': missing"]
    assert res.skipped == 1


def test_yaml_list_single_mapping_and_json(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tasks.yaml").write_text(json.dumps([task(1), task(2)]))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tasks.yml").write_text("id: t3\ninstruction: x\nevaluator: {type: judge, rubric: r}\n")
    (tmp_path / "c.tasks.json").write_text(json.dumps({"tasks": [task(4)]}))
    (tmp_path / "notes.yaml").write_text("not: a task file\n")       # ignored: not a task file name
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "tasks.jsonl").write_text("garbage\n")  # ignored: dot-directory
    assert [p.relative_to(tmp_path).as_posix() for p in find_task_files(tmp_path)] == [
        "a/tasks.yaml", "b/tasks.yml", "c.tasks.json"]
    res = load_tasks(tmp_path)
    assert [t.id for t in res.tasks] == ["t1", "t2", "t3", "t4"] and not res.problems


def test_yaml_syntax_error_is_one_problem(tmp_path):
    f = tmp_path / "tasks.yaml"
    f.write_text("tasks:\n  - id: a\n    instruction: [unclosed\n")
    res = load_tasks(f)
    assert res.tasks == [] and res.skipped == 1
    (p,) = res.problems
    assert str(p).startswith(f"{f}:") and "not valid YAML" in str(p)


def test_bad_task_set_keys(tmp_path):
    f = tmp_path / "tasks.yaml"
    f.write_text("defaults: {id: x, bogus: 1}\nextra: 2\ntasks:\n  - " + json.dumps(task(1)) + "\n")
    res = load_tasks(f)
    assert [t.id for t in res.tasks] == ["t1"]
    assert len(res.problems) == 2
    assert "unknown top-level keys ['extra']" in str(res.problems[0])
    assert "field 'defaults': unknown or per-task fields ['id', 'bogus']" in str(res.problems[1])


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(TaskLoadError, match="task path not found"):
        load_tasks(tmp_path / "nope.jsonl")
    with pytest.raises(TaskLoadError, match="no task files"):
        load_tasks(tmp_path)


def test_cli_prints_one_line_per_problem(tmp_path):
    f = write_jsonl(tmp_path / "tasks.jsonl", [task(1), task(2, evaluator={"type": "judge"}), "[]"])
    res = subprocess.run([sys.executable, "-m", "gyre.tasks", str(f)], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        f"{f}:2: task 't2' field 'evaluator.rubric': missing or empty (the judge's rubric text)",
        f"{f}:3: task #3: a task must be a mapping, got list",
        "1 tasks loaded from 1 files, 2 skipped, 2 problems"]
    res = subprocess.run([sys.executable, "-m", "gyre.tasks", str(tmp_path / "none")], capture_output=True,
                         text=True, cwd=ROOT)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
