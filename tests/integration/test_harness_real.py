"""Claude Code, Codex CLI and mini-swe-agent, unmodified, installed from their registries by the
test set-up (npm / PyPI, into the harness cache; skipped only when the registry is
unreachable), each run on a real example task through Gyre's real proxy (rendering, TITO
recording, store) in front of a scripted engine that emits well-formed tool calls. Checked: the
harness runs a tool, the tool result comes back through the proxy, the run ends normally, the
recorded tree is one main path with exact token reuse, and the workspace is evaluated. Then the
harnesses' own sub-agents (Claude Code's Agent tool, Codex's spawn_agent/wait_agent) and
compaction (Claude Code reacting to the proxy's "prompt is too long", Codex at its configured
auto-compaction limit) show up as sub-agent and compaction branches of the stored tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gyre.evaluation import OutcomeStatus, RewardManager, RetryPolicy, TerminationStatus
from gyre.harness import HarnessUnavailable, ProxyEndpoint, make_harness
from gyre.tasks import load_tasks
from tests.harness.scripted_proxy import (
    leaves_by_role,
    offered_tools,
    scripted_proxy,
    shell_call,
    tool_call,
    tool_results,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MARKER = "TOOL-RESULT-MARKER"
API = {"claude-code": "anthropic", "codex": "responses", "mini-swe-agent": "chat"}


@pytest.fixture(scope="module")
def task():
    return load_tasks(ROOT / "examples" / "tasks" / "toy" / "tasks.jsonl").by_id()["toy-add-6-7"]


@pytest.fixture(scope="module", params=["claude-code", "codex", "mini-swe-agent"])
def harness(request):
    h = make_harness(request.param, kill_grace_s=2)
    try:
        h.ensure_installed()  # from npm / PyPI into the harness cache (cached after the first run)
    except HarnessUnavailable as exc:
        pytest.skip(f"{request.param} unavailable: {exc}")
    return h


def policy_for(name: str):
    def policy(prompt: str) -> str:
        k = tool_results(prompt)
        if k == 0:
            return "Writing the answer.\n" + shell_call(prompt, f"echo {MARKER} && echo 13 > answer.txt")
        if name == "mini-swe-agent" and k == 1:  # mini-swe-agent ends when this command's output is seen
            return shell_call(prompt, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
        return "All done. DONE_MARKER"

    return policy


def test_real_harness_through_the_proxy(harness, task, tiny_model_dir, tmp_path):
    name = harness.name
    with scripted_proxy(tiny_model_dir, policy_for(name), tmp_path / "records") as proxy:
        eid = f"{name}-0"
        key = proxy.register(eid, task.id, name)
        res = harness.run(task, tmp_path / "run", eid, ProxyEndpoint(proxy.base_url, key),
                          model_calls=proxy.model_calls(eid), timeout_s=180)
        proxy.close(eid)
        prompts = list(proxy.prompts)
        tree = proxy.tree(eid)
    log = res.dirs.log_path.read_text(errors="replace")
    assert res.termination is TerminationStatus.COMPLETED, (res.error, log[-3000:])
    assert res.model_calls == 2 and len(prompts) == 2
    # the harness ran the tool: its output is in the next prompt, its effect in the workspace
    assert MARKER in prompts[1].split("<|im_start|>assistant", 1)[-1]
    assert (res.workspace.path / "answer.txt").read_text() == "13\n"
    if name != "mini-swe-agent":
        assert res.final_message == "All done. DONE_MARKER"
    # one main path; the second call reuses every stored token of the first
    assert len(tree.records) == 2 and leaves_by_role(tree) == {"main": 1}
    r0, r1 = tree.record_info(0), tree.record_info(1)
    assert r1.matched_tokens == r0.num_input_tokens + r0.num_output_tokens
    assert all(r.delivered and r.metadata["api"] == API[name] for r in (r0, r1))
    assert all(harness.roles.classify(r.metadata.get("headers", {}), {"tools": [1]}) == "main" for r in (r0, r1))
    out = RewardManager(RetryPolicy(max_retries=0)).assess(res.closure(task), task.build_evaluator())
    assert out.status is OutcomeStatus.VALID and out.reward == 1.0


def subagent_policy(prompt: str) -> str:
    """Main: a command, then spawn a sub-agent (Claude Code: Agent; Codex: spawn_agent, then
    wait_agent on the id it returned), then the final answer. Sub-agent: a command, its result."""
    k = tool_results(prompt)
    if "Write the result to answer.txt" not in prompt:  # the sub-agent's fresh context lacks the task
        return shell_call(prompt, "echo SUBAGENT-WORK > sub.txt") if k == 0 else "SUBAGENT_RESULT: sub.txt written"
    names = offered_tools(prompt)
    if k == 0:
        return shell_call(prompt, "echo 13 > answer.txt")
    if k == 1:
        if "Agent" in names:
            return tool_call("Agent", {"subagent_type": "general-purpose", "description": "write sub.txt",
                                       "prompt": "SUBAGENT_TASK: write SUBAGENT-WORK to sub.txt"})
        spawn = next(n for n in names if n.endswith("spawn_agent"))
        return tool_call(spawn, {"message": "SUBAGENT_TASK: write SUBAGENT-WORK to sub.txt"})
    if k == 2 and "Agent" not in names:
        agent_id = re.search(r'agent_id\\?"\s*:\s*\\?"([^"\\]+)', prompt).group(1)
        return tool_call(next(n for n in names if n.endswith("wait_agent")), {"targets": [agent_id]})
    return "All done. DONE_MARKER"


def compaction_policy(prompt: str) -> str:
    """Five commands with long outputs; a compaction request gets a summary that carries the step
    count over, so the continued context resumes where it was."""
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    k = tool_results(prompt)
    if "detailed summary of the conversation" in last_user or "CONTEXT CHECKPOINT COMPACTION" in last_user:
        return f"<summary>SUMMARY-MARKER step={k}: steps written to steps.txt</summary>"
    carried = re.search(r"SUMMARY-MARKER step=(\d+)", prompt)
    step = k + (int(carried.group(1)) if carried else 0)
    if step < 5:
        return shell_call(prompt, f"echo step{step} >> steps.txt && seq 1 400")
    return "All done. DONE_MARKER"


def _run(harness, task, tmp_path, policy, **proxy_kw):
    with scripted_proxy(tmp_path / "model", policy, tmp_path / "records", **proxy_kw) as proxy:
        eid = f"{harness.name}-x"
        key = proxy.register(eid, task.id, harness.name, role_rules=harness.roles)  # roles by the adapter's rules
        res = harness.run(task, tmp_path / "run", eid, ProxyEndpoint(proxy.base_url, key),
                          model_calls=proxy.model_calls(eid), timeout_s=120)
        proxy.close(eid)
        return res, proxy.tree(eid)


@pytest.mark.parametrize("name", ["claude-code", "codex"])
def test_real_harness_subagent_branch(name, task, tiny_model_dir, tmp_path):
    h = make_harness(name, kill_grace_s=2)
    try:
        h.ensure_installed()
    except HarnessUnavailable as exc:
        pytest.skip(f"{name} unavailable: {exc}")
    (tmp_path / "model").symlink_to(tiny_model_dir)
    res, tree = _run(h, task, tmp_path, subagent_policy)
    assert res.termination is TerminationStatus.COMPLETED, res.dirs.log_path.read_text(errors="replace")[-3000:]
    roles = [tree.record_info(i).role for i in range(len(tree.records))]
    assert roles.count("subagent") == 2 and roles[0] == "main" and roles[-1] == "main"
    assert leaves_by_role(tree) == {"main": 1, "subagent": 1}
    assert (res.workspace.path / "sub.txt").read_text() == "SUBAGENT-WORK\n"  # the sub-agent's tool ran
    assert (res.workspace.path / "answer.txt").read_text() == "13\n"


@pytest.mark.parametrize("name", ["claude-code", "codex"])
def test_real_harness_compaction_branch(name, task, tiny_model_dir, tmp_path):
    # Claude Code compacts when the proxy says "prompt is too long"; Codex at its own limit
    opts = {"context_window": 40000, "auto_compact_tokens": 16000} if name == "codex" else {}
    h = make_harness(name, kill_grace_s=2, **opts)
    try:
        h.ensure_installed()
    except HarnessUnavailable as exc:
        pytest.skip(f"{name} unavailable: {exc}")
    (tmp_path / "model").symlink_to(tiny_model_dir)
    res, tree = _run(h, task, tmp_path, compaction_policy,
                     **({"max_context_tokens": 22000} if name == "claude-code" else {}))
    assert res.termination is TerminationStatus.COMPLETED, res.dirs.log_path.read_text(errors="replace")[-3000:]
    roles = [tree.record_info(i).role for i in range(len(tree.records))]
    assert "compaction" in roles and roles[-1] == "main"
    leaves = leaves_by_role(tree)
    assert leaves["compaction"] >= 1 and leaves["main"] >= 1
    comp = tree.record_info(roles.index("compaction"))
    # a branch that shares the system prompt at least (Codex sends its compaction with tools: [],
    # which changes the rendered system turn; Claude Code keeps tools and shares the whole history)
    assert comp.matched_tokens > 1000 and comp.node in tree.leaves()
    assert (res.workspace.path / "steps.txt").read_text().splitlines()[-1] == "step4"
