"""Sandboxed executions on one machine: start latency and memory per backend, and how many live
``bwrap`` executions the machine holds while each makes model calls through its own socket.

1. **Starts** (each backend in ``--backends``): ``--starts`` sandboxes made one after the other, each
   running a one-line harness (bash, its ``/dev/tcp``) that sends a request to the proxy's port on
   its own loopback; the start time is from ``create()`` to that request's arrival at a stamp
   server on the launcher's 127.0.0.1 (through the sandbox's gateway socket and forwarder).
   While ``--rss-sample`` of them idle, the memory of each sandbox's processes is read from
   ``/proc/PID/smaps_rollup`` (RSS, and PSS: shared pages divided among their users), the
   container runtime's client process included for podman.
2. **Live** (bwrap): ``--live`` sandboxed executions are started (at most ``--max-starts`` at once)
   against Gyre's real proxy (``bench/scale.py``'s, over stand-in engines), each a bash harness that
   makes ``--calls`` chat calls with its execution's key, ``--interval-s`` apart, then waits until
   every execution is live before it ends. Reports the most live at once, the start times, the
   calls answered and ``records_lost`` (answered calls without a record in the proxy's store).

3. **Fleet** (``--fleet``, needs Ray): ``--executions`` light executions through the execution fleet
   on a local Ray cluster of ``--nodes`` nodes (``bench/executions_fleet.py`` says what is measured);
   the last line is then that phase's JSON object (``nodes``, ``executions``, ``completed``,
   ``records_lost``, ``first_call_p50_s``, ``first_call_p99_s``, ``fleet_overhead_ms_per_execution``,
   ``rank0_rss_bytes``, ...). ``--quick``: 96 executions.

Prints one JSON object as its last line: ``{"backends": {name: {"start_p50_s", "start_p99_s",
"rss_bytes_per_sandbox", "pss_bytes_per_sandbox", ...}}, "live_max", "records_lost", ...}``.

    .venv/bin/python bench/executions.py --json                 # the defaults: 1,152 live (~5 min)
    .venv/bin/python bench/executions.py --live 64 --starts 10  # a quick look
    .venv/bin/python bench/executions.py --fleet --json         # 1,152 executions on a 3-node fleet
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.server
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scale import count_records, start_engines, start_proxy  # noqa: E402

from gyre.sandbox import Environment, Limits, ProxyTarget, SandboxSpec, make_backend  # noqa: E402
from gyre.sandbox.podman import TEST_IMAGE  # noqa: E402

PATH = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
PING = 'exec 3<>/dev/tcp/127.0.0.1/$1; printf "GET /up/$2 HTTP/1.0\\r\\n\\r\\n" >&3; cat <&3 >/dev/null; exec sleep "$3"'
# $1 port, $2 key, $3 calls, $4 interval, $5 ready file (all live): one chat call per turn, HTTP/1.0
HARNESS = r'''
port=$1; key=$2; calls=$3; interval=$4; ready=$5; ok=0
for i in $(seq 1 "$calls"); do
  body="{\"model\":\"policy\",\"max_tokens\":16,\"messages\":[{\"role\":\"user\",\"content\":\"turn $i of a light harness\"}]}"
  if exec 3<>"/dev/tcp/127.0.0.1/$port"; then
    printf 'POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' "$key" "${#body}" "$body" >&3
    status=$(head -c 12 <&3); cat <&3 >/dev/null; exec 3<&-
    case "$status" in *" 200") ok=$((ok+1));; esac
  fi
  sleep "$interval"
done
echo "answered $ok"
while [ ! -e "$ready" ]; do sleep 1; done
'''


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


class Stamps(http.server.BaseHTTPRequestHandler):
    """Records when each ``GET /up/<name>`` arrives."""

    arrivals: dict[str, float] = {}

    def do_GET(self):
        Stamps.arrivals[self.path.rsplit("/", 1)[-1]] = time.monotonic()
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def memory_of(pids: list[int]) -> tuple[int, int]:
    """RSS and PSS (bytes) summed over ``pids``."""
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


def sandbox_pids(sb, proc) -> list[int]:
    """The processes of one sandbox: its cgroup's (bwrap), the container's (podman), and the host-side
    process the launcher started for it."""
    pids = {proc.pid}
    cgroup = getattr(sb, "cgroup", None)
    if cgroup is not None:
        pids.update(cgroup.pids())
    dirs = getattr(sb, "cgroups", None)
    if dirs and "pids" in dirs:
        try:
            pids.update(int(x) for x in (dirs["pids"] / "cgroup.procs").read_text().split())
        except OSError:
            pass
    return sorted(pids)


def starts(backend_name: str, n: int, rss_sample: int, work: Path) -> dict[str, Any]:
    """Phase 1 for one backend (module docstring)."""
    backend = make_backend(backend_name)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stamps)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    env = Environment("image", TEST_IMAGE) if backend_name in ("podman", "docker") else Environment()
    times, held, teardown = [], [], []
    try:
        for i in range(n):
            own = work / backend_name / f"s{i}"
            own.mkdir(parents=True)
            name = f"{backend_name}{i}"
            spec = SandboxSpec(name=f"gyre-bench-h-{name}-{os.getpid()}", run_label="bench", environment=env,
                               writable=(own,), proxy=ProxyTarget("127.0.0.1", port), workdir=own,
                               limits=Limits(pids=256, memory_bytes=512 << 20))
            t0 = time.monotonic()
            sb = backend.create(spec)
            proc = sb.start(["bash", "-c", PING, "ping", str(spec.proxy.inside_port), name, "600"], env=PATH, cwd=own,
                            log_path=own / "log")
            deadline = t0 + 60
            while name not in Stamps.arrivals:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{backend_name} sandbox {i} never called: {(own / 'log').read_text()[-300:]}")
                time.sleep(0.001)
            times.append(Stamps.arrivals[name] - t0)
            if len(held) < rss_sample:
                held.append((sb, proc))
            else:
                t1 = time.monotonic()
                sb.teardown()
                teardown.append(time.monotonic() - t1)
        time.sleep(1.0)
        mem = [memory_of(sandbox_pids(sb, proc)) for sb, proc in held]
    finally:
        for sb, _ in held:
            sb.teardown()
        backend.close()
        srv.shutdown()
    return {"starts": n, "start_p50_s": round(pct(times, 50), 4), "start_p99_s": round(pct(times, 99), 4),
            "start_max_s": round(max(times), 4), "teardown_p50_s": round(pct(teardown, 50), 4),
            "rss_bytes_per_sandbox": int(np.mean([m[0] for m in mem])) if mem else None,
            "pss_bytes_per_sandbox": int(np.mean([m[1] for m in mem])) if mem else None,
            "memory_sampled": len(mem)}


def live(n: int, calls: int, interval_s: float, max_starts: int, work: Path) -> dict[str, Any]:
    """Phase 2 (module docstring)."""
    store = tempfile.mkdtemp(prefix="gyre-bench-exec-store-")
    engine_procs, engine_urls = start_engines(4, 1, 10)
    proxies = start_proxy(1, engine_urls, store, 60.0)
    url = proxies.urls[0]
    port = int(url.rsplit(":", 1)[1])
    keys = [key for _, key in proxies.register(n, "live")]
    backend = make_backend("bwrap", max_starts=max_starts)
    max_starts = backend.max_starts
    ready = work / "all-live"
    times: list[float] = []
    sandboxes: list[Any] = []
    lock = threading.Lock()
    free_before = _mem_available()

    def launch(i: int):
        own = work / "live" / f"e{i}"
        own.mkdir(parents=True)
        spec = SandboxSpec(name=f"gyre-benchlive-h-{i}-{os.getpid()}", run_label="benchlive", writable=(own,),
                           readonly=(work,), proxy=ProxyTarget("127.0.0.1", port), workdir=own,
                           limits=Limits(pids=64, memory_bytes=256 << 20))
        t0 = time.monotonic()
        sb = backend.create(spec)
        proc = sb.start(["bash", "-c", HARNESS, "harness", str(port), keys[i], str(calls), str(interval_s),
                         str(ready)], env=PATH, cwd=own, log_path=own / "log")
        with lock:
            times.append(time.monotonic() - t0)
            sandboxes.append((sb, proc, own))

    live_max, t_start = 0, time.monotonic()
    # the starting threads live until the teardown: a bwrap sandbox dies with the thread that started it
    pool = cf.ThreadPoolExecutor(max_starts)
    try:
        futures = [pool.submit(launch, i) for i in range(n)]
        errors = [str(f.exception()) for f in futures if f.exception() is not None]
        ramp_s = time.monotonic() - t_start
        time.sleep(min(5.0, interval_s / 2))  # every harness past its start
        live_max = sum(1 for sb, _, _ in sandboxes if sb.alive())
        mem = [memory_of(sandbox_pids(sb, proc)) for sb, proc, _ in sandboxes[:32]]
        low_mem = _mem_available()
        ready.touch()
        exits = [proc.wait(calls * interval_s + 120) for _, proc, _ in sandboxes]
        logs = [(own / "log").read_text() for _, _, own in sandboxes]
        answered = sum(int((log.split("answered ") + ["0"])[1].split()[0]) for log in logs)
        if answered < n * calls:
            bad = next(i for i, log in enumerate(logs) if "answered " + str(calls) not in log)
            print("a live harness's log:", logs[bad][-500:], exits[bad], file=sys.stderr)
    finally:
        for sb, _, _ in sandboxes:
            sb.teardown()
        pool.shutdown()
        backend.close()
        proxies.stop()
        for p in engine_procs:
            p.kill()
    time.sleep(1.0)
    records = count_records(store)
    shutil.rmtree(store, ignore_errors=True)
    return {"live": n, "live_max": live_max, "start_errors": len(errors), "errors": errors[:3],
            "ramp_s": round(ramp_s, 1), "start_p50_s": round(pct(times, 50), 4), "start_p99_s": round(pct(times, 99), 4),
            "calls_answered": answered, "calls_expected": n * calls, "records": records,
            "records_lost": max(0, answered - records),
            "rss_bytes_per_live_sandbox": int(np.mean([m[0] for m in mem])) if mem else None,
            "pss_bytes_per_live_sandbox": int(np.mean([m[1] for m in mem])) if mem else None,
            "machine_memory_used_by_live_bytes": int(free_before - low_mem)}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="bwrap,podman", help="backends of the start phase, comma-separated")
    ap.add_argument("--starts", type=int, default=50, help="sandboxes started one after another per backend")
    ap.add_argument("--rss-sample", type=int, default=10, help="sandboxes whose memory is read")
    ap.add_argument("--live", type=int, default=1152, help="live bwrap executions (0: skip the phase)")
    ap.add_argument("--calls", type=int, default=3, help="chat calls per live execution")
    ap.add_argument("--interval-s", type=float, default=20.0, help="seconds between a live execution's calls")
    ap.add_argument("--max-starts", type=int, default=None,
                    help="sandbox starts at once (the backend's gate; default: its own, twice the cores, >= 4)")
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    ap.add_argument("--fleet", action="store_true", help="only the fleet phase (a local Ray cluster)")
    ap.add_argument("--executions", type=int, default=1152, help="--fleet: executions sent through the fleet")
    ap.add_argument("--quick", action="store_true", help="--fleet: 96 executions")
    ap.add_argument("--nodes", type=int, default=3, help="--fleet: nodes of the local cluster")
    ap.add_argument("--slots-per-node", type=int, default=4, help="--fleet: execution slots per node")
    ap.add_argument("--store-mb", type=int, default=100, help="--fleet: object store of each node (MB)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="--fleet: executions in flight at once (default: the slots)")
    ap.add_argument("--baseline", type=int, default=32,
                    help="--fleet: executions run by a local launcher for the overhead baseline")
    args = ap.parse_args(argv)
    if args.fleet:
        from executions_fleet import fleet

        result = fleet(96 if args.quick else args.executions, nodes=args.nodes, slots_per_node=args.slots_per_node,
                       store_mb=args.store_mb, concurrency=args.concurrency, baseline_n=args.baseline)
        print(json.dumps(result))
        return 0
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-exec-"))
    result: dict[str, Any] = {"backends": {}}
    try:
        for name in [b for b in args.backends.split(",") if b]:
            result["backends"][name] = starts(name, args.starts, args.rss_sample, work)
            if not args.json:
                print(name, json.dumps(result["backends"][name]), file=sys.stderr)
        if args.live:
            result["live_phase"] = live(args.live, args.calls, args.interval_s, args.max_starts, work)
            result["live_max"] = result["live_phase"]["live_max"]
            result["records_lost"] = result["live_phase"]["records_lost"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
