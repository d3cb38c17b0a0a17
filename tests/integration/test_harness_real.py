"""Claude Code, Codex CLI and mini-swe-agent, unmodified, installed from their registries by the
test set-up (npm / PyPI, into the harness cache; skipped only when the registry is
unreachable), each run on a real example task through Gyre's real proxy (rendering, TITO
recording, store) in front of a scripted engine that emits well-formed tool calls. Checked: the
harness runs a tool, the tool result comes back through the proxy, the run ends normally, the
recorded tree is one main path with exact token reuse, and the workspace is evaluated."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.evaluation import OutcomeStatus, RewardManager, RetryPolicy, TerminationStatus
from gyre.harness import HarnessUnavailable, ProxyEndpoint, make_harness
from gyre.tasks import load_tasks
from tests.harness.scripted_proxy import leaves_by_role, scripted_proxy, shell_call, tool_results

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
