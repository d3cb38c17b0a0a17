"""The reference agent as a real process inside each sandboxing backend (bwrap over the host's root,
podman and docker in the test image), talking to an OpenAI-compatible server on the launcher's
127.0.0.1 through the sandbox's own socket: the toy task completes and scores 1, the harness saw
the same proxy URL as outside, and the task's hidden files and the run directory stayed hidden."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gyre.evaluation import OutcomeStatus, RetryPolicy, RewardManager, TerminationStatus
from gyre.harness import ProxyEndpoint, ReferenceHarness
from gyre.sandbox import Environment, Limits
from gyre.sandbox.podman import TEST_IMAGE
from gyre.tasks import load_tasks
from tools.fake_llm import FakeLLMServer, FakeRequest, Reply

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy():
    res = load_tasks(ROOT / "examples" / "tasks" / "toy")
    assert not res.problems
    return res.by_id()


def test_reference_agent_in_a_sandbox(tmp_path, toy, backend):
    task = toy["toy-add-6-7"]
    if backend.name in ("podman", "docker"):
        task = dataclasses.replace(task, environment=Environment("image", TEST_IMAGE))
    probe = (f"cat {task.task_dir}/check_answer.py; ls {tmp_path / 'run'}/executions; "
             "cat /etc/os-release | head -1; echo uid=$(id -u)")

    def policy(req: FakeRequest) -> Reply:
        results = req.tool_results()
        if not results:
            return Reply(tool_calls=[("bash", {"command": probe})])
        if len(results) == 1:
            return Reply(tool_calls=[("write_file", {"path": "answer.txt", "content": "13"})])
        return Reply(text="13")

    with FakeLLMServer(policy, api_key="sk-toy") as srv:
        h = ReferenceHarness(tools=["bash", "write_file"], system_prompt="", max_turns=6, backend=backend,
                             limits=Limits(pids=256, memory_bytes=1 << 30))
        res = h.run(task, tmp_path / "run", "toy-0", ProxyEndpoint(srv.base_url, "sk-toy"), timeout_s=120)
        reqs = srv.requests("chat")
    log = res.dirs.log_path.read_text()
    assert res.termination is TerminationStatus.COMPLETED, (res.error, log)
    assert res.final_message == "13" and len(reqs) == 3
    shell = reqs[1].body["messages"][-1]["content"]
    assert "def " not in shell and "No such file" in shell  # the checker and other executions are hidden
    if backend.name in ("podman", "docker"):
        assert "Debian GNU/Linux 12" in shell
    meta = json.loads(res.dirs.meta_path.read_text())
    assert meta["backend"] == backend.name and meta["endpoint"] == srv.base_url.removesuffix("/v1")
    runner = h.evaluation_runner(task, tmp_path / "run")
    assert (runner is None) == (backend.name == "local")
    rewards = RewardManager(RetryPolicy(max_retries=0))
    out = rewards.assess(res.closure(task), task.build_evaluator(command_runner=runner))
    assert out.status is OutcomeStatus.VALID and out.reward == 1.0
    details = rewards.log.records("toy-0")[-1].details
    assert details["isolation"] == ("sandbox" if runner else "copy+readonly-source"), details
