"""`pipeline.run_execution` on every failure path, against the real proxy.

A real :class:`~gyre.proxy.server.ProxyServer` (embedded tokenizer, a scripted engine whose reply
is ``SCORE: 7``), real harness processes (:class:`~gyre.harness.CommandHarness`) and real
evaluators.  Each case asserts the outcome status -- ``EXCLUDED`` (no reward, never in a group's
baseline) for anything that could not be assessed, ``PLACEHOLDER`` only for a harness that closed
without assessable work -- and that the execution's key no longer works at the proxy afterwards.
"""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from gyre.evaluation import (
    AssessmentLog,
    EvaluatorSettings,
    OutcomeStatus,
    RetryPolicy,
    RewardManager,
    TerminationStatus,
)
from gyre.harness import CommandHarness, ProxyEndpoint
from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.server import ProxyServer
from gyre.runtime.pipeline import ExecutionKey, run_execution
from gyre.tasks import load_tasks
from gyre.trajectory.admission import AdmissionConfig, trainable_counts

# one model call through the proxy, then write result.txt and exit with the given status
CALL_AND_EXIT = textwrap.dedent('''
    import json, os, sys, urllib.request
    req = urllib.request.Request(os.environ["GYRE_OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode(),
        headers={"Authorization": "Bearer " + os.environ["GYRE_API_KEY"], "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
    open("result.txt", "w").write("done\\n")
    sys.exit(int(sys.argv[1]))
''')


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer

    return ChatRenderer(load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="module")
def proxy(renderer):
    reply = renderer.tokenizer.encode("SCORE: 7", add_special_tokens=False) + [renderer.eos_id]
    srv = ProxyServer(renderer)
    srv.add_engine(ScriptedEngine("engine-0", reply))
    srv.start()
    yield srv
    srv.stop()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def taskset(tmp_path: Path, evaluator: dict, **extra) -> object:
    d = tmp_path / "taskset"
    (d / "ws").mkdir(parents=True, exist_ok=True)
    (d / "ws" / "README").write_text("start\n")
    (d / "tasks.yaml").write_text(json.dumps({"tasks": [
        {"id": "t1", "instruction": "Write result.txt.", "workspace": {"dir": "ws"}, "evaluator": evaluator,
         **extra}]}))
    res = load_tasks(d / "tasks.yaml", check_imports=False)
    assert not res.problems, [str(p) for p in res.problems]
    return res.tasks[0]


def command(script: str, *args: str) -> CommandHarness:
    return CommandHarness([sys.executable, "-c", script, *args], isolation="off", kill_grace_s=0.5)


class Run:
    """One execution registered at the proxy, run through `run_execution`."""

    counter = 0

    def __init__(self, proxy, tmp_path: Path, *, max_retries: int = 0, backoff_s: float = 0.0):
        Run.counter += 1
        self.proxy, self.tmp_path = proxy, tmp_path
        self.key = ExecutionKey(1, Run.counter, Run.counter)
        self.log_path = tmp_path / f"assessments-{Run.counter}.jsonl"
        self.rewards = RewardManager(RetryPolicy(max_retries=max_retries, attempt_timeout_s=30, backoff_s=backoff_s),
                                     AssessmentLog(self.log_path))

    def __call__(self, task, harness, *, timeout_s: float = 60, evaluators: EvaluatorSettings | None = None):
        ex = self.proxy.register_execution(str(self.key), task_id=task.id, harness=harness.name,
                                           role_rules=harness.roles, engine_id="engine-0")
        self.api_key = ex.api_key
        fin = run_execution(self.key, task, harness, self.proxy, self.rewards, ProxyEndpoint(self.proxy.url, ex.api_key),
                            run_dir=self.tmp_path / "run", timeout_s=timeout_s, on_launch=lambda r: None,
                            evaluators=evaluators)
        self.records = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        return fin

    def key_works(self) -> bool:
        r = httpx.post(self.proxy.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       headers={"authorization": f"Bearer {self.api_key}"}, timeout=30)
        assert r.status_code in (200, 401), r.text
        return r.status_code == 200

    def route_released(self) -> bool:
        return str(self.key) not in self.proxy.router.routes


EXIT_CODE_CHECK = {"type": "executable", "command": ["test", "-f", "{workspace}/result.txt"],
                   "scoring": "exit_code", "timeout_s": 30}


def test_completed_execution_is_scored_and_closed(proxy, tmp_path):
    run = Run(proxy, tmp_path)
    fin = run(taskset(tmp_path, EXIT_CODE_CHECK), command(CALL_AND_EXIT, "0"))
    assert fin.outcome.status is OutcomeStatus.VALID and fin.outcome.reward == 1.0
    assert fin.result.termination is TerminationStatus.COMPLETED and len(fin.tree.records) == 1
    assert not run.key_works() and run.route_released()


def test_judge_through_the_proxy_scores_with_role_evaluator(proxy, tmp_path):
    task = taskset(tmp_path, {"type": "judge", "rubric": "10 if result.txt says done", "score_scale": 10,
                              "max_turns": 2, "max_tokens": 16})
    run = Run(proxy, tmp_path)
    fin = run(task, command(CALL_AND_EXIT, "0"))
    assert fin.outcome.status is OutcomeStatus.VALID and fin.outcome.reward == pytest.approx(0.7)
    assert [(r["evaluator"], r["status"], r["score"]) for r in run.records] == [("judge", "valid", 0.7)]
    assert run.records[0]["details"]["reply"] == "SCORE: 7"
    # the harness's call is main (its role rules), the judge's is evaluator despite them; never trained
    roles = [fin.tree.record_info(i).role for i in range(len(fin.tree.records))]
    assert roles == ["main", "evaluator"]
    counts = trainable_counts(fin.tree, AdmissionConfig())
    evaluator_nodes = [nd.node_id for nd in fin.tree.nodes[1:] if fin.tree.records[nd.record].role == "evaluator"]
    assert evaluator_nodes and all(counts[n] == 0 for n in evaluator_nodes)
    assert counts.sum() > 0  # the harness's own output is trainable
    assert not run.key_works() and run.route_released()


def test_launcher_raising_is_excluded(proxy, tmp_path):
    class Broken(CommandHarness):
        def build_command(self, ctx):
            raise RuntimeError("adapter bug")

    run = Run(proxy, tmp_path)
    fin = run(taskset(tmp_path, EXIT_CODE_CHECK), Broken(["true"], isolation="off"))
    assert fin.outcome.status is OutcomeStatus.EXCLUDED and fin.outcome.reward is None
    assert fin.result is None and fin.error == "launcher failed: RuntimeError: adapter bug"
    assert run.records[0]["status"] == "unresolved" and run.records[0]["evaluator"] == "unassessed"
    assert not run.key_works() and run.route_released()


def test_harness_crash_at_start_is_the_placeholder(proxy, tmp_path):
    run = Run(proxy, tmp_path)
    fin = run(taskset(tmp_path, EXIT_CODE_CHECK), command("import sys; sys.exit(3)"))
    assert fin.outcome.status is OutcomeStatus.PLACEHOLDER and fin.outcome.reward == 0.0
    assert fin.result.termination is TerminationStatus.CRASHED and fin.result.workspace is None
    assert len(fin.tree.records) == 0  # the placeholder's empty tree
    assert not run.key_works() and run.route_released()


def test_harness_crash_after_work_is_still_scored(proxy, tmp_path):
    run = Run(proxy, tmp_path)
    fin = run(taskset(tmp_path, EXIT_CODE_CHECK), command(CALL_AND_EXIT, "1"))
    assert fin.result.termination is TerminationStatus.HARNESS_EXIT
    assert fin.outcome.status is OutcomeStatus.VALID and fin.outcome.reward == 1.0  # partial scoring
    assert not run.key_works() and run.route_released()


def test_evaluator_raising_is_excluded(proxy, tmp_path):
    task = taskset(tmp_path, {**EXIT_CODE_CHECK, "scoring": "json:loads"})  # a rule that raises on a CheckResult
    run = Run(proxy, tmp_path, max_retries=1)
    fin = run(task, command(CALL_AND_EXIT, "0"))
    assert fin.outcome.status is OutcomeStatus.EXCLUDED and fin.outcome.reward is None
    assert fin.outcome.attempts == 2 and [r["status"] for r in run.records] == ["unresolved", "unresolved"]
    assert "TypeError" in run.records[0]["details"]["reason"]
    assert not run.key_works() and run.route_released()


def test_evaluator_timing_out_is_excluded(proxy, tmp_path):
    task = taskset(tmp_path, {"type": "executable", "command": ["sleep", "30"], "scoring": "exit_code",
                              "timeout_s": 1})
    run = Run(proxy, tmp_path)
    t0 = time.monotonic()
    fin = run(task, command(CALL_AND_EXIT, "0"))
    assert time.monotonic() - t0 < 20
    assert fin.outcome.status is OutcomeStatus.EXCLUDED and fin.outcome.reward is None
    assert run.records[0]["details"]["reason"] == "test command ran past its 1 s limit; process group killed"
    assert not run.key_works() and run.route_released()


def test_judge_endpoint_down_is_excluded(proxy, tmp_path):
    task = taskset(tmp_path, {"type": "judge", "rubric": "anything", "max_turns": 1})
    run = Run(proxy, tmp_path, max_retries=1)
    down = EvaluatorSettings(judge_base_url=f"http://127.0.0.1:{closed_port()}/v1", judge_model="judge-x")
    fin = run(task, command(CALL_AND_EXIT, "0"), evaluators=down)
    assert fin.outcome.status is OutcomeStatus.EXCLUDED and fin.outcome.reward is None
    assert [r["status"] for r in run.records] == ["unresolved", "unresolved"]
    assert run.records[0]["details"]["reason"].startswith("judge endpoint unreachable: ConnectError")
    assert run.records[0]["details"]["model"] == "judge-x"
    assert not run.key_works() and run.route_released()


def test_build_evaluator_raising_is_excluded_and_the_harness_never_runs(proxy, tmp_path):
    task = taskset(tmp_path, {**EXIT_CODE_CHECK, "scoring": "no_such_module_here:score"})
    run = Run(proxy, tmp_path)
    fin = run(task, command(CALL_AND_EXIT, "0"))
    assert fin.outcome.status is OutcomeStatus.EXCLUDED and fin.outcome.reward is None
    assert fin.result is None and fin.error.startswith("evaluator cannot be built: ModuleNotFoundError")
    assert not (tmp_path / "run" / "executions" / str(run.key)).exists()
    assert run.records[0]["details"]["reason"] == fin.error
    assert not run.key_works() and run.route_released()


def test_retries_stop_when_the_execution_budget_is_spent(proxy, tmp_path):
    # the harness spends ~1.5 s of a 2 s budget; the judge is down: one attempt, then one retry at
    # most before the deadline, not the 20 the policy allows
    slow = "import time; time.sleep(1.5); open('result.txt', 'w').write('x')"
    task = taskset(tmp_path, {"type": "judge", "rubric": "anything", "max_turns": 1})
    run = Run(proxy, tmp_path, max_retries=20, backoff_s=0.4)
    down = EvaluatorSettings(judge_base_url=f"http://127.0.0.1:{closed_port()}/v1")
    fin = run(task, command(slow), timeout_s=2.0, evaluators=down)
    assert fin.result.termination is TerminationStatus.COMPLETED
    assert fin.outcome.status is OutcomeStatus.EXCLUDED and 1 <= fin.outcome.attempts <= 2
    assert fin.outcome.reason.endswith("the execution's time budget is spent")
    assert not run.key_works() and run.route_released()


def test_custom_rm_path_scores_tasks_without_their_own_rule(proxy, tmp_path):
    task = taskset(tmp_path, {"type": "executable", "command": ["echo", "0.25"]})  # no scoring: junit by default
    run = Run(proxy, tmp_path)
    fin = run(task, command(CALL_AND_EXIT, "0"), evaluators=EvaluatorSettings(default_rule="gyre.evaluation:stdout_score_rule"))
    assert fin.outcome.status is OutcomeStatus.VALID and fin.outcome.reward == 0.25
    run2 = Run(proxy, tmp_path)
    fin2 = run2(task, command(CALL_AND_EXIT, "0"))  # without it: junit, and echo writes no report
    assert fin2.outcome.status is OutcomeStatus.EXCLUDED
    assert run2.records[0]["details"]["reason"].startswith("no usable JUnit report")


def test_the_controller_config_carries_the_evaluation_flags():
    from gyre.arguments import parse_args
    from gyre.runtime.config import ControllerConfig

    args = parse_args(["--custom-rm-path", "gyre.evaluation:stdout_score_rule", "--eval-timeout-s", "42",
                       "--judge-base-url", "http://judge.example:8000/v1", "--judge-model", "big-judge"])
    assert ControllerConfig.from_args(args).evaluation == EvaluatorSettings(
        default_rule="gyre.evaluation:stdout_score_rule", default_timeout_s=42.0,
        judge_base_url="http://judge.example:8000/v1", judge_model="big-judge")
