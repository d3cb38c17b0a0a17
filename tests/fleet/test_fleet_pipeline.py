"""`pipeline.run_execution` through the fleet: a real proxy on 127.0.0.1, a three-node Ray cluster on
this machine, real harness processes on the nodes (:class:`~gyre.harness.CommandHarness`), the
task's executable check run on the node."""

from __future__ import annotations

import functools
import json
import sys
import threading
from pathlib import Path

import pytest

from gyre.evaluation import AssessmentLog, OutcomeStatus, RetryPolicy, RewardManager, TerminationStatus
from gyre.harness import CommandHarness, ProxyEndpoint
from gyre.runtime.pipeline import ExecutionKey, run_execution
from tests.runtime.test_run_execution import CALL_AND_EXIT, EXIT_CODE_CHECK, taskset

ray = pytest.importorskip("ray", reason="ray is not installed")
pytestmark = pytest.mark.slow  # a three-node Ray cluster per test


def launcher_for(run_dir: Path, argv: list[str]):
    from gyre.fleet.launcher import FleetLauncher
    from gyre.harness.roles import RoleRules

    factory = functools.partial(CommandHarness, argv, isolation="off", kill_grace_s=0.5)
    launcher = FleetLauncher(factory, name="command", roles=RoleRules("command"), run_dir=run_dir)
    assert launcher.pool.wait_for_slots(6, timeout_s=120) == 6
    return launcher


def run_one(proxy, launcher, task, run_dir: Path, index: int, log: AssessmentLog, on_launch=lambda r: None,
            group: int = 0):
    key = ExecutionKey(0, group, index)  # the module's proxy keeps every id it registered: each test its own group
    ex = proxy.register_execution(str(key), task_id=task.id, harness=launcher.name, role_rules=launcher.roles,
                                  engine_id="engine-0")
    rewards = RewardManager(RetryPolicy(max_retries=0, attempt_timeout_s=30), log)
    return run_execution(key, task, launcher, proxy, rewards, ProxyEndpoint(proxy.url, ex.api_key), run_dir=run_dir,
                         timeout_s=60, on_launch=on_launch)


def test_executions_run_and_are_assessed_on_the_nodes(cluster, proxy, tmp_path):
    import ray

    ray.init(address=cluster.address)
    run_dir = tmp_path / "run"
    task = taskset(tmp_path, EXIT_CODE_CHECK)
    launcher = launcher_for(run_dir, [sys.executable, "-c", CALL_AND_EXIT, "0"])
    log = AssessmentLog(tmp_path / "assessments.jsonl")
    try:
        fins = [None] * 6
        threads = [threading.Thread(target=lambda i=i: fins.__setitem__(i, run_one(proxy, launcher, task, run_dir, i,
                                                                                   log))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        nodes = set()
        for fin in fins:
            assert fin.outcome.status is OutcomeStatus.VALID and fin.outcome.reward == 1.0, fin
            assert fin.result.termination is TerminationStatus.COMPLETED and fin.result.model_calls == 1
            assert len(fin.tree.records) == 1
            root = run_dir / "executions" / fin.execution_id
            meta = json.loads((root / "execution.json").read_text())
            assert meta["result"]["termination"] == "completed" and meta["result"]["model_calls"] == 1
            nodes.add(meta["fleet"]["node_id"])
            # the workspace lived on the node (under its slot's directory), never in rank 0's run directory
            ws = fin.result.workspace
            assert str(ws.path).startswith(meta["fleet"]["root"]) and ws.ref.startswith("sha256:")
            assert not (root / "workspace").exists() and (root / "harness.log").exists()
            assert not ws.path.exists()  # released after the assessment
        assert len(nodes) == 3  # six executions at once on six slots: every node ran some
        assessed = [json.loads(line) for line in (tmp_path / "assessments.jsonl").read_text().splitlines()]
        assert sorted(a["execution_id"] for a in assessed) == sorted(f.execution_id for f in fins)
        assert {a["evaluator"] for a in assessed} == {"executable"} and all(a["score"] == 1.0 for a in assessed)
        counts = launcher.pool.counts()
        assert counts["free"] == 6 and counts["busy"] == 0 and counts["lost"] == 0
    finally:
        launcher.close()


# one model call, result.txt, then a wait until the test creates the file named by argv[1] (at most
# 120 s), so that a node can be lost, or another join, while it runs
CALL_AND_WAIT = CALL_AND_EXIT.replace(
    "sys.exit(int(sys.argv[1]))",
    "import time\nend = time.monotonic() + 120\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() < end:\n    time.sleep(0.05)")


def fleet_processes() -> list[int]:
    """Processes of this machine that carry a fleet slot's token (harnesses, evaluation commands)."""
    from pathlib import Path as P

    out = []
    for environ in P("/proc").glob("[0-9]*/environ"):
        try:
            if b"GYRE_FLEET_TOKEN=" in environ.read_bytes():
                out.append(int(environ.parent.name))
        except OSError:
            pass
    return out


def test_a_lost_node_fails_its_executions_unresolved_and_the_rest_finish(cluster, proxy, tmp_path):
    import ray

    from tests.processes import wait_until

    ray.init(address=cluster.address)
    run_dir = tmp_path / "run"
    task = taskset(tmp_path, EXIT_CODE_CHECK)
    release = tmp_path / "release"
    launcher = launcher_for(run_dir, [sys.executable, "-c", CALL_AND_WAIT, str(release)])
    log = AssessmentLog(tmp_path / "assessments.jsonl")
    try:
        fins: dict[int, object] = {}
        threads = [threading.Thread(target=lambda i=i: fins.__setitem__(i, run_one(proxy, launcher, task, run_dir, i,
                                                                                   log, group=1))) for i in range(6)]
        for t in threads:
            t.start()
        ids = [str(ExecutionKey(0, 1, i)) for i in range(6)]
        assert wait_until(lambda: all(proxy.counters(s)["calls"] == 1 for s in ids), timeout=120)
        victim = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
        lost = {s for s in ids if launcher.slot_of(s).node_id == victim.node_id}
        assert len(lost) == 2  # both slots of that node were busy
        cluster.remove_node(victim, allow_graceful=False)
        release.touch()  # the executions of the other nodes finish
        for t in threads:
            t.join(240)
        by_id = {f.execution_id: f for f in fins.values()}
        for sid in lost:
            fin = by_id[sid]
            assert fin.result is None and fin.outcome.status is OutcomeStatus.EXCLUDED and fin.outcome.reward is None
            assert "fleet node" in fin.error and "lost while the execution ran" in fin.error, fin.error
            assert len(fin.tree.records) == 1  # its model call, recorded on rank 0, is kept
        for sid in set(ids) - lost:
            fin = by_id[sid]
            assert fin.outcome.status is OutcomeStatus.VALID and fin.outcome.reward == 1.0, fin
        records = [json.loads(line) for line in (tmp_path / "assessments.jsonl").read_text().splitlines()]
        unresolved = {r["execution_id"] for r in records if r["status"] == "unresolved"}
        assert unresolved == lost and not [r for r in records if r["execution_id"] in lost and r["score"] == 0.0]
        # the lost slots' guards killed their harnesses; nothing of theirs runs on this machine
        assert wait_until(lambda: not fleet_processes(), timeout=30), fleet_processes()
        assert launcher.pool.counts()["lost"] == 2
    finally:
        launcher.close()


def test_a_node_that_joins_mid_run_takes_new_dispatches(cluster, proxy, tmp_path):
    import ray

    from tests.fleet.conftest import node_args
    from tests.processes import wait_until as wait

    ray.init(address=cluster.address)
    run_dir = tmp_path / "run"
    task = taskset(tmp_path, EXIT_CODE_CHECK)
    release = tmp_path / "release"
    launcher = launcher_for(run_dir, [sys.executable, "-c", CALL_AND_WAIT, str(release)])
    log = AssessmentLog(tmp_path / "assessments.jsonl")
    try:
        fins: dict[int, object] = {}

        def start(i: int) -> threading.Thread:
            t = threading.Thread(target=lambda: fins.__setitem__(i, run_one(proxy, launcher, task, run_dir, i, log,
                                                                            group=2)))
            t.start()
            return t

        threads = [start(i) for i in range(6)]
        ids = [str(ExecutionKey(0, 2, i)) for i in range(8)]
        assert wait(lambda: all(proxy.counters(s)["calls"] == 1 for s in ids[:6]), timeout=120)
        assert launcher.pool.counts()["free"] == 0  # every slot of the three nodes is busy
        joined = cluster.add_node(**node_args())
        assert launcher.pool.wait_for_slots(8, timeout_s=60) == 8
        threads += [start(6), start(7)]
        assert wait(lambda: all(proxy.counters(s)["calls"] == 1 for s in ids[6:]), timeout=120)
        # the first six still run (they wait for the release): the two new executions can only be on the new node
        assert {launcher.slot_of(s).node_id for s in ids[6:]} == {joined.node_id}
        release.touch()
        for t in threads:
            t.join(240)
        for fin in fins.values():
            assert fin.outcome.status is OutcomeStatus.VALID and fin.outcome.reward == 1.0, fin
    finally:
        launcher.close()
