"""The main job end to end: `torchrun pretrain_gyre.py` on the embedded CPU default.

Real ranks (torchrun, gloo), real engines, the real proxy, the reference harness as child
processes, executable evaluators; placements elastic / async / colocate; SIGKILL and resume.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.metrics import read_metrics
from tests.processes import alive, descendants

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error")


def torchrun(run_dir: Path, *extra: str, nproc: int = 3, config: str = "cpu_tiny.yaml"):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(ROOT / "pretrain_gyre.py"), "--config", str(ROOT / "examples" / config), "--run-dir", str(run_dir),
            "--no-progress", *extra]


def run_job(run_dir: Path, *extra: str, timeout: float = 600, nproc: int = 3):
    r = subprocess.run(torchrun(run_dir, *extra, nproc=nproc), capture_output=True, text=True, env=ENV,
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-5000:]
    return json.loads((run_dir / "summary.json").read_text()), r


def executions_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "executions.jsonl").read_text().splitlines()]


def off_loopback(cmd: list[str]) -> tuple[list[str], str | None]:
    """``cmd`` (a torchrun command) launched with a non-loopback MASTER_ADDR, as on a multi-node
    job, and that address; unchanged and ``None`` where this machine has no route off loopback."""
    from gyre.network import node_address

    try:
        addr = node_address("192.0.2.123")
    except OSError:
        return cmd, None
    with socket.socket() as s:
        s.bind((addr, 0))
        port = s.getsockname()[1]
    i = cmd.index("--standalone")
    return [*cmd[:i], "--master-addr", addr, "--master-port", str(port), *cmd[i + 1:]], addr


def test_cpu_tiny_elastic_end_to_end(tmp_path, tiny_model_dir):
    """Launched off loopback where the machine can (as on a multi-node job): the control store, the
    cells' engines and the weight snapshot then use this machine's address on that route."""
    run = tmp_path / "run"
    cmd, addr = off_loopback(torchrun(run, "--tensorboard-dir", str(tmp_path / "tb"), "--rollout-kv-migration"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-5000:]
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads(r.stdout.strip().splitlines()[-1]) == summary
    assert "gyre: reward by step [" in r.stderr and "gyre: time per phase: rollout" in r.stderr
    assert summary["placement"] == "elastic" and summary["steps"] == 3
    assert summary["executions"] >= 24 and summary["executions_trained"] == 24  # N * B per step
    assert sorted(summary["reward_mean_by_step"]) == ["1", "2", "3"]
    assert summary["role_changes"] >= 1 and summary["switch_latency_s"]["rollout_to_training"]
    assert summary["train_rollout_overlap_s"] > 0  # training overlapped with rollout
    assert summary["tokens_trained"] > 0 and summary["trajectories_admitted"] >= 24
    rows, _ = read_metrics(run / "metrics.jsonl")  # time inside micro-steps, summed over the participants
    assert all(0 < r["compute_s"] <= r["consume_s"] * (r["window"] + 1) for r in rows)
    # the simulator reads the run's own files (tools/simulate.py --from-run)
    from gyre.sim.from_run import predict_from_run
    pred = predict_from_run(run)
    assert pred["measured_s"] == summary["wall_s"] and pred["setup"]["executions"] >= 24
    assert pred["setup"]["switch_to_train_s"] > 0 and pred["setup"]["train_step_cell_s"] > 0
    assert all(t > pred["setup"]["median_duration_s"] for t in pred["predicted_s"].values())
    # a call moved off a switching cell continued on a destination that got its KV first
    from gyre.trajectory.store import read_records
    moved = [(a, b) for p in sorted((run / "records").glob("*.jsonl")) for rec in read_records(p)
             for a, b in zip(rec.metadata["attempts"], rec.metadata["attempts"][1:])
             if a["outcome"] == "abort" and a["engine_id"] != b["engine_id"]]
    assert all(b.get("migrated_tokens", 0) > 0 for _, b in moved), moved
    # records and trees, inspectable
    records = sorted((run / "records").glob("*.jsonl"))
    assert len(records) == summary["executions"]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_tree.py"), "--json", str(records[0])],
                         capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert out.returncode == 0, out.stderr
    tree = json.loads(out.stdout)
    assert tree["records"] >= 1 and tree["leaves"] >= 1 and tree["trainable_tokens"] > 0
    # evaluations: one designated assessment per scored execution
    assessed = {json.loads(line)["execution_id"] for line in
                (run / "evaluations" / "assessments.jsonl").read_text().splitlines()}
    assert len(assessed) == summary["executions"]
    # every execution trained exactly once, in one step
    trained = [e["execution_id"] for e in executions_log(run) if e["event"] == "trained"]
    assert len(trained) == len(set(trained)) == 24
    # metrics: one row per step with the reward and training statistics; role changes as events
    rows, events = read_metrics(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    (start,) = [e for e in events if e["event"] == "run_start"]
    assert sorted(start["engines"]) == ["engine-0", "engine-1", "engine-2"]
    assert {url.split("//")[1].rsplit(":", 1)[0] for url in start["engines"].values()} == {addr or "127.0.0.1"}
    for key in ("reward_mean", "loss", "grad_norm", "staleness_mean", "waterlevel", "cells_training",
                "train_inference_mismatch", "tokens_per_s"):
        assert key in rows[0], key
    assert rows[0]["train_inference_mismatch"] < 1e-3  # the engine's log-probs match the trainer's
    assert sum(e["event"] == "role_change" for e in events) == summary["role_changes"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # checkpoints, timeline
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"
    ck = run / "checkpoints" / "iter_0000003"
    assert (ck / "hf" / "config.json").exists() and (ck / "optimizer.pt").exists()
    assert json.loads((ck / "controller.json").read_text())["iteration"] == 3
    assert (run / "timeline.png").stat().st_size > 1000
    timeline = json.loads((run / "timeline.json").read_text())["timeline"]
    assert len(timeline) == 3 and any(state == "training" for cell in timeline for _, _, state in cell)


def test_async_and_colocate_run_the_same_config(tmp_path, tiny_model_dir):
    walls = {}
    for placement in ("async", "colocate"):
        summary, _ = run_job(tmp_path / placement, "--placement", placement, "--num-cells", "2", "--train-steps", "2",
                             nproc=2)
        assert summary["placement"] == placement and summary["steps"] == 2
        walls[placement] = summary["wall_s"]
        if placement == "async":  # cell 0 trains all along, cell 1 serves: no role change
            assert summary["role_changes"] == 0 and summary["train_rollout_overlap_s"] > 0
        else:  # the whole pool switches together: training never overlaps rollout
            assert summary["role_changes"] >= 2 and summary["train_rollout_overlap_s"] == 0
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "compare_runs.py"), str(tmp_path / "async"),
                          str(tmp_path / "colocate")], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert out.returncode == 0, out.stderr
    assert "async" in out.stdout and "colocate" in out.stdout and "wall_s" in out.stdout


def kill_after_first_checkpoint(run: Path, *extra: str, nproc: int = 3) -> tuple[int, Path]:
    """Run the main job in ``run`` on ``nproc`` ranks until its first checkpoint, then SIGKILL one
    rank (rank 1): torchrun tears the job down. Returns torchrun's exit status and the checkpoint
    tracker file."""
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    proc = subprocess.Popen(torchrun(run, *extra, nproc=nproc), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not (tracker.exists() and tracker.read_text().strip() == "1"):
            assert proc.poll() is None and time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.2)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "pretrain_gyre.py"], capture_output=True, text=True)
        pids = sorted(int(p) for p in ranks.stdout.split())
        assert len(pids) == nproc, ranks
        os.kill(pids[1], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, tracker


def test_sigkill_and_resume_loses_nothing(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    cells = ("--num-cells", "2")
    returncode, tracker = kill_after_first_checkpoint(run, *cells, "--train-steps", "3", "--save-interval", "1", nproc=2)
    assert returncode != 0
    before = executions_log(run)
    closed_before = {e["execution_id"] for e in before if e["event"] == "closed"}
    ck = json.loads((run / "checkpoints" / f"iter_{int(tracker.read_text()):07d}" / "controller.json").read_text())
    done = ck["iteration"]
    assert done >= 1

    summary, _ = run_job(run, *cells, "--train-steps", "3", "--save-interval", "1", "--load", str(run), nproc=2)
    assert summary["steps"] == 3 and summary["first_step"] == done
    after = executions_log(run)
    # nothing recorded before the kill was lost: records and assessments are still there
    assessed = {json.loads(line)["execution_id"] for line in
                (run / "evaluations" / "assessments.jsonl").read_text().splitlines()}
    for sid in closed_before:
        assert (run / "records" / f"{sid}.jsonl").exists() and sid in assessed
    # no execution trained twice; the resumed run trains from step `done` + 1 on
    trained_ck = set(ck["trained"])
    resumed = [e for e in after[len(before):] if e["event"] == "trained"]
    assert {e["step"] for e in resumed} == set(range(done + 1, 4))
    assert not trained_ck & {e["execution_id"] for e in resumed}
    assert len({e["execution_id"] for e in resumed}) == len(resumed) == 8 * (3 - done)
    # nothing finished is lost: every execution that closed with an outcome and was not trained by
    # the checkpoint is carried over (under its own id) and trained in the resumed run
    finished = {e["execution_id"] for e in before if e["event"] == "closed"
                and e["status"] in ("completed", "timeout") and e["outcome"] != "excluded"}
    carried = {e["execution_id"] for e in after[len(before):] if e["event"] == "carried_over"}
    assert carried == finished - trained_ck
    assert carried <= {e["execution_id"] for e in resumed}
    # executions in flight at the kill are closed as cancelled, once
    launched = {e["execution_id"] for e in before if e["event"] == "launched"}
    late = [e["execution_id"] for e in after[len(before):] if e["event"] == "closed" and e["status"] == "cancelled"
            and e["execution_id"] in launched - closed_before]
    assert sorted(late) == sorted(launched - closed_before)
    # optimizer steps: the resumed run logged exactly the steps after the checkpoint
    rows, events = read_metrics(run / "metrics.jsonl")
    start = max(i for i, e in enumerate(events) if e["event"] == "run_start")
    resumed_steps = [r["step"] for r in rows if r["time"] >= events[start]["time"]]
    assert resumed_steps == list(range(done + 1, 4))
    # the summary counts every step once, the checkpointed one with its core statistics
    last = {r["step"]: r for r in rows}
    assert summary["tokens_trained"] == sum(r["row_tokens"] for r in last.values())
    assert json.loads((run / "checkpoints" / "iter_0000003" / "controller.json").read_text())["iteration"] == 3
    # the summary and the timeline cover the whole run, both attempts
    assert summary["attempts"] == 2 and summary["executions_trained"] == 24
    assert summary["executions"] >= 24 and summary["role_changes"] >= ck["summary"]["role_changes"]
    timeline = json.loads((run / "timeline.json").read_text())["timeline"]
    starts = [iv[0] for cell in timeline for iv in cell]
    assert min(starts) < 1.0 and max(iv[1] for cell in timeline for iv in cell) > ck["elapsed_s"]
    # resuming the finished run says what to pass, at once
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "examples" / "run_cpu_tiny.sh"), "--run-dir", str(run), "--load", str(run),
                        *cells, "--train-steps", "3"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(ENV, GYRE_NPROC="2"), timeout=120)
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    assert r.stderr.strip().splitlines() == [
        f"pretrain_gyre.py: error: argument --train-steps: {run / 'checkpoints' / 'iter_0000003'} already holds 3 "
        f"steps; pass --train-steps greater than 3 to train further"]


def test_standalone_pool_serves_executions_and_loads_every_publication(tmp_path, tiny_model_dir):
    """With two proxy worker processes on rank 0 (each owning half of the executions)."""
    from gyre.proxy.workers import worker_index
    from gyre.trajectory.store import read_records

    run = tmp_path / "run"
    summary, _ = run_job(run, "--num-cells", "2", "--train-steps", "2", "--standalone-engines", "1",
                         "--standalone-concurrency", "4", "--proxy-workers", "2", nproc=2)
    assert summary["steps"] == 2
    records = [r for p in sorted((run / "records").glob("*.jsonl")) for r in read_records(p)]
    assert {worker_index(r.execution_id, 2) for r in records} == {0, 1}
    assert len({r.execution_id for r in records}) >= summary["executions_trained"]
    by_engine: dict[str, list] = {}
    for r in records:
        by_engine.setdefault(r.engine_id, []).append(r)
    # the scheduler sends launches to the pool first: the standalone engine served executions
    standalone = by_engine.get("standalone-0", [])
    assert len({r.execution_id for r in standalone}) >= 4, sorted(by_engine)
    assert set(by_engine) <= {"standalone-0", "engine-0", "engine-1"}
    # it followed the publications: it served calls with a trained policy
    _, events = read_metrics(run / "metrics.jsonl")
    published = [e["version"] for e in events if e["event"] == "publish"]
    assert published and min(published) >= 1
    assert max(r.policy_version for r in standalone) >= 1
    assert {r.policy_version for r in standalone} <= {0, *published}
    # groups 2 and 3 are dispatched at the first publication (B = 2, no extra dispatch), which
    # waits for the pool: the pool serves them the published weights
    late = [r for r in standalone if int(r.execution_id.split("-g")[1][:4]) >= 2]
    assert late and min(r.policy_version for r in late) >= 1
    # at the end it serves the last published version
    (start,) = [e for e in events if e["event"] == "run_start"]
    assert len(set(start["proxy_workers"])) == 2
    (info,) = [e for e in events if e["event"] == "standalone_engines"]
    assert [(e["engine_id"], int(e["weight_version"])) for e in info["engines"]] == [("standalone-0", max(published))]


def files_of(run: Path) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_size for p in run.rglob("*") if p.is_file()}


def test_sigkill_of_the_launcher_leaves_nothing_running_and_the_run_dir_is_locked(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(torchrun(run, "--num-cells", "2", "--train-steps", "20", "--save-interval", "1", nproc=2),
                            cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not list((run / "executions").glob("*/harness.log")):  # harnesses are running
            assert proc.poll() is None and time.monotonic() < deadline, "no execution started"
            time.sleep(0.2)
        # a second job on the same run directory is refused before it starts
        r = subprocess.run(["bash", str(ROOT / "examples" / "run_cpu_tiny.sh"), "--run-dir", str(run)],
                           capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
        assert r.returncode == 2
        assert r.stderr.strip().splitlines() == [f"pretrain_gyre.py: error: argument --run-dir: {run} is in use "
                                                 f"by another job"]
        deadline = time.monotonic() + 120  # kill while a harness runs (the ranks' children)
        while len(procs := descendants(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(procs) >= 3, procs  # two ranks and at least one harness
        proc.kill()  # SIGKILL the launcher only
        proc.wait()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in procs if alive(p)], "processes outlived the launcher"
        written = files_of(run)
        time.sleep(2)
        assert files_of(run) == written  # nothing writes to the run directory any more
    finally:
        for p in descendants(proc.pid) | {proc.pid}:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "/nonexistent/tasks.jsonl"], "argument --tasks: task file or directory not found: /nonexistent/tasks.jsonl"),
    (["--num-cells", "2"], "argument --num-cells: WORLD_SIZE=3 must be --num-cells x TP x PP = 2 x 1 x 1 = 2 (no data parallelism inside a cell)"),
    (["--placement", "bogus"], "argument --placement: invalid choice: 'bogus' (choose from 'elastic', 'async', 'colocate')"),
    (["--train-steps", "0"], "argument --train-steps: must be >= 1"),
    (["--max-switch-failures", "0"], "argument --max-switch-failures: must be >= 1"),
])
def test_bad_configuration_exits_2_with_one_line(tmp_path, extra, message):
    r = subprocess.run(["bash", str(ROOT / "examples" / "run_cpu_tiny.sh"), "--run-dir", str(tmp_path / "run"), *extra],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"pretrain_gyre.py: error: {message}"]
    assert not (tmp_path / "run").exists()  # nothing started


def test_placements_compare_table_needs_run_dirs(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "compare_runs.py"), str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"compare_runs: error: {tmp_path}: no summary.json (not a finished Gyre run)"]
