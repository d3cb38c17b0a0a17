"""examples/slurm/gyre_multinode.sbatch on a real two-node Slurm cluster (``bash tools/test_slurm.sh``).

The CPU profile (``examples/slurm/cpu.env``): ``sbatch --nodes 2``, one torchrun per node with 2 ranks
each, the embedded CPU default's 4 cells of one rank (elastic placement), weights read by the other
cells from the core's Mooncake snapshot over TCP.  Node n2's servers listen on 127.0.0.2 (its node
name's address), n1's on 127.0.0.1.  A lost node: every process of the job on n2 is killed after the
first checkpoint; the job ends with the reason in its output, and ``scontrol requeue`` resumes it.
Every job is cancelled in a finalizer, and each test checks that no process of its jobs is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.metrics import read_metrics
from gyre.rollout.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "gyre_multinode.sbatch"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")
NODE_ADDRS = {"n1": "127.0.0.1", "n2": "127.0.0.2"}  # tools/setup_slurm.sh's /etc/hosts lines


def job_field(job: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30).stdout
    for part in out.split():
        if part.startswith(name + "="):
            return part.split("=", 1)[1]
    return ""


def wait_ended(job: str, timeout: float) -> str:
    """The job's final state, polled until it ends (the test fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while (state := job_field(job, "JobState")) not in ENDED:
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
        time.sleep(1)
    return state


def job_processes(job: str, node: str | None = None, mark: str | None = None) -> list[int]:
    """Processes on this machine whose environment names Slurm job ``job`` (on ``node`` if given), or
    whose command line or environment holds ``mark`` (a sandbox clears its environment)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            raw = (proc / "environ").read_bytes().decode(errors="replace")
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
        if env.get("SLURM_JOB_ID") == job and (node is None or env.get("SLURMD_NODENAME") == node):
            pids.append(int(proc.name))
        elif mark is not None and (mark in cmdline or mark in raw) and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return pids


def leftovers(jobs: list[str], mark: str, timeout: float = 60) -> list[int]:
    """The processes of ``jobs`` (or naming ``mark``) still running after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := sorted({p for job in jobs for p in job_processes(job, mark=mark)})) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def slurm_jobs(tmp_path):
    """Submits the sbatch script on the CPU profile; cancels every job at the end, then checks that
    none of their processes (nor any naming the test's directory) is left."""
    jobs: list[str] = []

    def submit(run_dir: Path, *gyre_args: str) -> tuple[str, Path]:
        out = run_dir.parent / f"{run_dir.name}.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        env.update(GYRE_SLURM_ENV="examples/slurm/cpu.env", GYRE_ENV=sys.prefix, RUN_DIR=str(run_dir),
                   MASTER_PORT=str(free_port()))
        r = subprocess.run(["sbatch", "--parsable", "--nodes", "2", "--job-name", "gyre-test", "--output", str(out),
                            str(SBATCH), "--config", "examples/cpu_tiny.yaml", "--num-cells", "4", "--no-progress",
                            *gyre_args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        jobs.append(r.stdout.strip().split(";")[0])
        return jobs[-1], out

    yield submit
    for job in jobs:
        subprocess.run(["scancel", "--full", job], capture_output=True, timeout=30)
    left = leftovers(jobs, str(tmp_path))
    assert not left, f"processes of jobs {jobs} still run: {left}"


def engines_of_attempts(run: Path) -> list[dict[str, str]]:
    _, events = read_metrics(run / "metrics.jsonl")
    return [e["engines"] for e in events if e["event"] == "run_start"]


def test_two_nodes_run_the_cpu_job_end_to_end(tmp_path, slurm_jobs):
    run = tmp_path / "run"
    job, out = slurm_jobs(run)
    assert wait_ended(job, 600) == "COMPLETED", out.read_text()[-5000:]
    assert job_field(job, "ExitCode") == "0:0"
    log = out.read_text()
    assert f"gyre_multinode.sbatch: job {job} attempt 1 on n[1-2] (2 x 2 CPU ranks)" in log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["attempts"] == 1 and summary["executions_trained"] == 24
    assert summary["role_changes"] >= 1  # the elastic placement moved cells between rollout and training
    # cells 0-1 (ranks 0-1, rank 0 among them) on n1, cells 2-3 on n2: each engine at its node's address
    (engines,) = engines_of_attempts(run)
    hosts = {eid: url.split("//")[1].rsplit(":", 1)[0] for eid, url in engines.items()}
    assert hosts == {"engine-0": NODE_ADDRS["n1"], "engine-1": NODE_ADDRS["n1"],
                     "engine-2": NODE_ADDRS["n2"], "engine-3": NODE_ADDRS["n2"]}
    # every publication reached every cell: n2's cells loaded versions 1..3 from n1's core over Mooncake
    _, events = read_metrics(run / "metrics.jsonl")
    assert [e["version"] for e in events if e["event"] == "publish"] == [1, 2, 3]
    loaded = {(e["cell"], int(e["version"])) for e in events
              if e["event"] == "role_change" and e["direction"] == "training->rollout"}
    assert {(c, v) for c in (2, 3) for v in (1, 2, 3)} <= loaded
    trained = [json.loads(line)["execution_id"] for line in (run / "executions.jsonl").read_text().splitlines()
               if json.loads(line)["event"] == "trained"]
    assert len(trained) == len(set(trained)) == 24
    assert leftovers([job], str(tmp_path)) == []  # every rank, engine and harness ended with the job
    from datetime import datetime

    start, end = (datetime.fromisoformat(job_field(job, k)) for k in ("StartTime", "EndTime"))
    print(f"two nodes: job {job} ran {(end - start).total_seconds():.0f} s (Slurm's StartTime to EndTime), "
          f"the run itself {summary['wall_s']:.1f} s (summary.json's wall_s)")


def test_a_lost_node_ends_the_job_and_the_requeued_job_resumes(tmp_path, slurm_jobs):
    run = tmp_path / "run"
    job, out = slurm_jobs(run, "--save-interval", "1")
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 400
    while not tracker.exists():
        assert job_field(job, "JobState") in ("PENDING", "RUNNING") and time.monotonic() < deadline, \
            out.read_text()[-3000:]
        time.sleep(0.5)
    # node n2 is lost: every process of the job there dies at once (slurmd itself stays)
    victims = job_processes(job, "n2")
    assert victims, "no process of the job on n2"
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t_kill = time.monotonic()
    assert wait_ended(job, 120) == "FAILED"
    ended_s = time.monotonic() - t_kill
    log = out.read_text()
    assert "srun: error: n2: task 1: Killed" in log, log[-3000:]
    assert "gyre_multinode.sbatch: error: a node's ranks failed" in log
    assert not (run / "summary.json").exists()
    assert leftovers([job], str(tmp_path)) == []  # n1's ranks ended too
    done = int(tracker.read_text())
    assert f"{run} keeps the checkpoint of step {done}: scontrol requeue {job}" in log
    ck = json.loads((run / "checkpoints" / f"iter_{done:07d}" / "controller.json").read_text())
    assert 1 <= done < 3 and ck["iteration"] == done
    before = [json.loads(line) for line in (run / "executions.jsonl").read_text().splitlines()]

    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=30)
    assert wait_ended(job, 600) == "COMPLETED", out.read_text()[-5000:]
    log = out.read_text()
    assert f"gyre_multinode.sbatch: job {job} attempt 2 on n[1-2]" in log and ", resumed" in log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["first_step"] == done and summary["attempts"] == 2
    assert summary["executions_trained"] == 24
    after = [json.loads(line) for line in (run / "executions.jsonl").read_text().splitlines()]
    resumed = [e for e in after[len(before):] if e["event"] == "trained"]
    assert {e["step"] for e in resumed} == set(range(done + 1, 4))  # the step count continues
    assert not set(ck["trained"]) & {e["execution_id"] for e in resumed}  # nothing trained twice
    assert len({e["execution_id"] for e in resumed}) == len(resumed) == 8 * (3 - done)
    finished = {e["execution_id"] for e in before if e["event"] == "closed"
                and e["status"] in ("completed", "timeout") and e["outcome"] != "excluded"}
    carried = {e["execution_id"] for e in after[len(before):] if e["event"] == "carried_over"}
    assert carried == finished - set(ck["trained"])  # finished work is kept, not redone
    rows, _ = read_metrics(run / "metrics.jsonl")
    assert sorted({r["step"] for r in rows}) == [1, 2, 3]
    assert [r["step"] for r in rows][-(3 - done):] == list(range(done + 1, 4))
    assert len(engines_of_attempts(run)) == 2
    assert leftovers([job], str(tmp_path)) == []
    print(f"lost node: the job ended {ended_s:.1f} s after n2's processes were killed")
