"""examples/slurm/gyre_fleet.sbatch on a real two-node Slurm cluster (``bash tools/test_slurm.sh``).

One job: a Ray cluster started by srun (the head on n1 at 127.0.0.1, a Ray node on n2 at 127.0.0.2,
two execution slots each) and the CPU main job on n1 (two ranks, ``--execution-fleet`` at the
head).  Checks that the run trained its steps, that every execution ran on the fleet and on both
Ray nodes, and that no process of the job (Ray's included) is left after it.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from tests.slurm.test_slurm_multinode import NODE_ADDRS, job_field, leftovers, wait_ended

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "gyre_fleet.sbatch"


def free_ray_port(span: int = 17) -> int:
    """A port P with P..P+span-1 free on both nodes' addresses, below the kernel's ephemeral range (the
    script gives node i Ray ports from P + 10 * i + 1 on; an ephemeral connection must not take one)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(23000, low - span)
        try:
            for p in range(port, port + span):
                for addr in NODE_ADDRS.values():
                    with socket.socket() as s:
                        s.bind((addr, p))
        except OSError:
            continue
        return port
    raise AssertionError("no free block of ports for Ray")


def test_the_job_runs_its_executions_on_a_ray_fleet_of_its_nodes(tmp_path):
    from ray._private.services import resolve_ip_for_localhost  # the tier's environment has Ray (tools/setup.sh)

    run, out = tmp_path / "run", tmp_path / "run.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(GYRE_SLURM_ENV="examples/slurm/cpu.env", GYRE_ENV=sys.prefix, RUN_DIR=str(run),
               RAY_PORT=str(free_ray_port()), FLEET_SLOTS="2", RAY_OBJECT_STORE_BYTES=str(100 * 1024 * 1024),
               FLEET_DIR_ROOT=str(tmp_path))
    r = subprocess.run(["sbatch", "--parsable", "--nodes", "2", "--job-name", "gyre-fleet-test", "--output", str(out),
                        str(SBATCH), "--config", "examples/cpu_tiny.yaml", "--num-cells", "2", "--train-steps", "2",
                        "--no-progress"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    try:
        assert wait_ended(job, 600) == "COMPLETED", out.read_text()[-5000:]
        assert job_field(job, "ExitCode") == "0:0"
        log = out.read_text()
        assert "gyre_fleet.sbatch: fleet at 127.0.0.1:" in log and "2 nodes, 4 execution slots" in log, log[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["executions_trained"] == 16
        # the job's Ray cluster: the head at n1's address (Ray gives a node named 127.0.0.1 the machine's
        # address), the other node at n2's (127.0.0.2), two slots each; rank 0's proxy on the head's
        fleet = {n["node_id"]: n for n in json.loads((run / "fleet_nodes.json").read_text())}
        addrs = {"n1": resolve_ip_for_localhost(NODE_ADDRS["n1"]), "n2": NODE_ADDRS["n2"]}
        assert addrs["n1"] != addrs["n2"]
        assert sorted((n["address"], n["slots"]) for n in fleet.values()) == sorted((a, 2) for a in addrs.values())
        assert f"proxy on {addrs['n1']})" in log
        closed = [json.loads(line) for line in (run / "executions.jsonl").read_text().splitlines()]
        closed = [e for e in closed if e["event"] == "closed"]
        assert len(closed) == summary["executions"] >= 16
        used = {}
        for e in closed:
            meta = json.loads((run / "executions" / e["execution_id"] / "execution.json").read_text())
            node = fleet[meta["fleet"]["node_id"]]  # every execution ran on a node of the job's fleet
            used[node["address"]] = used.get(node["address"], 0) + 1
            # the slot's files were in that node's own directory
            name = {a: n for n, a in addrs.items()}[node["address"]]
            assert Path(meta["fleet"]["root"]).parts[-3].endswith(f"-{job}-{name}")
            assert meta["result"]["workspace"]["ref"].startswith("sha256:")
        assert set(used) == set(addrs.values()), used  # both Ray nodes ran executions
        start, end = (datetime.fromisoformat(job_field(job, k)) for k in ("StartTime", "EndTime"))
        print(f"fleet job {job}: ran {(end - start).total_seconds():.0f} s (Slurm's StartTime to EndTime), "
              f"the run itself {summary['wall_s']:.1f} s; executions per Ray node {used}")
    finally:
        subprocess.run(["scancel", "--full", job], capture_output=True, timeout=30)
        # every rank, Ray process, slot and harness of the job ended with it (processes whose
        # environment names the job, or whose command line or environment names the test's directory)
        left = leftovers([job], str(tmp_path))
        assert not left, f"processes of job {job} still run: {left}"
