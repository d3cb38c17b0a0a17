"""Executable checks in a sandbox of the task's environment (SandboxCommandRunner) for bwrap and
podman: the check reads its evaluator-only files and writes its report in the evaluation directory,
but cannot change the preserved workspace, see other executions or reach the launcher's ports; an
evaluator-only file is visible to the evaluation and not to the harness."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest

from gyre.evaluation import EvaluationTarget, ExecutableCheck
from gyre.evaluation.workspace import preserve_workspace
from gyre.sandbox import Environment
from gyre.sandbox.evaluation_runner import SandboxCommandRunner
from gyre.sandbox.podman import TEST_IMAGE

CHECK = textwrap.dedent('''
    import os, socket, sys
    snapshot, run_dir, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    problems = []
    if open("answer.txt").read() != "42":
        problems.append("workspace copy unreadable")
    try:
        open(os.path.join(snapshot, "answer.txt"), "w").write("changed")
        problems.append("wrote the preserved workspace")
    except OSError:
        pass
    if os.path.exists(os.path.join(run_dir, "executions", "other")):
        problems.append("sees another execution")
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        problems.append("reached a launcher port")
    except OSError:
        pass
    open("report.txt", "w").write("checked")
    print("PROBLEMS", problems)
    sys.exit(1 if problems else 0)
''')


def test_check_runs_sandboxed(tmp_path, backend):
    if backend.name not in ("bwrap", "podman"):
        pytest.skip("sandboxed evaluation is covered for bwrap and podman")
    task_dir = tmp_path / "task"
    (task_dir / "hidden").mkdir(parents=True)
    (task_dir / "hidden" / "check.py").write_text(CHECK)
    run = tmp_path / "run"
    ws = run / "executions" / "e1" / "workspace"
    ws.mkdir(parents=True)
    (ws / "answer.txt").write_text("42")
    (run / "executions" / "other" / "workspace").mkdir(parents=True)
    preserved = preserve_workspace(ws, run / "executions" / "e1" / "snapshot")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    environment = Environment("image", TEST_IMAGE) if backend.name == "podman" else Environment()
    runner = SandboxCommandRunner(backend, environment, run_label="evaltest", evaluator_files=(task_dir,),
                                  masks=(run,))
    check = ExecutableCheck(["{python}", str(task_dir / "hidden" / "check.py"), str(preserved.path), str(run),
                             str(listener.getsockname()[1])], scoring="exit_code", timeout_s=60,
                            eval_root=tmp_path / "evals", keep_eval_dirs=True, command_runner=runner)
    try:
        a = check.evaluate(EvaluationTarget("e1", preserved.path, preserved.ref, instruction="fix it"))
    finally:
        listener.close()
    assert a.score == 1.0, a.details
    assert a.details["isolation"] == "sandbox"
    assert "PROBLEMS []" in a.details["stdout_tail"]
    assert (Path(a.details["eval_dir"]) / "workspace" / "report.txt").read_text() == "checked"
    assert (preserved.path / "answer.txt").read_text() == "42"
