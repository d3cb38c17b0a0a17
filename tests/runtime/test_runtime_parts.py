"""Pure pieces of the main job's runtime: work items, the incremental step coordinator, resume."""

import numpy as np
import pytest
import torch

from gyre.buffer.work_items import decode_work_item, encode_work_item, work_items
from gyre.scheduler import events as ev
from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.scheduler import Scheduler
from gyre.training.streaming import MicroStepStream


class MS:
    def __init__(self, name, execs, split):
        self.name, self.execution_ids, self.split = name, execs, np.array(split, dtype=bool)


def brute_force_items(mss):
    """Reference: connected components by shared split execution, by repeated merging."""
    groups = [{i} for i in range(len(mss))]
    changed = True
    while changed:
        changed = False
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                ea = {e for i in groups[a] for e, s in zip(mss[i].execution_ids, mss[i].split) if s}
                eb = {e for i in groups[b] for e, s in zip(mss[i].execution_ids, mss[i].split) if s}
                if ea & eb:
                    groups[a] |= groups.pop(b)
                    changed = True
                    break
            if changed:
                break
    return sorted(sorted(g) for g in groups)


@pytest.mark.parametrize("seed", range(20))
def test_work_items_keep_split_executions_together(seed):
    rng = np.random.default_rng(seed)
    mss = []
    for i in range(int(rng.integers(1, 9))):
        execs = [f"e{int(x)}" for x in rng.choice(6, size=int(rng.integers(1, 4)), replace=False)]
        mss.append(MS(f"m{i}", execs, rng.random(len(execs)) < 0.4))
    items = work_items(mss)
    got = sorted(sorted(int(ms.name[1:]) for ms in item) for item in items)
    assert got == brute_force_items(mss)
    assert sum(len(i) for i in items) == len(mss)  # every micro-step exactly once
    for item in items:  # order inside an item follows the packer's order
        idx = [int(ms.name[1:]) for ms in item]
        assert idx == sorted(idx)


def test_work_item_payload_round_trip():
    item = [{"ids": np.arange(5), "w": 0.5}, {"ids": np.arange(3)}]
    payload = encode_work_item(item)
    assert payload.dtype == torch.uint8
    back = decode_work_item(payload)
    assert np.array_equal(back[0]["ids"], np.arange(5)) and back[0]["w"] == 0.5 and len(back) == 2


def test_step_coordinator_reports_each_micro_step_once_and_closes_the_window():
    store = torch.distributed.HashStore()
    stream = MicroStepStream(store, num_cells=3, poll_s=0.001)
    coord = stream.coordinator(step=0)
    assert coord.add("a") == 0 and coord.add("b") == 1
    assert coord.poll() == []
    m, g, payload = stream.claim(0, cell=0, timeout_s=1)
    assert (m, g, payload) == (0, 0, "a")
    stream.finish(0, m, g, cell=0)
    assert coord.poll() == [(0, 0)]
    assert coord.poll() == []  # reported once
    coord.add("c")  # groups keep arriving while the stream is open
    stream.register_joined(0, 1)
    for _ in range(2):
        m, g, _ = stream.claim(0, cell=1, timeout_s=1)
        stream.finish(0, m, g, cell=1)
    assert sorted(coord.poll()) == [(1, 1), (2, 1)]
    assert coord.close(timeout_s=1) == 1  # cells 0..1 take part; cell 2 never joined
    assert stream.claim(0, cell=1, timeout_s=1) is None  # the stream is final


def test_scheduler_resume_at_continues_step_and_version():
    cfg = SchedulerConfig(N=2, B=1, num_cells=2, rollout_concurrency_per_cell=2, max_steps=4)
    s = Scheduler(cfg)
    s.resume_at(2)
    cmds = s.handle(ev.Start(now=0.0))
    dispatch = [c for c in cmds if isinstance(c, ev.Dispatch)]
    assert dispatch and dispatch[0].policy_version == 2 and dispatch[0].group_id == 0
    assert s.steps_done == 2 and s.queue.stream.step == 2
    with pytest.raises(ValueError, match="after Start"):
        s.resume_at(3)
    with pytest.raises(ValueError, match="cannot resume at step 4"):
        Scheduler(cfg).resume_at(4)


def test_a_resumed_run_summary_covers_the_whole_run():
    from gyre.runtime.accounting import merge_summaries

    def part(first, steps, executions, trained, latencies, stale, wall):
        return {"placement": "elastic", "steps": steps, "first_step": first, "executions": executions,
                "executions_closed": {"completed": executions}, "executions_trained": trained,
                "reward_mean_by_step": {}, "role_changes": len(latencies), "switch_failures": 1,
                "switch_latency_s": {"rollout_to_training": latencies, "training_to_rollout": [],
                                     "mean": None},
                "train_rollout_overlap_s": 1.5, "time_per_phase_s": {"rollout": 10.0, "training": 4.0},
                "trajectories_admitted": 2 * executions, "tokens_trained": 100.0 * executions,
                "steps_without_signal": 1, "staleness_mean": stale, "wall_s": wall}

    first = part(0, 2, 16, 16, [0.5, 1.5], 0.0, 20.0)
    assert merge_summaries(None, first) == {**first, "attempts": 1}
    # the first attempt checkpointed after step 2; the resumed one ran steps 3..5
    whole = merge_summaries(first, part(2, 5, 24, 40, [1.0], 1.0, 30.0))
    assert whole["steps"] == 5 and whole["first_step"] == 2 and whole["attempts"] == 2
    assert whole["executions"] == 40 and whole["executions_closed"] == {"completed": 40}
    assert whole["executions_trained"] == 40  # the resumed run already counts every trained id
    assert whole["role_changes"] == 3 and whole["switch_latency_s"]["rollout_to_training"] == [0.5, 1.5, 1.0]
    assert whole["switch_latency_s"]["mean"] == pytest.approx(1.0)
    assert whole["trajectories_admitted"] == 80 and whole["tokens_trained"] == 4000.0
    assert whole["time_per_phase_s"] == {"rollout": 20.0, "training": 8.0}
    assert whole["train_rollout_overlap_s"] == 3.0 and whole["wall_s"] == 50.0
    assert whole["steps_without_signal"] == 2 and whole["switch_failures"] == 2
    assert whole["staleness_mean"] == pytest.approx((0.0 * 2 + 1.0 * 3) / 5)
    assert merge_summaries(whole, part(5, 6, 8, 48, [], 2.0, 5.0))["attempts"] == 3


def test_resume_carries_over_finished_untrained_executions_and_closes_interrupted_ones(tmp_path):
    import json

    from gyre.runtime.carry_over import read_carry_over
    from gyre.runtime.executions import ExecutionTable
    from gyre.runtime.pipeline import ExecutionKey, FinishedExecution
    from gyre.trajectory import TrajectoryStore
    from tests.trajectory.helpers import rec

    run = tmp_path
    store = TrajectoryStore(run / "records")
    for sid in ("a0-g0001-e00004", "a0-g0001-e00005", "a0-g0002-e00008"):
        store.append(rec(0, [1, 2, 3], [4, 5], eid=sid))
    store.close()

    def closed(sid, group, status="completed", outcome="valid", reward=1.0):
        return {"event": "closed", "execution_id": sid, "attempt": 0, "group": group, "task": f"t{group}",
                "termination": "completed", "status": status, "outcome": outcome, "reward": reward}

    log = [{"event": "launched", "execution_id": s, "attempt": 0, "group": g, "task": f"t{g}"}
           for s, g in [("a0-g0000-e00000", 0), ("a0-g0001-e00004", 1), ("a0-g0001-e00005", 1),
                        ("a0-g0001-e00006", 1), ("a0-g0002-e00008", 2), ("a0-g0002-e00009", 2)]]
    log += [closed("a0-g0000-e00000", 0),                      # trained by the checkpoint
            closed("a0-g0001-e00004", 1), closed("a0-g0001-e00005", 1, reward=0.0),
            closed("a0-g0002-e00008", 2), closed("a0-g0002-e00009", 2, outcome="excluded", reward=None),
            closed("a0-g0001-e00006", 1, status="surplus")]
    (run / "executions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))

    carry = read_carry_over(run, trained={"a0-g0000-e00000"})
    assert [g.task_id for g in carry.groups] == ["t1", "t2"]
    assert [[e.execution_id for e in g.executions] for g in carry.groups] == [
        ["a0-g0001-e00004", "a0-g0001-e00005"], ["a0-g0002-e00008"]]
    assert [e.outcome.reward for e in carry.groups[0].executions] == [1.0, 0.0]
    assert len(carry.groups[0].executions[0].tree.records) == 1
    assert carry.interrupted == []

    # an execution launched and never closed is closed as cancelled when the table opens, once
    with open(run / "executions.jsonl", "a") as f:
        f.write(json.dumps({"event": "launched", "execution_id": "a0-g0003-e00012", "attempt": 0, "group": 3,
                            "task": "t3"}) + "\n")
    carry = read_carry_over(run, trained={"a0-g0000-e00000"})
    assert [e["execution_id"] for e in carry.interrupted] == ["a0-g0003-e00012"]
    table = ExecutionTable(run / "executions.jsonl", attempt=1, trained=["a0-g0000-e00000"], carry=carry)
    group = table.next_carried({"t1", "t2"})
    sids = table.add_group(0, [0, 1, 2, 3], object(), group)
    assert sids == ["a0-g0001-e00004", "a0-g0001-e00005", "a1-g0000-e00002", "a1-g0000-e00003"]
    fin = FinishedExecution(ExecutionKey(1, 0, 0), None, group.executions[0].outcome, group.executions[0].tree,
                            execution_id=table.sid(0))
    assert table.closed(fin, "t1", now=1.0).value == "completed"
    table.close()
    assert read_carry_over(run, trained={"a0-g0000-e00000"}).interrupted == []
    lines = [json.loads(x) for x in (run / "executions.jsonl").read_text().splitlines()]
    assert [e["event"] for e in lines[-2:]] == ["closed", "carried_over"]
    assert lines[-2]["status"] == "cancelled" and lines[-1] == {
        "event": "carried_over", "execution_id": "a0-g0001-e00004", "attempt": 1, "group": 0, "task": "t1", "t": 1.0}
    assert table.closed_by_status == {}  # counted in the attempt that closed it


def test_live_weight_pushes_are_counted_and_add_up_over_attempts():
    from gyre.runtime.accounting import RunAccounting, format_summary, merge_summaries
    from gyre.training import control as ctl

    acct = RunAccounting()
    for load_s in (0.0, 0.4, 0.0, 1.2):  # 0: the engine already served that version
        acct.published(ctl.Published(1, 3, load_s))
    assert acct.live_pushes == 2
    before = {"switch_failures": 0, "weight_pushes": {"live": 2, "at_switch": 5}, "executions": 1, "role_changes": 1,
              "train_rollout_overlap_s": 0.0, "trajectories_admitted": 1, "tokens_trained": 1.0,
              "steps_without_signal": 0, "wall_s": 1.0, "executions_closed": {}, "time_per_phase_s": {},
              "switch_latency_s": {"rollout_to_training": [], "training_to_rollout": [], "mean": None},
              "steps": 1, "first_step": 0, "staleness_mean": 0.0, "executions_trained": 1}
    now = {**before, "weight_pushes": {"live": 1, "at_switch": 2}, "first_step": 1, "steps": 2}
    merged = merge_summaries(before, now)
    assert merged["weight_pushes"] == {"live": 3, "at_switch": 7}
    merged.update(placement="elastic", reward_mean_by_step={}, time_per_phase_s={
        "rollout": 1.0, "training": 1.0, "overlap": 0.0, "micro_steps": 0.0, "update": 0.0, "switching": 0.0})
    assert "weight pushes live 3, at switch 7" in format_summary(merged)
