"""The reference agent as a real child process (python -m gyre.harness.reference_agent) against
a scripted OpenAI-compatible server: toy tasks scored end to end, and a long task whose calls
include a compaction and a sub-agent, each identified by its role."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.evaluation import OutcomeStatus, RewardManager, RetryPolicy, TerminationStatus
from gyre.harness import REFERENCE_ROLES, ProxyEndpoint, ReferenceHarness
from gyre.harness.reference_agent import COMPACTION_PROMPT
from gyre.tasks import load_tasks
from tools.fake_llm import FakeLLMServer, FakeRequest, Reply

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy():
    res = load_tasks(ROOT / "examples" / "tasks" / "toy")
    assert not res.problems
    return res.by_id()


def assess(result, task):
    return RewardManager(RetryPolicy(max_retries=0)).assess(result.closure(task), task.build_evaluator())


def test_toy_sum_task_end_to_end(tmp_path, toy):
    task = toy["toy-add-6-7"]

    def policy(req: FakeRequest) -> Reply:
        if not req.tool_results():
            return Reply(tool_calls=[("write_file", {"path": "answer.txt", "content": "13"})])
        return Reply(text="13")

    with FakeLLMServer(policy, api_key="sk-toy") as srv:
        h = ReferenceHarness(tools=["write_file"], system_prompt="", max_turns=4)
        res = h.run(task, tmp_path / "run", "toy-0", ProxyEndpoint(srv.base_url, "sk-toy"))
        reqs = srv.requests("chat")
    assert res.termination is TerminationStatus.COMPLETED and res.final_message == "13"
    assert len(reqs) == 2
    first, second = (r.body for r in reqs)
    assert first["messages"] == [{"role": "user", "content": task.instruction}]
    assert [t["function"]["name"] for t in first["tools"]] == ["write_file"]
    assert second["messages"][-1]["role"] == "tool" and "wrote 2 characters" in second["messages"][-1]["content"]
    assert all(r.headers["authorization"] == "Bearer sk-toy" for r in reqs)
    out = assess(res, task)
    assert out.status is OutcomeStatus.VALID and out.reward == 1.0
    transcript = [json.loads(x) for x in (res.dirs.root / "agent_transcript.jsonl").read_text().splitlines()]
    assert transcript[-1]["event"] == "end" and transcript[-1]["stop"] == "final"


def test_toy_reply_task_and_wrong_answer(tmp_path, toy):
    with FakeLLMServer(lambda req: Reply(text="River.")) as srv:
        res = ReferenceHarness(tools=["write_file"]).run(toy["toy-reply-river"], tmp_path / "run", "r-0",
                                                         ProxyEndpoint(srv.base_url, "k"))
    assert res.final_message == "River." and assess(res, toy["toy-reply-river"]).reward == 1.0
    with FakeLLMServer(lambda req: Reply(text="no idea")) as srv:
        res = ReferenceHarness(tools=["write_file"]).run(toy["toy-add-6-7"], tmp_path / "run", "r-1",
                                                         ProxyEndpoint(srv.base_url, "k"))
    out = assess(res, toy["toy-add-6-7"])
    assert out.status is OutcomeStatus.VALID and out.reward == 0.0  # a valid zero, not a placeholder


def long_task(req: FakeRequest) -> Reply:
    """6 main shell steps (the reported context grows 300 tokens a step), compaction when asked,
    a delegation at main step 4, a sub-agent that runs one command."""
    role = req.header("x-gyre-role")
    msgs = req.body["messages"]
    if role == "compaction":
        return Reply(text="SUMMARY-MARKER: steps done so far", input_tokens=50)
    done = len(req.tool_results())
    if role == "subagent":
        if done == 0:
            return Reply(tool_calls=[("bash", {"command": "echo SUBAGENT-WORK > sub.txt && pwd"})], input_tokens=80)
        return Reply(text="SUBAGENT_RESULT: sub.txt written", input_tokens=90)
    offset = 3 if "This task is being continued" in msgs[1]["content"] else 0
    step = done + offset
    if step < 4:
        return Reply(tool_calls=[("bash", {"command": f"echo step{step} >> steps.txt"})], input_tokens=300 * (done + 1))
    if step == 4:
        return Reply(tool_calls=[("delegate", {"task": "SUBAGENT_TASK: write sub.txt"})], input_tokens=350)
    return Reply(text="All done. DONE_MARKER", input_tokens=400)


def test_long_task_compaction_and_subagent(tmp_path, toy):
    task = toy["toy-add-6-7"]
    with FakeLLMServer(long_task) as srv:
        h = ReferenceHarness(compact_threshold_tokens=800, max_turns=20)
        res = h.run(task, tmp_path / "run", "long-0", ProxyEndpoint(srv.base_url, "k"))
        reqs = srv.requests("chat")
    assert res.termination is TerminationStatus.COMPLETED and res.final_message == "All done. DONE_MARKER"
    roles = [REFERENCE_ROLES.classify(r.headers, r.body) for r in reqs]
    assert roles == ["main"] * 3 + ["compaction", "main", "main", "subagent", "subagent", "main"]
    # without the headers the prompts alone give the same roles
    assert [REFERENCE_ROLES.classify({}, r.body) for r in reqs] == roles
    bodies = [r.body for r in reqs]
    comp = bodies[3]["messages"]
    assert comp[:len(bodies[2]["messages"])] == bodies[2]["messages"]       # extends the main context
    assert comp[-1] == {"role": "user", "content": COMPACTION_PROMPT}
    assert "SUMMARY-MARKER" in bodies[4]["messages"][1]["content"] and len(bodies[4]["messages"]) == 2
    sub = bodies[6]["messages"]
    assert sub[1] == {"role": "user", "content": "SUBAGENT_TASK: write sub.txt"} and len(sub) == 2
    assert bodies[8]["messages"][-1]["content"] == "SUBAGENT_RESULT: sub.txt written"
    assert [r.headers["x-gyre-agent-id"] for r in reqs] == ["main"] * 6 + ["sub-1", "sub-1", "main"]
    ws = res.workspace.path
    assert (ws / "steps.txt").read_text() == "step0\nstep1\nstep2\nstep3\n"
    assert (ws / "sub.txt").read_text() == "SUBAGENT-WORK\n"


def test_api_failure_exit_code(tmp_path, toy):
    with FakeLLMServer(lambda req: Reply(status=400)) as srv:
        res = ReferenceHarness().run(toy["toy-add-6-7"], tmp_path / "run", "f-0", ProxyEndpoint(srv.base_url, "k"),
                                     model_calls=lambda: 1)
    assert res.exit_code == 4 and res.termination is TerminationStatus.HARNESS_EXIT
    assert "model API failed" in res.dirs.log_path.read_text()
