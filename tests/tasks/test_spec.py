"""validate_task: the pure core of task loading -- every problem named by task id and field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.tasks import TaskSpec, validate_task

EXE = {"type": "executable", "command": ["{python}", "-m", "pytest", "--junitxml={junit_xml}", "{task_dir}/t"]}


def ok(tmp_path: Path, **over):
    raw = {"id": "t1", "instruction": "do it", "evaluator": dict(EXE), **over}
    return validate_task(raw, source="f.yaml:1", task_dir=tmp_path)


def fields(problems) -> list[str]:
    assert isinstance(problems, list), problems
    return [p.field for p in problems]


def test_minimal_task(tmp_path):
    spec = ok(tmp_path)
    assert isinstance(spec, TaskSpec)
    assert spec.id == "t1" and spec.timeout_s is None and spec.hidden == () and spec.metadata == {}
    assert spec.workspace.dir is None and spec.workspace.git is None and spec.workspace.files == ()
    # {task_dir} substituted (absolute), the evaluator's own placeholders left alone
    assert spec.evaluator["command"] == ["{python}", "-m", "pytest", "--junitxml={junit_xml}",
                                         f"{tmp_path.resolve()}/t"]
    assert spec.source == "f.yaml:1" and spec.task_dir == tmp_path.resolve()


def test_shell_command_task_dir_is_quoted(tmp_path):
    d = tmp_path / "with space"
    d.mkdir()
    spec = validate_task({"id": "t", "instruction": "x", "evaluator": {"type": "executable",
                          "command": "cat {task_dir}/a", "env": {"P": "{task_dir}/p"}}}, source="s", task_dir=d)
    assert spec.evaluator["command"] == f"cat '{d.resolve()}'/a"
    assert spec.evaluator["env"] == {"P": f"{d.resolve()}/p"}


def test_every_problem_reported_with_id_and_field(tmp_path):
    problems = validate_task({
        "id": "bad-one", "instruction": "", "timeout_s": -3, "colour": "red", "metadata": [1],
        "workspace": {"dir": "nope", "files": {"../x": "a", "ok.txt": 3}},
        "evaluator": {"type": "executable", "scoring": "no_such_mod.sub:fn", "junit_skipped": "maybe"},
    }, source="f.yaml:7", task_dir=tmp_path)
    assert sorted(fields(problems)) == sorted([
        "colour", "instruction", "workspace.dir", "workspace.files.../x", "workspace.files.ok.txt",
        "evaluator.command", "evaluator.junit_skipped", "evaluator.scoring", "timeout_s", "metadata"])
    assert all(p.task_id == "bad-one" and p.source == "f.yaml:7" for p in problems)
    line = str(next(p for p in problems if p.field == "timeout_s"))
    assert line == "f.yaml:7: task 'bad-one' field 'timeout_s': must be a number of seconds > 0, got -3"
    assert "\n" not in "".join(str(p) for p in problems)


def test_missing_id_and_bad_id(tmp_path):
    (p,) = validate_task({"instruction": "x", "evaluator": EXE}, source="s:3", task_dir=tmp_path, index=2)
    assert p.task_id is None and p.field == "id" and str(p) == "s:3: task #3 field 'id': missing"
    (p,) = validate_task({"id": "a/b", "instruction": "x", "evaluator": EXE}, source="s", task_dir=tmp_path)
    assert p.field == "id" and "must match" in p.message


def test_not_a_mapping(tmp_path):
    (p,) = validate_task(["x"], source="s:1", task_dir=tmp_path, index=0)
    assert p.field == "" and "must be a mapping" in str(p)


@pytest.mark.parametrize("evaluator, field", [
    (None, "evaluator"),
    ({"type": "magic"}, "evaluator.type"),
    ({"type": "executable", "command": []}, "evaluator.command"),
    ({"type": "executable", "command": 5}, "evaluator.command"),
    ({"type": "executable", "command": "x", "timeout_s": 0}, "evaluator.timeout_s"),
    ({"type": "executable", "command": "x", "env": {"A": ["b"]}}, "evaluator.env"),
    ({"type": "executable", "command": "x", "extra": 1}, "evaluator.extra"),
    ({"type": "judge"}, "evaluator.rubric"),
    ({"type": "judge", "rubric": "r", "max_turns": 0}, "evaluator.max_turns"),
    ({"type": "composite", "components": []}, "evaluator.components"),
    ({"type": "composite", "components": [{"weight": -1, "type": "judge", "rubric": "r"}]},
     "evaluator.components.0.weight"),
    ({"type": "composite", "components": [{"weight": 0, "type": "judge", "rubric": "r"}]},
     "evaluator.components.0.weight"),
    ({"type": "judge", "rubric": "r", "max_tokens": 0}, "evaluator.max_tokens"),
    ({"type": "judge", "rubric": "r", "base_url": "localhost:1"}, "evaluator.base_url"),
    ({"type": "composite", "components": [{"weight": 1, "type": "executable"}]},
     "evaluator.components.0.command"),
])
def test_evaluator_problems(tmp_path, evaluator, field):
    raw = {"id": "t", "instruction": "x"}
    if evaluator is not None:
        raw["evaluator"] = evaluator
    assert fields(validate_task(raw, source="s", task_dir=tmp_path)) == [field]


def test_composite_and_judge_accepted(tmp_path):
    spec = ok(tmp_path, evaluator={"type": "composite", "components": [
        {"weight": 0.7, **EXE}, {"weight": 0.3, "type": "judge", "rubric": "Is it nice?"}]})
    comps = spec.evaluator["components"]
    assert comps[0]["weight"] == 0.7 and comps[0]["command"][-1] == f"{tmp_path.resolve()}/t"
    assert comps[1] == {"type": "judge", "rubric": "Is it nice?", "weight": 0.3}


def test_workspace_forms(tmp_path):
    (tmp_path / "repo").mkdir()
    spec = ok(tmp_path, workspace={"dir": "repo", "files": {"a/b.txt": "hi"}})
    assert spec.workspace.dir == (tmp_path / "repo").resolve() and spec.workspace.files == (("a/b.txt", "hi"),)
    spec = ok(tmp_path, workspace={"git": {"repo": "repo", "commit": "abc123"}})
    assert spec.workspace.git.repo == (tmp_path / "repo").resolve() and spec.workspace.git.commit == "abc123"
    assert fields(ok(tmp_path, workspace={"dir": "repo", "git": {"repo": "repo", "commit": "abcd"}})) == ["workspace"]
    assert fields(ok(tmp_path, workspace={"git": {"repo": "repo", "commit": "HEAD"}})) == ["workspace.git.commit"]
    assert fields(ok(tmp_path, workspace={"files": {"/etc/x": "a"}})) == ["workspace.files./etc/x"]
    assert fields(ok(tmp_path, workspace={"files": {".git/config": "a"}})) == ["workspace.files..git/config"]
    assert fields(ok(tmp_path, workspace="repo")) == ["workspace"]


def test_hidden_paths(tmp_path):
    (tmp_path / "secret").mkdir()
    spec = ok(tmp_path, hidden=["secret", "."])
    assert spec.hidden == ((tmp_path / "secret").resolve(), tmp_path.resolve())
    assert ok(tmp_path, hidden="secret").hidden == ((tmp_path / "secret").resolve(),)
    assert fields(ok(tmp_path, hidden=["missing"])) == ["hidden"]
    assert fields(ok(tmp_path, hidden=[3])) == ["hidden"]


@pytest.mark.parametrize("over, field", [
    ({"hidden": ["\x00"]}, "hidden"),
    ({"workspace": {"dir": "a\x00b"}}, "workspace.dir"),
    ({"workspace": {"git": {"repo": "r\x00", "commit": "abcd"}}}, "workspace.git.repo"),
    ({"environment": {"dockerfile": "Dockerfile\x00"}}, "environment.dockerfile"),
])
def test_a_path_with_nul_is_a_problem_of_its_field(tmp_path, over, field):
    """The OS cannot name a file with NUL in it: the path's field is reported, nothing raises."""
    assert field in fields(ok(tmp_path, **over))


def test_check_imports_off_skips_rule_import(tmp_path):
    spec = ok(tmp_path, evaluator={**EXE, "scoring": "no_such_mod:fn"})
    assert fields(spec) == ["evaluator.scoring"]
    spec = validate_task({"id": "t", "instruction": "x", "evaluator": {**EXE, "scoring": "no_such_mod:fn"}},
                         source="s", task_dir=tmp_path, check_imports=False)
    assert isinstance(spec, TaskSpec)


def test_build_evaluator(tmp_path):
    from gyre.evaluation import ExecutableCheck

    ev = ok(tmp_path, evaluator={**EXE, "scoring": "exit_code", "timeout_s": 7}).build_evaluator()
    assert isinstance(ev, ExecutableCheck)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=12)
_keys = st.sampled_from(["id", "instruction", "workspace", "evaluator", "timeout_s", "hidden", "metadata", "x"])
_task = st.dictionaries(_keys, _json | st.fixed_dictionaries({"type": st.sampled_from(
    ["executable", "judge", "composite"])}, optional={"command": _json, "components": _json, "rubric": _json,
                                                      "env": _json, "files": _json, "dir": _json, "git": _json}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_json | _task)
def test_validate_never_raises(tmp_path, raw):
    out = validate_task(raw, source="f:1", task_dir=tmp_path, index=0, check_imports=False)
    if isinstance(out, list):
        assert out and all("\n" not in str(p) for p in out)
    else:
        assert isinstance(out, TaskSpec)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300), suffix=st.sampled_from([".jsonl", ".yaml", ".json"]))
def test_loader_never_raises_on_garbage(tmp_path, text, suffix):
    from gyre.tasks import load_tasks

    f = tmp_path / f"tasks{suffix}"
    f.write_text(text)
    res = load_tasks(f, check_imports=False)
    assert res.skipped >= 0 and all(isinstance(t, TaskSpec) for t in res.tasks)
