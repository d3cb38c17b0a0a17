"""The reference agent (a real child process) through Gyre's real proxy -- chat-template
rendering, TITO recording, trajectory trees, record store -- in front of a scripted engine
whose policy emits well-formed tool calls: the tool result comes back through the proxy, the
run ends normally, the tree has the expected structure (a compaction branch and a sub-agent
branch on a long task), and the preserved workspace is evaluated; a harness that hangs is
killed at its timeout and still scored; a harness that crashes at start gets the placeholder.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.evaluation import OutcomeStatus, RewardManager, RetryPolicy, TerminationStatus
from gyre.harness import ProxyEndpoint, ReferenceHarness
from gyre.harness.reference_agent import COMPACTION_PROMPT
from gyre.tasks import load_tasks
from tests.harness.scripted_proxy import leaves_by_role, scripted_proxy, shell_call, tool_call, tool_results

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tasks():
    res = load_tasks([ROOT / "examples" / "tasks" / "toy", ROOT / "examples" / "tasks" / "bugfix"])
    assert not res.problems
    return res.by_id()


def assess(result, task):
    return RewardManager(RetryPolicy(max_retries=0)).assess(result.closure(task), task.build_evaluator())


def run(proxy, harness, task, run_dir, eid, role_rules=None, **kw):
    key = proxy.register(eid, task.id, harness.name, role_rules=role_rules)
    try:
        return harness.run(task, run_dir, eid, ProxyEndpoint(proxy.base_url, key), model_calls=proxy.model_calls(eid),
                           **kw)
    finally:
        proxy.close(eid)


def assert_exact_reuse(tree, a: int, b: int):
    """Record ``b`` extends record ``a``'s input + output with its stored tokens."""
    ra, rb = tree.record_info(a), tree.record_info(b)
    assert rb.matched_tokens >= ra.num_input_tokens + ra.num_output_tokens


def test_reference_agent_through_the_proxy(tiny_model_dir, tmp_path, tasks):
    task = tasks["toy-add-6-7"]

    def policy(prompt: str) -> str:
        if tool_results(prompt) == 0:
            return "Writing the sum.\n" + tool_call("write_file", {"path": "answer.txt", "content": "13"})
        return "13"

    with scripted_proxy(tiny_model_dir, policy, tmp_path / "records") as proxy:
        res = run(proxy, ReferenceHarness(tools=["write_file"], system_prompt=""), task, tmp_path / "run", "toy-0")
        prompts = list(proxy.prompts)
        tree = proxy.tree("toy-0")
    assert res.termination is TerminationStatus.COMPLETED and res.model_calls == 2 and res.final_message == "13"
    assert "<tool_response>\nwrote 2 characters to answer.txt\n</tool_response>" in prompts[1]  # back through the proxy
    assert len(tree.records) == 2 and leaves_by_role(tree) == {"main": 1}
    assert_exact_reuse(tree, 0, 1)
    assert all(r.delivered for r in tree.records)
    out = assess(res, task)
    assert out.status is OutcomeStatus.VALID and out.reward == 1.0


def long_task_policy(prompt: str) -> str:
    """Main: shell steps writing steps.txt, a delegation, a final answer; compaction: a summary;
    sub-agent: one command and its result. The roles are read off the rendered prompt."""
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    done = tool_results(prompt)
    if last_user.startswith(COMPACTION_PROMPT):  # the summary carries the step count over
        return f"SUMMARY-MARKER step={done}: steps written to steps.txt"
    system = prompt.split("<|im_end|>", 1)[0]
    if "You are a sub-agent" in system:
        if done == 0:
            return shell_call(prompt, "echo SUBAGENT-WORK > sub.txt")
        return "SUBAGENT_RESULT: sub.txt written"
    carried = re.search(r"SUMMARY-MARKER step=(\d+)", prompt)
    step = done + (int(carried.group(1)) if carried else 0)
    if step < 4:  # each step adds a long tool output, so the context passes the threshold after step 2
        return f"Step {step}.\n" + shell_call(prompt, f"echo step{step} >> steps.txt && seq 1 150")
    if step == 4:
        return tool_call("delegate", {"task": "SUBAGENT_TASK: write SUBAGENT-WORK to sub.txt"})
    return "All done. DONE_MARKER"


def test_reference_agent_compaction_and_subagent_branches(tiny_model_dir, tmp_path, tasks):
    task = tasks["toy-add-6-7"]
    with scripted_proxy(tiny_model_dir, long_task_policy, tmp_path / "records") as proxy:
        harness = ReferenceHarness(compact_threshold_tokens=1900, max_turns=20)
        res = run(proxy, harness, task, tmp_path / "run", "long-0", role_rules=harness.roles)
    assert res.termination is TerminationStatus.COMPLETED and res.final_message == "All done. DONE_MARKER"
    tree = proxy.tree("long-0")
    roles = [tree.record_info(i).role for i in range(len(tree.records))]
    assert roles == ["main"] * 3 + ["compaction"] + ["main"] * 2 + ["subagent"] * 2 + ["main"], roles
    # the tree shows both: a compaction branch off the pre-compaction main path, the continued
    # main context, and the sub-agent's fresh context
    assert leaves_by_role(tree) == {"main": 1, "compaction": 1, "subagent": 1}
    assert_exact_reuse(tree, 2, 3)                         # compaction extends the main path
    pre = tree.record_info(2)
    post = tree.record_info(4)
    assert post.matched_tokens < pre.num_input_tokens // 2  # the new context shares only the system prompt
    comp_leaf = tree.record_node(3)
    assert comp_leaf in tree.leaves() and tree.record_node(2) in tree.path(comp_leaf)
    assert_exact_reuse(tree, 4, 5)
    assert_exact_reuse(tree, 6, 7)                          # the sub-agent's own path
    assert tree.record_node(6) not in tree.path(tree.record_node(8))
    ws = res.workspace.path
    assert (ws / "steps.txt").read_text() == "step0\nstep1\nstep2\nstep3\n" and (ws / "sub.txt").exists()
    # the stored tree renders with both roles
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_tree.py"), "--json",
                          str(tmp_path / "records" / "long-0.jsonl")], capture_output=True, text=True, check=True)
    stats = json.loads(out.stdout)
    assert json.dumps(stats).count("compaction") >= 1 and json.dumps(stats).count("subagent") >= 1


def test_hanging_harness_killed_and_scored(tiny_model_dir, tmp_path, tasks):
    task = tasks["bugfix-median-even"]
    fixed = (task.task_dir / "repo" / "textkit" / "stats.py").read_text()

    def policy(prompt: str) -> str:
        if tool_results(prompt) == 0:  # fix the bug ...
            return tool_call("write_file", {"path": "textkit/stats.py", "content": fixed})
        return shell_call(prompt, "sleep 3600")  # ... then hang in a tool

    with scripted_proxy(tiny_model_dir, policy, tmp_path / "records") as proxy:
        harness = ReferenceHarness(bash_timeout_s=7200, kill_grace_s=1)
        res = run(proxy, harness, task, tmp_path / "run", "hang-0", timeout_s=8)
        assert proxy.tree("hang-0").records  # what it did before hanging is recorded
    assert res.termination is TerminationStatus.TIMEOUT and res.exit_code is None and res.duration_s < 30
    out = assess(res, task)
    assert out.status is OutcomeStatus.VALID and out.reward == 1.0 and out.termination is TerminationStatus.TIMEOUT


def test_crash_at_start_gets_the_placeholder(tiny_model_dir, tmp_path, tasks):
    task = tasks["toy-add-6-7"]
    with scripted_proxy(tiny_model_dir, lambda p: "unused", tmp_path / "records") as proxy:
        res = run(proxy, ReferenceHarness(python="/bin/false"), task, tmp_path / "run", "crash-0")
    assert res.termination is TerminationStatus.CRASHED and res.workspace is None and res.model_calls == 0
    out = assess(res, task)
    assert out.status is OutcomeStatus.PLACEHOLDER and out.reward == 0.0


@pytest.mark.slow
def test_reference_agent_against_serve_rollout(tmp_path, tasks):
    """The CLI path: tools/serve_rollout.py with the embedded engine (the untrained tiny model
    answers with text, so the run ends after one call), registration over HTTP, records stored."""
    import os
    import signal
    import threading

    import httpx

    save = tmp_path / "records"
    proc = subprocess.Popen(
        [sys.executable, "tools/serve_rollout.py", "--config", "examples/cpu_tiny.yaml", "--port", "0",
         "--save-dir", str(save), "--num-engines", "1", "--log-level", "WARNING", "--rollout-max-new-tokens", "24"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    box: dict[str, str] = {}
    t = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    t.start()
    t.join(240)
    try:
        base = json.loads(box.get("line", ""))["base_url"]
        task = tasks["toy-add-6-7"]
        reg = httpx.post(base + "/gyre/executions", json={"execution_id": "sr-0", "task_id": task.id,
                                                          "harness": "reference"}, timeout=30).json()
        res = ReferenceHarness(tools=["write_file"], system_prompt="", max_turns=3).run(
            task, tmp_path / "run", "sr-0", ProxyEndpoint(base, reg["api_key"]), timeout_s=120)
        assert httpx.post(f"{base}/gyre/executions/sr-0/close", timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    assert res.termination is TerminationStatus.COMPLETED and res.final_message
    from gyre.trajectory.store import TrajectoryStore

    tree = TrajectoryStore(save).load_tree("sr-0")
    assert len(tree.records) >= 1 and tree.record_info(0).role == "main" and tree.record_info(0).delivered
    out = assess(res, task)
    assert out.status is OutcomeStatus.VALID and out.reward in (0.0, 1.0)
