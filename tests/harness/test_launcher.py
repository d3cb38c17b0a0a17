"""The execution lifecycle with a generic command harness: closure statuses, partial scoring of
a harness killed at its timeout, the failure placeholder for a crash at start or a failed
workspace, isolation from other executions and hidden tests, the harness's environment."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from gyre.evaluation import OutcomeStatus, RewardManager, RetryPolicy, TerminationStatus
from gyre.harness import (
    CommandHarness,
    ExecutionDir,
    ProxyEndpoint,
    isolation_supported,
    make_harness,
)
from gyre.tasks import load_tasks

ENDPOINT = ProxyEndpoint("http://127.0.0.1:9/v1", "sk-exec-secret-key")

# writes a JUnit report with one test per file a.txt..d.txt (present = passed)
CHECK = textwrap.dedent('''
    import os, sys
    cases = "".join(
        f'<testcase name="{n}">' + ("" if os.path.exists(n + ".txt") else '<failure message="missing"/>') + "</testcase>"
        for n in "abcd")
    open(sys.argv[1], "w").write(f'<testsuite tests="4">{cases}</testsuite>')
''')


@pytest.fixture
def task_file(tmp_path):
    d = tmp_path / "taskset"
    (d / "hidden").mkdir(parents=True)
    (d / "hidden" / "check.py").write_text(CHECK)
    (d / "ws").mkdir()
    (d / "ws" / "README").write_text("start\n")
    (d / "tasks.yaml").write_text(textwrap.dedent('''
        defaults:
          hidden: [hidden]
          evaluator: {type: executable, command: ["{python}", "{task_dir}/hidden/check.py", "{junit_xml}"],
                      scoring: junit, timeout_s: 30}
          metadata: {set: test}
        tasks:
          - {id: four-files, instruction: "Create a.txt, b.txt, c.txt and d.txt.", workspace: {dir: ws}}
          - {id: bad-git, instruction: "x", workspace: {git: {repo: ws, commit: deadbeef}}}
    '''))
    res = load_tasks(d / "tasks.yaml")
    assert not res.problems
    return res.by_id()


def harness(script: str, **kw) -> CommandHarness:
    return CommandHarness([sys.executable, "-c", script], kill_grace_s=0.5, **kw)


def assess(result, task):
    evaluator = task.build_evaluator(eval_root=result.dirs.root if result.dirs else None)
    return RewardManager(RetryPolicy(max_retries=0)).assess(result.closure(task), evaluator)


def test_completed_execution(tmp_path, task_file):
    task = task_file["four-files"]
    h = harness("import os, pathlib\n"
                "for n in 'abcd': pathlib.Path(n + '.txt').write_text(n)\n"
                "pathlib.Path(os.environ['GYRE_FINAL_MESSAGE_FILE']).write_text('made 4 files')\n"
                "print('base', os.environ['OPENAI_BASE_URL'], 'key-present', bool(os.environ['GYRE_API_KEY']))")
    res = h.run(task, tmp_path / "run", "x1-0", ENDPOINT, timeout_s=60)
    assert res.termination is TerminationStatus.COMPLETED and res.exit_code == 0 and not res.error
    assert res.final_message == "made 4 files"
    assert res.workspace.path == tmp_path.resolve() / "run/executions/x1-0/snapshot"
    assert sorted(p.name for p in res.workspace.path.iterdir()) == ["README", "a.txt", "b.txt", "c.txt", "d.txt"]
    assert (res.dirs.workspace / "a.txt").exists()  # the live workspace is kept too
    assert "base http://127.0.0.1:9/v1 key-present True" in res.dirs.log_path.read_text()
    meta = json.loads(res.dirs.meta_path.read_text())
    assert meta["result"]["termination"] == "completed" and meta["task_id"] == "four-files"
    assert "sk-exec-secret-key" not in res.dirs.meta_path.read_text()
    out = assess(res, task)
    assert out.status is OutcomeStatus.VALID and out.reward == 1.0
    closure = res.closure(task, "k")
    assert closure.metadata == {"set": "test", "final_message": "made 4 files", "task_id": "four-files"}


def test_hang_is_killed_at_timeout_and_still_scored(tmp_path, task_file):
    task = task_file["four-files"]
    h = harness("import pathlib, signal, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "for n in 'abc': pathlib.Path(n + '.txt').write_text(n)\n"
                "print('hanging', flush=True)\n"
                "time.sleep(3600)")
    res = h.run(task, tmp_path / "run", "hang-0", ENDPOINT, timeout_s=2)
    assert res.termination is TerminationStatus.TIMEOUT and res.exit_code is None
    assert 2 <= res.duration_s < 10
    out = assess(res, task)
    assert out.status is OutcomeStatus.VALID and out.reward == pytest.approx(0.75)  # 3 of 4 checks
    assert out.termination is TerminationStatus.TIMEOUT


def test_crash_at_start_gets_the_failure_placeholder(tmp_path, task_file):
    task = task_file["four-files"]
    res = harness("import sys; print('boom', file=sys.stderr); sys.exit(7)").run(task, tmp_path / "run", "c-0",
                                                                                   ENDPOINT)
    assert res.termination is TerminationStatus.CRASHED and res.exit_code == 7 and res.workspace is None
    assert "crashed at start" in res.error and "boom" in res.dirs.log_path.read_text()
    out = assess(res, task)
    assert out.status is OutcomeStatus.PLACEHOLDER and out.reward == 0.0


def test_model_call_counter_decides_crash_at_start(tmp_path, task_file):
    task = task_file["four-files"]
    h = harness("import pathlib, sys; pathlib.Path('a.txt').write_text('a'); sys.exit(1)")
    res = h.run(task, tmp_path / "run", "n-0", ENDPOINT, model_calls=lambda: 0)
    assert res.termination is TerminationStatus.CRASHED and res.workspace is None and res.model_calls == 0
    res = h.run(task, tmp_path / "run", "n-1", ENDPOINT, model_calls=lambda: 3)
    assert res.termination is TerminationStatus.HARNESS_EXIT and res.workspace is not None and res.model_calls == 3
    assert assess(res, task).reward == pytest.approx(0.25)
    res = h.run(task, tmp_path / "run", "n-2", ENDPOINT)  # no counter: the workspace changed, so work was done
    assert res.termination is TerminationStatus.HARNESS_EXIT


def test_unstartable_harness_and_failed_workspace(tmp_path, task_file):
    res = CommandHarness(["/no/such/harness"]).run(task_file["four-files"], tmp_path / "run", "u-0", ENDPOINT)
    assert res.termination is TerminationStatus.CRASHED and res.workspace is None and "could not start" in res.error
    assert assess(res, task_file["four-files"]).status is OutcomeStatus.PLACEHOLDER
    res = harness("pass").run(task_file["bad-git"], tmp_path / "run", "g-0", ENDPOINT)
    assert res.termination is TerminationStatus.SETUP_FAILED and res.workspace is None and res.dirs is None
    assert "workspace setup failed" in res.error
    out = RewardManager().assess(res.closure(task_file["bad-git"]), task_file["bad-git"].build_evaluator())
    assert out.status is OutcomeStatus.PLACEHOLDER and out.reward == 0.0


def test_cancel(tmp_path, task_file):
    h = harness("import time; time.sleep(3600)")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("res", h.run(
        task_file["four-files"], tmp_path / "run", "k-0", ENDPOINT, on_launch=lambda r: box.setdefault("run", r))))
    t.start()
    while "run" not in box:
        pass
    box["run"].cancel()
    t.join(30)
    assert box["res"].termination is TerminationStatus.CANCELLED and box["res"].workspace is not None


def test_environment_is_minimal(tmp_path, task_file, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "parent-secret")
    monkeypatch.setenv("SOME_PARENT_VAR", "x")
    h = harness("import os, json; print(json.dumps(dict(os.environ)))", extra_env={"EXTRA": "1"})
    res = h.run(task_file["four-files"], tmp_path / "run", "env-0", ENDPOINT)
    env = json.loads(res.dirs.log_path.read_text().strip().splitlines()[-1])
    assert env["OPENAI_API_KEY"] == "sk-exec-secret-key" and "SOME_PARENT_VAR" not in env
    assert env["HOME"] == str(res.dirs.home) and env["TMPDIR"] == str(res.dirs.tmp) and env["EXTRA"] == "1"
    assert env["GYRE_EXECUTION_ID"] == "env-0" and env["GYRE_TASK_ID"] == "four-files"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


@pytest.mark.skipif(not isolation_supported(), reason="mount/pid namespaces unavailable")
def test_harness_cannot_see_other_executions_or_hidden_tests(tmp_path, task_file):
    task = task_file["four-files"]
    run = tmp_path / "run"
    first = harness("import pathlib; pathlib.Path('a.txt').write_text('first execution work')")
    assert first.run(task, run, "e-0", ENDPOINT).termination is TerminationStatus.COMPLETED
    spy = harness(textwrap.dedent(f'''
        import json, os, pathlib
        other = pathlib.Path({str(run / "executions" / "e-0" / "workspace" / "a.txt")!r})
        hidden = pathlib.Path({str(task.task_dir / "hidden" / "check.py")!r})
        report = {{"other": other.exists(), "hidden": hidden.exists(),
                   "executions": sorted(os.listdir({str(run / "executions")!r})),
                   "own": sorted(os.listdir(".")), "pids": len([p for p in os.listdir("/proc") if p.isdigit()])}}
        pathlib.Path("report.json").write_text(json.dumps(report))
    '''))
    res = spy.run(task, run, "e-1", ENDPOINT)
    assert res.termination is TerminationStatus.COMPLETED
    report = json.loads((res.dirs.workspace / "report.json").read_text())
    assert report == {"other": False, "hidden": False, "executions": ["e-1"], "own": ["README"],
                      "pids": report["pids"]}
    assert report["pids"] < 10
    assert (task.task_dir / "hidden" / "check.py").exists()
    assert json.loads(res.dirs.meta_path.read_text())["isolated"] is True


def test_isolation_off_and_validation(tmp_path, task_file):
    h = harness("pass", isolation="off")
    assert h.isolated is False
    with pytest.raises(ValueError):
        CommandHarness(["x"], isolation="maybe")
    with pytest.raises(ValueError):
        CommandHarness(["x"], preserve="never")
    with pytest.raises(ValueError, match="unsafe execution id"):
        ExecutionDir.create(tmp_path, "../evil", task_file["four-files"])
    with pytest.raises(ValueError, match="unknown harness"):
        make_harness("emacs")


def test_inplace_preservation(tmp_path, task_file):
    res = harness("open('a.txt', 'w').write('a')", preserve="inplace").run(task_file["four-files"], tmp_path / "r",
                                                                          "i-0", ENDPOINT)
    assert res.workspace.path == res.dirs.workspace and not res.dirs.snapshot.exists()
    assert res.workspace.ref.startswith("sha256:")


def test_endpoint_urls():
    ep = ProxyEndpoint("http://127.0.0.1:8000/v1/", "k")
    assert ep.base_url == "http://127.0.0.1:8000" and ep.openai_base_url == "http://127.0.0.1:8000/v1"
    assert ep.anthropic_base_url == "http://127.0.0.1:8000"
    with pytest.raises(ValueError):
        ProxyEndpoint("127.0.0.1:8000", "k")
