"""The execution fleet on a local Ray cluster (``bench/executions.py --fleet``).

A ``ray.cluster_utils.Cluster`` of ``--nodes`` nodes on this machine, each offering
``--slots-per-node`` slots (one CPU, a ``--store-mb`` object store), and Gyre's real proxy
(``bench/scale.py``'s, over stand-in engines). ``--executions`` executions go through
:class:`gyre.fleet.FleetLauncher` as the main job sends them (run on a slot, assess on the node
with an executable check, release), at most ``--concurrency`` at once (default: the slots). The
harness is light: bash, in the node's default sandbox (``auto``: bwrap where it runs), writes the
time, makes one chat call with its key through the sandbox's proxy path and exits.

Measured:

* ``first_call_p50_s`` / ``p99`` -- from the launcher's ``run()`` call on rank 0 to the harness's
  first call (the harness's clock: the nodes are this machine);
* ``fleet_overhead_ms_per_execution`` -- rank 0's wall time per execution beyond the harness's own
  run (``run()`` minus the harness's duration, plus ``release()``), less the same measure for the
  same harness run by a local launcher (``--baseline`` executions on this machine's backend): what
  Ray and the shipping add;
* ``rank0_rss_bytes`` / ``rank0_threads`` / ``rank0_fds`` -- the peaks of the bench process (rank 0's
  driver) during the run; ``records_lost`` -- answered calls without a record in the proxy's store.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from gyre.evaluation import EvaluationTarget, EvaluatorSettings
from gyre.harness import CommandHarness, ProxyEndpoint
from gyre.harness.roles import RoleRules
from gyre.tasks import TaskSpec, WorkspaceSpec

# $GYRE_BASE_URL is http://127.0.0.1:PORT inside the sandbox (the forwarder to the gateway socket)
HARNESS = r'''
date +%s.%N > "$GYRE_FINAL_MESSAGE_FILE"
port=${GYRE_BASE_URL##*:}
body='{"model":"policy","max_tokens":16,"messages":[{"role":"user","content":"one call of a light harness"}]}'
exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 3
printf 'POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' "$GYRE_API_KEY" "${#body}" "$body" >&3
status=$(head -c 12 <&3); cat <&3 >/dev/null
case "$status" in *" 200") echo "answered 1"; echo ok > result.txt;; *) echo "status $status"; exit 4;; esac
'''
CHECK = {"type": "executable", "command": ["test", "-f", "{workspace}/result.txt"], "scoring": "exit_code",
         "timeout_s": 30}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def harness_factory() -> CommandHarness:
    """The light harness in the machine's default sandbox (``auto``: bwrap where it runs)."""
    from gyre.sandbox import make_backend

    return CommandHarness(["bash", "-c", HARNESS], kill_grace_s=0.5, backend=make_backend("auto"))


class Peaks:
    """Samples this process's RSS, threads and open files every 0.2 s; keeps the maxima."""

    def __init__(self) -> None:
        self.rss = self.threads = self.fds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.rss = max(self.rss, int(line.split()[1]) * 1024)
            self.threads = max(self.threads, len(os.listdir("/proc/self/task")))
            self.fds = max(self.fds, len(os.listdir("/proc/self/fd")))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one(launcher, task: TaskSpec, run_dir: Path, sid: str, url: str, key: str) -> dict[str, Any]:
    """One execution as the pipeline drives it: run, assess once, release."""
    t0 = time.time()
    w0 = time.perf_counter()
    result = launcher.run(task, run_dir, sid, ProxyEndpoint(url, key), timeout_s=120)
    wall = time.perf_counter() - w0
    score = None
    if result.workspace is not None:
        ev = launcher.evaluator(EvaluatorSettings(), task, run_dir, url + "/v1")
        score = ev.evaluate(EvaluationTarget(sid, result.workspace.path, result.workspace.ref), timeout_s=60).score
    r0 = time.perf_counter()
    launcher.release(sid)
    release = time.perf_counter() - r0
    first = float(result.final_message) - t0 if result.final_message else None
    answered = "answered 1" in (run_dir / "executions" / sid / "harness.log").read_text()
    return {"termination": result.termination.value, "first_call_s": first, "answered": answered, "score": score,
            "overhead_s": wall - result.duration_s + release}


def baseline(n: int, task: TaskSpec, url: str, keys: list[str], work: Path) -> float:
    """Mean per-execution overhead (s) of the same harness run by a local launcher, assessed here."""
    h = harness_factory()
    run_dir = work / "baseline"
    out = []
    try:
        for i, key in enumerate(keys[:n]):
            w0 = time.perf_counter()
            res = h.run(task, run_dir, f"base-{i:05d}", ProxyEndpoint(url, key), timeout_s=120)
            out.append(time.perf_counter() - w0 - res.duration_s)
    finally:
        h.close()
    return float(np.mean(out)) if out else float("nan")


def fleet(executions: int, *, nodes: int, slots_per_node: int, store_mb: int, concurrency: int | None,
          baseline_n: int) -> dict[str, Any]:
    """The fleet phase (module docstring); returns the result's fields."""
    import ray
    from ray.cluster_utils import Cluster

    from gyre.fleet.launcher import FleetLauncher
    from gyre.fleet.slots import SLOT_RESOURCE
    from scale import count_records, start_engines, start_proxy

    work = Path(tempfile.mkdtemp(prefix="gyre-bench-fleet-"))
    os.environ["GYRE_FLEET_DIR"] = str(work / "nodes")
    task_dir = work / "task"
    task_dir.mkdir()
    task = TaskSpec("light", "make one call", WorkspaceSpec(files=(("README", "light\n"),)), CHECK,
                    task_dir=task_dir)
    store = tempfile.mkdtemp(prefix="gyre-bench-fleet-store-")
    engine_procs, engine_urls = start_engines(4, 1, 10)
    proxy_procs, proxies = start_proxy(1, engine_urls, store, 60.0)
    url = proxies.urls[0]
    node = {"num_cpus": 1, "resources": {SLOT_RESOURCE: slots_per_node}, "object_store_memory": store_mb << 20}
    cluster = launcher = None
    try:
        keys = [key for _, key in proxies.register(executions + baseline_n, "fleet")]
        base_s = baseline(baseline_n, task, url, keys[executions:], work)
        cluster = Cluster(initialize_head=True, head_node_args=node)
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # bench/ is not on the nodes' path
        launcher = FleetLauncher(harness_factory, name="command", roles=RoleRules("command"), run_dir=work / "run")
        slots = launcher.pool.wait_for_slots(nodes * slots_per_node, timeout_s=300)
        for i in range(min(slots, executions)):  # every slot builds its harness before the clock starts
            one(launcher, task, work / "warm", f"warm-{i:05d}", url, keys[i])
        peaks = Peaks()
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(concurrency or slots) as pool:
            futures = [pool.submit(one, launcher, task, work / "run", f"fleet-{i:05d}", url, keys[i])
                       for i in range(executions)]
            rows, errors = [], []
            for f in futures:
                try:
                    rows.append(f.result())
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
        wall = time.monotonic() - t0
        peaks.stop()
        counts = launcher.pool.counts()
    finally:
        if launcher is not None:
            launcher.close()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for p in proxy_procs + engine_procs:
            p.kill()
    time.sleep(1.0)
    records = count_records(store)
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    firsts = [r["first_call_s"] for r in rows if r["first_call_s"] is not None]
    answered = sum(r["answered"] for r in rows) + min(slots, executions) + baseline_n  # warm-up and baseline too
    overhead = float(np.mean([r["overhead_s"] for r in rows])) if rows else float("nan")
    return {"nodes": nodes, "slots_per_node": slots_per_node, "slots": slots, "executions": executions,
            "completed": sum(r["termination"] == "completed" for r in rows),
            "scored_1": sum(r["score"] == 1.0 for r in rows), "errors": errors[:3], "wall_s": round(wall, 1),
            "executions_per_s": round(executions / wall, 2), "records": records,
            "records_lost": max(0, answered - records),
            "first_call_p50_s": round(pct(firsts, 50), 4), "first_call_p99_s": round(pct(firsts, 99), 4),
            "rank0_overhead_ms_per_execution": round(1000 * overhead, 1),
            "local_overhead_ms_per_execution": round(1000 * base_s, 1),
            "fleet_overhead_ms_per_execution": round(1000 * (overhead - base_s), 1),
            "rank0_rss_bytes": peaks.rss, "rank0_threads": peaks.threads, "rank0_fds": peaks.fds,
            "slots_lost": counts["lost"]}


if __name__ == "__main__":
    sys.exit("run it as bench/executions.py --fleet")
