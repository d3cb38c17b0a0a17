"""Benchmark: rank 0's proxy path under the paper's load (1,152 live executions), on this machine.

Usage::

    python bench/scale.py [--executions 1152] [--engines 8] [--rates 10,38] [--phase-s 30]
                          [--context 10000,100000,350000,700000] [--quick] [--json [OUT.json]]
    python bench/scale.py --main-job [--executions 512] [--main-job-steps 2] [--json [OUT.json]]

Processes, each its own Python process on this machine:

* ``--engines`` transport-only engines: ``bench/proxy.py``'s stand-in SGLang server answering
  ``/generate`` at once with a short tool call (no model, no tokenizing), each engine on its own
  port, served by ``--engine-processes`` processes (one event loop waking for several engines'
  requests costs less CPU than a process per engine);
* **rank 0's proxy**: :class:`gyre.proxy.server.ProxyServer` with the Qwen tokenizer, a record
  store (every record written before its response completes) and trajectory trees, routing the
  executions over the engines; ``--proxy-workers`` processes, each owning the executions whose
  id hashes to it;
* ``--load-processes`` load generators (``bench/scale_load.py``): the executions, split between
  them; a third each on Anthropic Messages, OpenAI Chat and OpenAI Responses, half of them
  streaming, every call sending the whole conversation, growing it by ``--turn-tokens``; some
  calls are a sub-agent's, some executions compact.

The engines and load generators stand for other machines (GPU nodes, the harnesses' sandboxes);
here they share the proxy's cores, at ``--helpers-nice`` (default 10), below the proxy's priority.
Their CPU is measured and printed per phase.

Phases: **warm** (every execution's first call: its whole initial context is new), **open loop**
at each offered rate of ``--rates`` (calls/s, Poisson), **saturation** (``--saturation-concurrency``
callers back to back: ``calls_per_s_max``). Per phase it reports calls/s served, latency p50/p99
minus the engine's own round trip (``added``), the proxy process's CPU ms per call (from its
``/proc`` CPU time, so the load generators sharing the cores do not count) and its per-stage
times (``GET /gyre/stats``), and the CPU share of the load generators, of the engines, of the
whole machine (busy cores) and of the hypervisor's steal. A phase ends when its calls are
answered for its rates and latencies, and when the proxy has gone idle (their records written)
for its CPU and RSS.

The ``--context`` sweep then gives a few executions an initial context of each size (10k to 700k
tokens), waits until the proxy is idle, and lets them make calls one at a time: ``--sweep-calls``
rounds, the sizes taking turns in each (a slow spell of the machine then weighs on all sizes
alike); it reports the proxy's CPU ms per call by context, read from the workers' own clocks. The paper's context mix (contexts spread evenly
from 0 to 700k tokens) is the mean of that curve, interpolated linearly (``cpu_ms_per_call``). **Headroom** = the CPU the proxy
has (``proxy_workers`` cores) / the CPU the paper's demand needs (1,152 executions x one call per
30 s = 38.4 calls/s x ``cpu_ms_per_call``).

``--main-job`` runs the main job instead, with ``--executions`` live at once
(``bench/scale_main_job.py``): steps completed, records lost, rank 0's threads, fds and RSS.

At the end: ``records_lost`` = calls answered - records in the store, and the proxy's RSS,
threads and file descriptors; ``rss_bytes_per_context_token`` = its RSS growth over the live
context tokens (each execution's last prompt); ``rss_bytes_per_added_context_token`` = its RSS
growth over the load phases / the live tokens they added (what a further token costs, without the
per-execution memory of ``rss_bytes_per_execution_at_warm``). Per phase, ``retry_memory_bytes``
and ``retry_memory_calls``: the answers the proxy keeps for client retries at the phase's end
(``GET /gyre/stats``), and ``retry_memory_bytes_per_call``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from proxy import STAGES  # noqa: E402  (the proxy's per-call stages, as bench/proxy.py reports them)

PAPER_EXECUTIONS = 1152
PAPER_CALL_INTERVAL_S = 30.0
PAPER_MAX_CONTEXT = 700_000
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")


# ----------------------------------------------------------------------------- processes
def _niceness(n: int):
    """A ``preexec_fn`` that lowers the child's scheduling priority by ``n`` (None for 0)."""
    return (lambda: os.nice(n)) if n else None


def _spawn_info(argv: list[str], nice: int = 0) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Start a server process; it and the JSON line it prints first (its ``url``)."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True, preexec_fn=_niceness(nice))
    line = proc.stdout.readline()
    try:
        info = json.loads(line)
    except ValueError:
        info = None
    if isinstance(info, dict) and "url" in info:
        return proc, info
    proc.kill()
    raise RuntimeError(f"{argv[:3]} did not start: {line!r}")


def _spawn(argv: list[str], nice: int = 0) -> tuple[subprocess.Popen, str]:
    proc, info = _spawn_info(argv, nice)
    return proc, info["url"]


def start_engines(engines: int, processes: int, nice: int) -> tuple[list[subprocess.Popen], list[str]]:
    """``engines`` stand-in engines (``bench/proxy.py``'s), each on its own port, served by
    ``processes`` processes: the processes and the engines' URLs."""
    procs, urls = [], []
    for i in range(min(processes, engines)):
        sites = engines // processes + (i < engines % processes)
        proc, info = _spawn_info([str(ROOT / "bench" / "proxy.py"), "--serve", "engine", "--transport-only-engine",
                                  "--tokenizer", "qwen", "--sites", str(sites)], nice)
        procs.append(proc)
        urls += info["urls"]
    return procs, urls


class ProcStat:
    """CPU seconds, RSS, threads and file descriptors of a process from ``/proc``."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.TICK

    def status(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def rss_bytes(self) -> int:
        return self.status("VmRSS") * 1024

    def threads(self) -> int:
        return self.status("Threads")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


def machine_cpu_s() -> tuple[float, float]:
    """CPU seconds this machine's cores have spent busy (all processes and the kernel) and stolen
    by the hypervisor for other guests (``/proc/stat``): a phase's steal share says how much of
    the cores this virtual machine did not get."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq) / ProcStat.TICK, steal / ProcStat.TICK


def total_cpu_s(stats: list[ProcStat]) -> float:
    """CPU seconds of ``stats``' processes together."""
    return sum(s.cpu_s() for s in stats)


class Proxies:
    """Rank 0's proxy processes (``--proxy-workers``), started as the main job starts them
    (:class:`gyre.proxy.workers.ProxyWorkers`): an execution belongs to the worker its id hashes to
    (:func:`gyre.proxy.workers.worker_index`); CPU, RSS, threads and fds are summed."""

    def __init__(self, workers) -> None:
        self.workers = workers
        self.stats, self.urls = [ProcStat(p) for p in workers.pids], list(workers.urls)

    def stop(self) -> None:
        """Stop the workers (records flushed, files closed) and remove their spec file."""
        self.workers.stop()
        self.workers.spec_path.unlink(missing_ok=True)

    def cpu_s(self) -> float:
        return total_cpu_s(self.stats)

    def rss_bytes(self) -> int:
        return sum(s.rss_bytes() for s in self.stats)

    def settle(self, timeout_s: float = 20.0) -> float:
        """Wait until the proxies are idle (under 2 % of a core for half a second: records of the
        earlier phases written, collections done), at most ``timeout_s``; the seconds waited."""
        t0 = time.monotonic()
        prev = self.cpu_s()
        while time.monotonic() - t0 < timeout_s:
            time.sleep(0.5)
            now = self.cpu_s()
            if now - prev <= 0.01:
                break
            prev = now
        return time.monotonic() - t0

    def threads(self) -> int:
        return sum(s.threads() for s in self.stats)

    def fds(self) -> int:
        return sum(s.fds() for s in self.stats)

    def register(self, n: int, prefix: str) -> list[tuple[str, str]]:
        """Register ``n`` executions, each at its worker; their (worker URL, API key)."""
        import httpx

        from gyre.proxy.workers import worker_index

        out = []
        with httpx.Client(timeout=60) as c:
            for i in range(n):
                sid = f"{prefix}-{i:05d}"
                url = self.urls[worker_index(sid, len(self.urls))]
                r = c.post(url + "/gyre/executions", json={"execution_id": sid, "task_id": sid, "harness": "generic"})
                out.append((url, r.json()["api_key"]))
        return out

    def gc(self) -> list[dict[str, Any]]:
        """Each worker's garbage-collector pauses and heap trims (``GET /gyre/stats``)."""
        return [{k: st[k] for k in ("gc", "heap")} for st in (proxy_stats(u, 1 << 62) for u in self.urls)]

    def process_cpu_s(self) -> float:
        """The workers' CPU seconds as they read their own clocks (``GET /gyre/stats``): exact, where
        ``/proc`` counts 10 ms ticks (the sweep's few calls at 10k context cost a few ms each)."""
        return sum(proxy_stats(u, 1 << 62)["process_cpu_s"] for u in self.urls)

    def retry_memory(self) -> dict[str, int]:
        """The answers the workers keep for client retries, together (``GET /gyre/stats``)."""
        snaps = [proxy_stats(u, 1 << 62)["retry_memory"] for u in self.urls]
        return {k: sum(s[k] for s in snaps) for k in ("bytes", "calls", "evicted", "limit_bytes")}

    def stage_counts(self) -> list[int]:
        return [proxy_stats(u, 1 << 62)["stages_recorded"] for u in self.urls]

    def stages_since(self, counts: list[int]) -> list[dict[str, float]]:
        """The per-call stage times every worker recorded since ``counts``."""
        return [x for u, n in zip(self.urls, counts) for x in proxy_stats(u, n)["stage_times"]]


class Load:
    """The load-generator processes of one set of executions."""

    def __init__(self, targets: list[tuple[str, str]], processes: int, args, init_range: tuple[int, int], seed: int,
                 mixed: bool = True):
        self.procs = []
        tmp = Path(tempfile.mkdtemp(prefix="gyre-scale-load-"))
        for p in range(processes):
            idx = list(range(p, len(targets), processes))
            cfg = {"urls": [targets[i][0] for i in idx], "keys": [targets[i][1] for i in idx], "indices": idx, "seed": seed * 1000 + p,
                   "turn_tokens": args.turn_tokens, "init_tokens_min": init_range[0],
                   "init_tokens_max": init_range[1], "subagent_share": args.subagent_share if mixed else 0.0,
                   "compaction_share": args.compaction_share if mixed else 0.0, "chars_per_token": args.chars_per_token}
            (tmp / f"{p}.json").write_text(json.dumps(cfg))
            self.procs.append(subprocess.Popen([sys.executable, str(ROOT / "bench" / "scale_load.py"),
                                                str(tmp / f"{p}.json")], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, text=True, env=ENV,
                                               preexec_fn=_niceness(args.helpers_nice)))

    def run(self, cmd: dict[str, Any], share: str | None = None) -> dict[str, Any]:
        """Send ``cmd`` to every process (``share``: the key divided between them), merge the results."""
        for p in self.procs:
            c = dict(cmd)
            if share:
                c[share] = cmd[share] / len(self.procs)
                if isinstance(cmd[share], int):
                    c[share] = max(1, cmd[share] // len(self.procs))
            p.stdin.write(json.dumps(c) + "\n")
            p.stdin.flush()
        outs = [json.loads(p.stdout.readline()) for p in self.procs]
        return {"calls": sum(o["calls"] for o in outs), "latencies": [x for o in outs for x in o["latencies"]],
                "num_errors": sum(o["num_errors"] for o in outs), "errors": [e for o in outs for e in o["errors"]][:5],
                "wall_s": max(o["wall_s"] for o in outs), "context_tokens": sum(o["context_tokens"] for o in outs)}

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def proxy_stats(url: str, since: int = 0) -> dict[str, Any]:
    """``GET /gyre/stats?since=``: the stage times recorded at index ``since`` on, ``stages_recorded``."""
    import httpx

    return httpx.get(url + "/gyre/stats", params={"since": since}, timeout=120).json()


def engine_round_trip_ms(engine_url: str, tokens: int, n: int = 20) -> float:
    """Median round trip of a ``/generate`` with ``tokens`` input ids straight to an engine."""
    import httpx

    body = json.dumps({"input_ids": [7] * max(1, tokens), "sampling_params": {"max_new_tokens": 256},
                       "return_logprob": True}).encode()
    lat = []
    with httpx.Client(base_url=engine_url, timeout=60) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            c.post("/generate", content=body, headers={"content-type": "application/json"}).raise_for_status()
            lat.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(lat))


def stages_ms(st: list[dict[str, float]]) -> dict[str, float]:
    """Mean per-call time of each proxy stage (``GET /gyre/stats`` entries), ms."""
    return {s[:-2]: 1e3 * float(np.mean([x.get(s, 0.0) for x in st])) for s in STAGES} if st else {}


def phase(name: str, load: Load, cmd: dict[str, Any], share: str | None, proxy: Proxies,
          engine_ms: float, engines: list[ProcStat]) -> dict[str, Any]:
    """Run one phase and measure the proxy over it, and the CPU of the load generator's processes
    and of the engines, which share this machine's cores with the proxy."""
    n0 = proxy.stage_counts()
    loads = [ProcStat(p.pid) for p in load.procs]
    c0, l0, e0, m0, t0 = proxy.cpu_s(), total_cpu_s(loads), total_cpu_s(engines), machine_cpu_s(), time.perf_counter()
    res = load.run(cmd, share)
    wall = time.perf_counter() - t0
    load_cpu, engine_cpu, m1 = total_cpu_s(loads) - l0, total_cpu_s(engines) - e0, machine_cpu_s()
    proxy.settle()  # the records still queued are this phase's calls: their CPU and memory count here
    cpu = proxy.cpu_s() - c0
    st = proxy.stages_since(n0)
    lat = np.asarray(res["latencies"]) * 1e3
    out = {"phase": name, "calls": res["calls"], "errors": res["num_errors"], "error_examples": res["errors"],
           "wall_s": round(wall, 2), "calls_per_s": res["calls"] / wall if wall else 0.0,
           "p50_added_ms": float(np.percentile(lat, 50)) - engine_ms if lat.size else None,
           "p99_added_ms": float(np.percentile(lat, 99)) - engine_ms if lat.size else None,
           "cpu_ms_per_call": 1e3 * cpu / res["calls"] if res["calls"] else None,
           "proxy_cpu_share": cpu / wall if wall else 0.0,
           "load_cpu_share": load_cpu / wall if wall else 0.0,
           "engines_cpu_share": engine_cpu / wall if wall else 0.0,
           "machine_busy_cores": (m1[0] - m0[0]) / wall if wall else 0.0,
           "machine_stolen_cores": (m1[1] - m0[1]) / wall if wall else 0.0,
           "stages_ms": stages_ms(st),
           "context_tokens": res["context_tokens"], "proxy_rss_bytes": proxy.rss_bytes()}
    rm = proxy.retry_memory()
    out.update({"retry_memory_bytes": rm["bytes"], "retry_memory_calls": rm["calls"],
                "retry_memory_bytes_per_call": rm["bytes"] / rm["calls"] if rm["calls"] else None,
                "retry_memory_evicted": rm["evicted"]})
    if cmd.get("rate"):
        out["offered_calls_per_s"] = cmd["rate"]
    print(*out["error_examples"][:2], file=sys.stderr) if out["errors"] else None
    print(f"  {name:<14} calls {out['calls']:>6}  errors {out['errors']:>3}  served {out['calls_per_s']:7.1f}/s  "
          f"added p50 {out['p50_added_ms'] or 0:8.1f} ms  p99 {out['p99_added_ms'] or 0:8.1f} ms  "
          f"proxy CPU {out['cpu_ms_per_call'] or 0:7.2f} ms/call ({out['proxy_cpu_share']:.0%} of a core; "
          f"load {out['load_cpu_share']:.0%}, engines {out['engines_cpu_share']:.0%}; {out['machine_busy_cores']:.2f} of "
          f"{os.cpu_count()} cores busy, {out['machine_stolen_cores']:.2f} stolen)  "
          f"stages {json.dumps({k: round(v, 2) for k, v in out['stages_ms'].items()})}  "
          f"kept for retries {rm['bytes'] / 2**20:.1f} MiB in {rm['calls']} calls", flush=True)
    return out


def count_records(store_dir: str) -> int:
    return sum(p.read_bytes().count(b"\n") for p in Path(store_dir).rglob("*") if p.is_file())


def paper_mix(points: list[tuple[int, float]], max_context: int = PAPER_MAX_CONTEXT) -> float:
    """Mean of a per-call cost curve over contexts spread evenly from 0 to ``max_context``
    (linear between the measured points, flat beyond them)."""
    xs, ys = zip(*sorted(points))
    grid = np.linspace(0, max_context, 1001)
    return float(np.mean(np.interp(grid, xs, ys)))


def add_load_arguments(ap: argparse.ArgumentParser) -> None:
    """The engines, load, proxy and output options ``bench/scale.py`` and ``bench/scale_workers.py``
    share."""
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--engine-processes", type=int, default=2, help="processes serving the engines (each its share)")
    ap.add_argument("--load-processes", type=int, default=2, help="load-generator processes (per proxy)")
    ap.add_argument("--helpers-nice", type=int, default=10,
                    help="niceness of the load generators and engines (0: the proxy's priority)")
    ap.add_argument("--heap-trim-s", type=float, default=60.0,
                    help="the proxy's ProxyConfig.heap_trim_interval_s (0: never trim)")
    ap.add_argument("--saturation-concurrency", type=int, default=64)
    ap.add_argument("--turn-tokens", type=int, default=2000, help="new tokens per call (a tool result)")
    ap.add_argument("--init-tokens", default="0,8000", help="initial context range of the load executions (tokens)")
    ap.add_argument("--subagent-share", type=float, default=0.05)
    ap.add_argument("--compaction-share", type=float, default=0.01)
    ap.add_argument("--json", nargs="?", const="-", help="print the results as JSON (or write them to a file)")


def prepare_load(args) -> tuple[int, int]:
    """Set ``args.chars_per_token`` (the filler text on the proxy's tokenizer); the initial
    context range of ``--init-tokens``."""
    from gyre.embedded_model import ensure_tiny_model, load_tokenizer
    from scale_load import chars_per_token

    args.chars_per_token = chars_per_token(load_tokenizer(ensure_tiny_model("qwen")))
    lo, hi = (int(x) for x in args.init_tokens.split(","))
    return lo, hi


def start_proxy(workers: int, engine_urls: list[str], store: str, heap_trim_s: float) -> Proxies:
    """Rank 0's proxy as ``workers`` processes over the engines on the Qwen tokenizer, recording
    into ``store``: :class:`gyre.proxy.workers.ProxyWorkers`, as the main job's ``--proxy-workers``."""
    from gyre.embedded_model import ensure_tiny_model
    from gyre.proxy.server import ProxyConfig
    from gyre.proxy.workers import ProxyWorkers, WorkerSpec

    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # what the workers inherit
    config = ProxyConfig(max_context_tokens=1 << 21, default_max_tokens=256, heap_trim_interval_s=heap_trim_s or None)
    spec = WorkerSpec(str(ensure_tiny_model("qwen")), store, config,
                      engines=[(f"engine-{i}", url, None) for i, url in enumerate(engine_urls)])
    spec_path = Path(store).parent / f"{Path(store).name}.proxy_spec.pkl"  # beside the store: count_records reads it all
    return Proxies(ProxyWorkers(spec, workers, spec_path=spec_path).start())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executions", type=int, default=None,
                    help=f"live executions (default {PAPER_EXECUTIONS}; 512 with --main-job)")
    ap.add_argument("--proxy-workers", type=int, default=1,
                    help="proxy processes (K); each owns the executions whose id hashes to it")
    ap.add_argument("--rates", default="10,38.4", help="offered call rates of the open-loop phases (calls/s)")
    ap.add_argument("--phase-s", type=float, default=30.0)
    add_load_arguments(ap)
    ap.add_argument("--context", default="10000,100000,350000,700000", help="contexts of the sweep (tokens)")
    ap.add_argument("--sweep-executions", type=int, default=3)
    ap.add_argument("--sweep-calls", type=int, default=10,
                    help="measured calls per sweep execution")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 96 executions, 10 s phases, sweep to 100k")
    mj = ap.add_argument_group("--main-job: the main job with many executions live (bench/scale_main_job.py)")
    mj.add_argument("--main-job", action="store_true",
                    help="run the main job instead (3 cells, --executions live at once, default 512)")
    mj.add_argument("--main-job-steps", type=int, default=2)
    mj.add_argument("--main-job-calls", type=int, default=3, help="model calls per execution")
    mj.add_argument("--main-job-pause-s", type=int, default=12,
                    help="pause after each call (s, + up to 3): executions outlive rank 0's launching of them all")
    mj.add_argument("--main-job-timeout-s", type=float, default=1800.0)
    args = ap.parse_args(argv)
    if args.main_job:
        return main_job(args)
    args.executions = args.executions or PAPER_EXECUTIONS
    if args.quick:
        args.executions, args.phase_s, args.context, args.engines = 96, 10.0, "10000,100000", 2
    init_range = prepare_load(args)
    rates = [float(x) for x in args.rates.split(",") if x]
    contexts = [int(x) for x in args.context.split(",") if x]
    store = tempfile.mkdtemp(prefix="gyre-scale-store-")
    procs: list[subprocess.Popen] = []
    result: dict[str, Any] = {"executions": args.executions, "engines": args.engines,
                              "engine_processes": args.engine_processes,
                              "proxy_workers": args.proxy_workers, "helpers_nice": args.helpers_nice,
                              "paper_demand_calls_per_s": PAPER_EXECUTIONS / PAPER_CALL_INTERVAL_S}
    load = proxy = None
    sweep_loads: list[Load] = []
    try:
        engine_procs, engine_urls = start_engines(args.engines, args.engine_processes, args.helpers_nice)
        procs += engine_procs
        proxy = start_proxy(args.proxy_workers, engine_urls, store, args.heap_trim_s)
        rss0 = proxy.rss_bytes()
        print(f"{args.executions} executions, {args.engines} engines, {args.load_processes} load processes; "
              f"{args.proxy_workers} proxy process(es), RSS {rss0 / 2**20:.0f} MiB", flush=True)
        load = Load(proxy.register(args.executions, "load"), args.load_processes, args, init_range, seed=1)
        engines = [ProcStat(p.pid) for p in engine_procs]
        engine_ms = engine_round_trip_ms(engine_urls[0], sum(init_range) // 2 + 4 * args.turn_tokens)
        print(f"  engine round trip {engine_ms:.2f} ms (subtracted from latencies)", flush=True)
        phases = [phase("warm", load, {"op": "warm", "concurrency": 16}, None, proxy, engine_ms, engines)]
        for r in rates:
            phases.append(phase(f"open {r:g}/s", load, {"op": "open", "rate": r, "duration": args.phase_s}, "rate",
                                proxy, engine_ms, engines))
        phases.append(phase("saturation", load, {"op": "closed", "concurrency": args.saturation_concurrency,
                                                 "duration": args.phase_s}, "concurrency", proxy, engine_ms,
                            engines))
        live_tokens = phases[-1]["context_tokens"]
        rss_load = proxy.rss_bytes()
        result["phases"] = phases
        result["calls_per_s_max"] = phases[-1]["calls_per_s"]
        measured = [ph for ph in phases[1:] if ph["calls"]]
        result["cpu_ms_per_call_load"] = float(np.average([ph["cpu_ms_per_call"] for ph in measured],
                                                          weights=[ph["calls"] for ph in measured]))
        at_demand = min(phases[1:-1] or phases[-1:], key=lambda ph: abs(ph.get("offered_calls_per_s", 0)
                                                                        - result["paper_demand_calls_per_s"]))
        result["p50_added_ms"], result["p99_added_ms"] = at_demand["p50_added_ms"], at_demand["p99_added_ms"]
        result["latency_phase"] = at_demand["phase"]
        result["rss_bytes_per_context_token"] = (rss_load - rss0) / max(live_tokens, 1)
        result["live_context_tokens"] = live_tokens
        # the growth over the load phases alone: what each further token of context costs, without
        # the per-execution and per-connection memory the warm phase already paid (the paper's
        # contexts are ~50x this load's, so that part weighs ~50x less there)
        warm = phases[0]
        result["rss_bytes_per_added_context_token"] = (rss_load - warm["proxy_rss_bytes"]) / max(
            live_tokens - warm["context_tokens"], 1)
        result["rss_bytes_per_execution_at_warm"] = (warm["proxy_rss_bytes"] - rss0) / args.executions
        # ------------------------------------------------------------------ context sweep
        sweep = context_sweep(proxy, contexts, args, sweep_loads)
        result["context_sweep"] = sweep
        if sweep:
            result["cpu_ms_per_call"] = paper_mix([(r["context_tokens"], r["cpu_ms_per_call"]) for r in sweep])
            result["cpu_ratio_max_to_min_context"] = sweep[-1]["cpu_ms_per_call"] / sweep[0]["cpu_ms_per_call"]
        else:
            result["cpu_ms_per_call"] = result["cpu_ms_per_call_load"]
        need = result["paper_demand_calls_per_s"] * result["cpu_ms_per_call"] / 1e3
        result["headroom"] = result["proxy_workers"] / need
        load.close()
        load = None
        time.sleep(1.0)
        answered = sum(ph["calls"] for ph in phases) + sum(
            (r["calls"] for r in sweep), 0) + len(contexts) * args.sweep_executions
        result["calls"] = answered
        result["records_lost"] = answered - count_records(store)
        result["proxy_rss_bytes"] = proxy.rss_bytes()
        result["proxy_threads"] = proxy.threads()
        result["proxy_fds"] = proxy.fds()
        result["proxy_gc"] = proxy.gc()
    finally:
        for ld in (load, *sweep_loads):
            if ld is not None:
                ld.close()
        if proxy is not None:
            proxy.stop()
        for p in procs:
            p.kill()
            p.wait()
    print(f"\nexecutions {result['executions']}  calls {result['calls']}  records_lost {result['records_lost']}  "
          f"calls_per_s_max {result['calls_per_s_max']:.1f}  paper demand {result['paper_demand_calls_per_s']:.1f}/s\n"
          f"cpu_ms_per_call {result['cpu_ms_per_call']:.2f} (paper context mix; {result['cpu_ms_per_call_load']:.2f} "
          f"at the load's mix)  headroom {result['headroom']:.2f} with {result['proxy_workers']} proxy worker(s)\n"
          f"added latency at {result['latency_phase']}: p50 {result['p50_added_ms']:.1f} ms  "
          f"p99 {result['p99_added_ms']:.1f} ms\n"
          f"proxy RSS {result['proxy_rss_bytes'] / 2**20:.0f} MiB  "
          f"{result['rss_bytes_per_context_token']:.1f} B per live context token "
          f"({result['live_context_tokens']:,} tokens; {result['rss_bytes_per_added_context_token']:.1f} B per token "
          f"added by the load phases, {result['rss_bytes_per_execution_at_warm'] / 1024:.0f} KiB per execution "
          f"after its first call)  threads {result['proxy_threads']}  fds {result['proxy_fds']}\n"
          f"garbage collector and heap trims per worker: {result['proxy_gc']}", flush=True)
    _emit(result, args.json)
    return 0


def context_sweep(proxy: Proxies, contexts: list[int], args, loads: list[Load]) -> list[dict[str, Any]]:
    """The proxy's CPU ms per call at each context size: ``--sweep-executions`` executions per
    size, warmed, then ``--sweep-calls`` rounds of one call per execution, the sizes taking turns
    within each round, so that a slower spell of the machine weighs on every size alike. CPU is
    read from the workers' own clocks around each size's calls (less what one reading costs);
    stage times are assigned to the largest size at or below the call's input tokens."""
    if not contexts:
        return []
    for ctx in contexts:
        loads.append(Load(proxy.register(args.sweep_executions, f"ctx{ctx}"), 1, args, (ctx, ctx), seed=ctx,
                          mixed=False))
        loads[-1].run({"op": "warm", "concurrency": 1})
    proxy.settle()  # what the load phases left (records to write) is not a context's cost
    readings = [proxy.process_cpu_s() for _ in range(11)]
    reading_s = float(np.median(np.diff(readings)))  # one reading's own CPU, included in each difference
    n0 = proxy.stage_counts()
    cpu = dict.fromkeys(contexts, 0.0)
    calls = dict.fromkeys(contexts, 0)
    for _ in range(args.sweep_calls):
        for ctx, ld in zip(contexts, loads):
            c0 = proxy.process_cpu_s()
            calls[ctx] += ld.run({"op": "warm", "concurrency": 1})["calls"]
            cpu[ctx] += proxy.process_cpu_s() - c0 - reading_s
    stages: dict[int, list[dict[str, float]]] = {ctx: [] for ctx in contexts}
    for st in proxy.stages_since(n0):
        below = [c for c in contexts if c <= st.get("input_tokens", 0)]
        stages[max(below) if below else contexts[0]].append(st)
    sweep = []
    for ctx in contexts:
        st = stages[ctx]
        row = {"context_tokens": ctx, "calls": calls[ctx], "cpu_ms_per_call": 1e3 * cpu[ctx] / max(calls[ctx], 1),
               "input_tokens": [int(x.get("input_tokens", 0)) for x in st],
               "rendered_tokens": [int(x.get("rendered_tokens", 0)) for x in st],
               "stages_ms": stages_ms(st)}
        sweep.append(row)
        print(f"  context {ctx:>7,}: proxy CPU {row['cpu_ms_per_call']:8.2f} ms/call  stages "
              f"{json.dumps({k: round(v, 2) for k, v in row['stages_ms'].items()})}", flush=True)
    print(f"  (a CPU reading of the workers costs them {1e3 * reading_s:.2f} ms, subtracted)", flush=True)
    return sweep


def _emit(result: dict[str, Any], to: str | None) -> None:
    if to == "-":
        print(json.dumps(result, default=float))
    elif to:
        Path(to).write_text(json.dumps(result, indent=1, default=float))


def main_job(args) -> int:
    """``--main-job``: :func:`scale_main_job.run_main_job` with ``--executions`` (default 512) live."""
    from scale_main_job import run_main_job

    n = args.executions or 512
    with tempfile.TemporaryDirectory(prefix="gyre-scale-main-job-") as work:
        r = run_main_job(executions=n, steps=args.main_job_steps, calls=args.main_job_calls,
                         pause_s=args.main_job_pause_s, n_samples=8, cells=3,
                         work=Path(work), timeout_s=args.main_job_timeout_s)
    print(f"main job: rc {r['main_job_rc']}, {r['steps_completed']} steps in {r['wall_s']:.0f} s; "
          f"{r['executions_closed']} executions {r['statuses']}, at most {r['max_live_executions']} open at the proxy at once "
          f"(launching the first {n} took {r['launch_s_first_n']} s)\n"
          f"calls answered {r['calls_answered']}  records {r['records']}  records_lost {r['records_lost']}\n"
          f"rank 0: threads max {r['rank0_threads_max']}  fds max {r['rank0_fds_max']}  "
          f"RSS max {r['rank0_rss_mb_max']:.0f} MiB", flush=True)
    _emit(r, args.json)
    return 0 if r["main_job_rc"] == 0 and r["records_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
