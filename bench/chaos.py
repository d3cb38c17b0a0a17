#!/usr/bin/env python
"""The main job's promises under injected faults; prints ONE JSON line.

Usage::

    python bench/chaos.py [--quick] [--sections fuzz,retries,engine_kills,rank_kills]
        [--fuzz-requests N] [--retry-calls N] [--engine-kills N] [--rank-kills K] [--seed S]

Sections (each self-contained; ``sections`` in the JSON line lists those that ran, a field of a
section that did not run is 0):

* ``fuzz`` -- seeded random malformed bodies (wrong types, missing fields, huge and deeply nested
  values, invalid UTF-8, broken or mislabelled gzip, out-of-range sampling parameters) against
  the three model APIs of a real :class:`~gyre.proxy.server.ProxyServer` in front of an embedded
  engine (:class:`~gyre.rollout.embedded_server.EngineServer`), both on 127.0.0.1. Counts answers
  by status (``fuzz_status``), ``responses_5xx``, ``requests_over_30s`` (client timeout 35 s),
  transport errors, and checks the proxy still answers a valid call afterwards.
* ``retries`` -- a harness-like client that gives up after a short read timeout and sends the
  same bytes again, as an SDK does (numbered by ``x-stainless-retry-count``), up to 3 times, then
  once more with a long timeout; an attempt answered in time ends the logical call. One
  execution per logical call, so the records of a logical call are its execution's records.
  ``retry_records_extra`` counts records beyond one per logical call; ``retry_delivered_extra``
  counts delivered ones beyond one; ``retry_client_timeouts`` the attempts that hit the read
  timeout.
* ``engine_kills`` -- two engines as processes (``python -m gyre.rollout.serve``) behind
  ``tools/serve_rollout.py --engine-url`` twice; client threads run executions of streamed and
  non-streamed Chat calls while a killer SIGKILLs one engine mid-generation, moves that engine's
  executions to the other one (``POST /gyre/routes``) and restarts the killed engine on the same
  port. ``harness_errors``: non-200 answers, transport errors and streams that end without
  ``[DONE]`` or with an error event; ``records_lost``: 200 answers beyond the execution's
  delivered records; ``records_duplicated``: records beyond the requests sent;
  ``kill_proxy_retries`` / ``kill_proxy_reroutes``: the proxy's own counters of closed executions
  (engine attempts it retried), which show the kills hit calls in flight.
* ``rank_kills`` -- the cpu_tiny main job (``torchrun pretrain_gyre.py``); a training rank is
  SIGKILLed at a random time after a random checkpoint, and the job resumed with ``--load``.
  From ``executions.jsonl``, the checkpoints and ``metrics.jsonl``: ``finished_lost`` (closed
  with an outcome, not trained by the checkpoint resumed from, not ``carried_over``),
  ``trained_twice`` (executions with more than one ``trained`` event in the final history) and
  ``steps_repeated`` (metrics rows of a step beyond one).

All traffic stays on 127.0.0.1; every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.json_paths import json_deleted, json_paths, json_replaced  # noqa: E402

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}
MAX_KEY = {"chat": "max_tokens", "responses": "max_output_tokens", "anthropic": "max_tokens"}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error")
CLIENT_TIMEOUT_S = 35.0
FIELDS = ["engine_kills", "harness_errors", "records_lost", "records_duplicated", "rank_kills", "finished_lost",
          "trained_twice", "steps_repeated", "fuzz_requests", "responses_5xx", "requests_over_30s", "retry_calls",
          "retry_records_extra"]


def _log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _headers(api: str, key: str) -> dict[str, str]:
    h = {"content-type": "application/json"}
    if api == "anthropic":
        h["x-api-key"] = key
    else:
        h["authorization"] = f"Bearer {key}"
    return h


def _valid(api: str, text: str = "hi", max_tokens: int = 8) -> dict:
    if api == "responses":
        return {"model": "m", "input": [{"type": "message", "role": "user", "content": text}],
                MAX_KEY[api]: max_tokens}
    return {"model": "m", "messages": [{"role": "user", "content": text}], MAX_KEY[api]: max_tokens}


# ---------------------------------------------------------------------------------------- fuzz
WEIRD_STRINGS = ["", "user", "assistant", "tool", "system", "developer", "text", "tool_use", "function",
                 "<|im_end|>", "<tool_call>", "\u0000", "\ud7ff\ue000", "é" * 7, "{\"a\": 1}", "null"]
SAMPLING_BAD = [("temperature", [-1, 2.5, 1e308, "0.5", None, [], True]),
                ("top_p", [0, -0.1, 1.5, "1", {}]),
                ("top_k", [0, -2, 1.5, "5", 2 ** 63]),
                ("min_tokens", [-1, 10 ** 6, 1.5, "2"]),
                ("seed", [1.5, "x", -1, 2 ** 70, []]),
                ("stop", [1, [1, 2], {"a": 1}, ["x"] * 1000]),
                ("n", [0, 2, -1, "1"]),
                ("ignore_eos", ["yes", 1, None])]


class Fuzzer:
    """Seeded generator of malformed request bodies: ``case()`` -> (api, bytes, extra headers, kind)."""

    def __init__(self, seed: int, quick: bool) -> None:
        self.r = random.Random(seed)
        self.quick = quick

    def scalar(self):
        r = self.r
        c = r.randrange(8)
        return [None, r.random() < 0.5, r.randint(-3, 2 ** 40), r.uniform(-1e6, 1e6), r.choice(WEIRD_STRINGS),
                "".join(chr(r.randint(1, 0x2FFF)) for _ in range(r.randint(0, 12))), -0.0, 2 ** 64][c]

    def value(self, depth: int = 0):
        r = self.r
        c = r.random()
        if depth > 3 or c < 0.5:
            return self.scalar()
        if c < 0.75:
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        return {r.choice(["role", "content", "type", "text", "model", "messages", "input", "tools", "name",
                          "arguments", "stream", "max_tokens", "x"]): self.value(depth + 1)
                for _ in range(r.randint(0, 4))}

    def huge(self):
        r = self.r
        n = r.choice([10 ** 4, 10 ** 5, 4 * 10 ** 5] if self.quick else [10 ** 4, 10 ** 5, 10 ** 6, 3 * 10 ** 6])
        return r.choice(["a" * n, "word " * (n // 5), [1] * (n // 10), {f"k{i}": i for i in range(n // 50)}])

    def nested_raw(self, api: str) -> bytes:
        depth = self.r.choice([100, 1000, 10 ** 4, 10 ** 5])
        opener, closer = self.r.choice([("[", "]"), ('{"a":', "}")])
        inner = opener * depth + "1" + closer * depth
        body = json.dumps(_valid(api)).encode()
        key = self.r.choice(["content", "model", "tools", "metadata"])
        return body[:-1] + f', "{key}": {inner}}}'.encode()

    def mutate(self, body, n: int):
        """Replace, delete or retype ``n`` random places of ``body``."""
        for _ in range(n):
            places = list(json_paths(body))
            path = self.r.choice(places)
            op = self.r.random()
            if op < 0.25 and path:
                body = json_deleted(body, path)
            elif op < 0.35:
                body = json_replaced(body, path, self.huge())
            else:
                body = json_replaced(body, path, self.value())
        return body

    def case(self, api: str) -> tuple[bytes, dict[str, str], str]:
        r = self.r
        base = _valid(api, max_tokens=r.choice([1, 4, 8]))
        if api != "responses" and r.random() < 0.4:
            base["messages"] = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
                                {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
        if r.random() < 0.3:
            base["stream"] = True
        kind = r.choice(["random", "mutate", "mutate", "sampling", "sampling", "missing", "bytes", "utf8", "gzip",
                         "nested", "huge"])
        hdr: dict[str, str] = {}
        if kind == "random":
            raw = json.dumps(self.value()).encode()
        elif kind == "mutate":
            raw = json.dumps(self.mutate(base, r.randint(1, 3))).encode()
        elif kind == "sampling":
            for _ in range(r.randint(1, 3)):
                name, bad = r.choice(SAMPLING_BAD)
                base[name] = r.choice(bad)
            if r.random() < 0.3:
                base[MAX_KEY[api]] = r.choice([0, -1, 1.5, "8", 10 ** 12, None, 2 ** 63])
            raw = json.dumps(base).encode()
        elif kind == "missing":
            for k in r.sample(sorted(base), r.randint(1, len(base))):
                base.pop(k)
            raw = json.dumps(base).encode()
        elif kind == "bytes":
            raw = bytes(r.randrange(256) for _ in range(r.randint(0, 200)))
        elif kind == "utf8":
            good = json.dumps(base).encode()
            i = r.randrange(len(good))
            raw = good[:i] + r.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"]) + good[i:]
        elif kind == "gzip":
            good = gzip.compress(json.dumps(base).encode())
            v = r.randrange(5)
            if v == 0:
                raw, hdr = good, {"content-encoding": "gzip"}  # valid
            elif v == 1:
                raw, hdr = good[: r.randint(0, len(good) - 1)], {"content-encoding": "gzip"}
            elif v == 2:
                raw, hdr = good[:10] + bytes(r.randrange(256) for _ in range(40)), {"content-encoding": "gzip"}
            elif v == 3:
                raw, hdr = json.dumps(base).encode(), {"content-encoding": r.choice(["gzip", "deflate"])}
            else:
                raw, hdr = good, {"content-encoding": r.choice(["br", "zstd", "gzip, gzip", "x"])}
        elif kind == "nested":
            raw = self.nested_raw(api)
        else:  # huge
            raw = json.dumps(json_replaced(base, r.choice(list(json_paths(base))), self.huge())).encode()
        return raw, hdr, kind


def _in_process_proxy(tmp: Path, *, cap: int, retry_timeout_s: float = 30.0):
    """An embedded engine and a ProxyServer in this process, both on 127.0.0.1."""
    from gyre.embedded_model import ensure_tiny_model, load_tokenizer
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.config import EngineConfig
    from gyre.rollout.embedded_server import EngineServer
    from gyre.rollout.engine_client import AsyncEngineClient
    from gyre.trajectory.store import TrajectoryStore

    model = ensure_tiny_model("local")
    engine = EngineServer(EngineConfig(model_dir=str(model), max_running_requests=8)).start()
    store = TrajectoryStore(tmp, fsync_every=0)
    srv = ProxyServer(ChatRenderer(load_tokenizer(model)), store=store,
                      config=ProxyConfig(max_context_tokens=4096, max_tokens_cap=cap, default_max_tokens=cap,
                                         retry_timeout_s=retry_timeout_s))
    srv.add_engine(ClientEngine(AsyncEngineClient(engine.url), "engine-0"))
    srv.start()
    return engine, srv, store


def section_fuzz(n: int, seed: int, quick: bool, workers: int = 4) -> dict:
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="chaos-fuzz-"))
    engine, srv, _ = _in_process_proxy(tmp, cap=8)
    out = {"fuzz_requests": 0, "responses_5xx": 0, "requests_over_30s": 0, "fuzz_transport_errors": 0,
           "fuzz_max_s": 0.0}
    status: Counter = Counter()
    kinds_5xx: Counter = Counter()
    examples_5xx: list[dict] = []
    lock = threading.Lock()
    try:
        ex = srv.register_execution()
        fz = Fuzzer(seed, quick)
        apis = sorted(PATHS)
        cases = []
        for i in range(n):
            api = apis[i % 3]
            raw, hdr, kind = fz.case(api)
            cases.append((api, raw, hdr, kind))
        it = iter(cases)
        t_end = time.monotonic() + (600 if quick else 3600)

        def work():
            with httpx.Client(base_url=srv.url, timeout=CLIENT_TIMEOUT_S) as c:
                while time.monotonic() < t_end:
                    with lock:
                        case = next(it, None)
                    if case is None:
                        return
                    api, raw, hdr, kind = case
                    t0 = time.monotonic()
                    try:
                        r = c.post(PATHS[api], content=raw, headers={**_headers(api, ex.api_key), **hdr})
                        code, text = r.status_code, r.text[:300]
                    except httpx.HTTPError as exc:
                        code, text = -1, repr(exc)[:300]
                    dt = time.monotonic() - t0
                    with lock:
                        out["fuzz_requests"] += 1
                        out["fuzz_max_s"] = max(out["fuzz_max_s"], dt)
                        status[str(code)] += 1
                        if dt > 30:
                            out["requests_over_30s"] += 1
                        if code < 0:
                            out["fuzz_transport_errors"] += 1
                        if code >= 500:
                            out["responses_5xx"] += 1
                            kinds_5xx[kind] += 1
                            if len(examples_5xx) < 3:
                                examples_5xx.append({"api": api, "kind": kind, "status": code, "answer": text,
                                                     "body_head": raw[:200].decode("latin-1")})

        threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, t_end - time.monotonic() + 60))
        with httpx.Client(base_url=srv.url, timeout=CLIENT_TIMEOUT_S) as c:
            ok = c.get("/health").status_code == 200
            r = c.post(PATHS["chat"], json=_valid("chat"), headers=_headers("chat", ex.api_key))
            ok = ok and r.status_code == 200
    finally:
        srv.stop()
        engine.stop()
    out["fuzz_max_s"] = round(out["fuzz_max_s"], 2)
    out["fuzz_status"] = dict(sorted(status.items()))
    out["fuzz_5xx_kinds"] = dict(kinds_5xx)
    out["fuzz_5xx_examples"] = examples_5xx
    out["fuzz_healthy_after"] = int(ok)
    return out


# ------------------------------------------------------------------------------------- retries
def section_retries(n: int, seed: int) -> dict:
    import httpx

    r = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="chaos-retry-"))
    engine, srv, store = _in_process_proxy(tmp, cap=64)
    calls: list[tuple[str, int, int]] = []  # (execution id, attempts sent, final status)
    gave_up = 0  # early attempts that hit the client's read timeout
    try:
        t_end = time.monotonic() + 900
        for i in range(n):
            if time.monotonic() > t_end:
                break
            api = sorted(PATHS)[i % 3]
            ex = srv.register_execution()
            body = _valid(api, f"count to {i}", max_tokens=48)
            body["ignore_eos"] = True
            body["stream"] = bool(i % 2)
            raw = json.dumps(body).encode()
            sent, final = 0, -1
            early = r.randint(1, 3)
            for attempt in range(early + 1):  # attempts that give up early, then a patient one
                # an SDK resends the same bytes and numbers its retries (x-stainless-retry-count)
                headers = dict(_headers(api, ex.api_key), **{"x-stainless-retry-count": str(attempt)})
                read = r.choice([0.005, 0.02, 0.05]) if attempt < early else CLIENT_TIMEOUT_S
                sent += 1
                try:
                    with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(CLIENT_TIMEOUT_S, read=read)) as c:
                        resp = c.post(PATHS[api], content=raw, headers=headers)
                        resp.read()
                    final = resp.status_code
                    if final == 200:
                        break  # answered: the client does not retry
                except httpx.TimeoutException:
                    gave_up += 1
                except httpx.HTTPError:
                    pass
            calls.append((ex.execution_id, sent, final))
        time.sleep(1.0)
    finally:
        srv.stop()
        engine.stop()
    extra = delivered_extra = failed = 0
    for eid, sent, final in calls:
        try:
            recs = store.read_records(eid)
        except FileNotFoundError:
            recs = []
        extra += max(0, len(recs) - 1)
        delivered_extra += max(0, sum(bool(x.delivered) for x in recs) - 1)
        failed += final != 200
    return {"retry_calls": len(calls), "retry_requests_sent": sum(s for _, s, _ in calls),
            "retry_client_timeouts": gave_up,
            "retry_records_extra": extra, "retry_delivered_extra": delivered_extra, "retry_final_not_200": failed}


# -------------------------------------------------------------------------------- engine kills
def _start_engine(model: str, port: int, timeout: float = 300.0):
    from gyre.rollout.serve import EmbeddedEngineProcess

    return EmbeddedEngineProcess(model, port=port, env=ENV, extra_args=[
        "--num-threads", "1", "--max-running-requests", "8"]).start(timeout=timeout)


def _chat_call(c, key: str, text: str, stream: bool) -> tuple[bool, str]:
    """One Chat call; (ok, why-not). ok: 200 and, streamed, ``[DONE]`` without an error line."""
    import httpx

    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 48, "ignore_eos": True,
            "stream": stream}
    try:
        if not stream:
            r = c.post(PATHS["chat"], json=body, headers=_headers("chat", key))
            if r.status_code != 200:
                return False, f"status {r.status_code}"
            r.json()["choices"][0]
            return True, ""
        with c.stream("POST", PATHS["chat"], json=body, headers=_headers("chat", key)) as r:
            if r.status_code != 200:
                r.read()
                return False, f"status {r.status_code}"
            done = False
            for line in r.iter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                    elif '"error"' in data and data.startswith('{"error"'):
                        return False, "error event"
            return (True, "") if done else (False, "stream without [DONE]")
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        return False, type(exc).__name__


def section_engine_kills(kills: int, seed: int, workers: int = 4) -> dict:
    import httpx
    from gyre.embedded_model import ensure_tiny_model
    from gyre.trajectory.store import TrajectoryStore

    r = random.Random(seed)
    model = str(ensure_tiny_model("local"))
    save = Path(tempfile.mkdtemp(prefix="chaos-kill-"))
    ports = [_free_port(), _free_port()]
    engines = [_start_engine(model, p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    proxy = subprocess.Popen([sys.executable, str(ROOT / "tools" / "serve_rollout.py"), "--engine-url", urls[0],
                              "--engine-url", urls[1], "--port", "0", "--save-dir", str(save),
                              "--rollout-max-new-tokens", "64", "--log-level", "ERROR"],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    box: dict[str, str] = {}
    t = threading.Thread(target=lambda: box.setdefault("line", proxy.stdout.readline()), daemon=True)
    t.start()
    t.join(300)
    base = json.loads(box["line"])["base_url"]
    names = httpx.get(base + "/health").json()["engines"]  # engine-0, engine-1 in --engine-url order
    stop = threading.Event()
    lock = threading.Lock()
    stats = {"harness_errors": 0, "calls": 0, "inflight": 0, "retries": 0, "reroutes": 0}
    why: Counter = Counter()
    per_ex: dict[str, list[int]] = {}  # execution id -> [requests sent, 200 answers]
    deadline = time.monotonic() + max(300, kills * 60)

    def client(w: int):
        with httpx.Client(base_url=base, timeout=CLIENT_TIMEOUT_S) as c:
            for n_ex in range(100000):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                eid = f"w{w}-{n_ex}"
                key = c.post("/gyre/executions", json={"execution_id": eid, "task_id": "chaos"}).json()["api_key"]
                per_ex[eid] = [0, 0]
                for k in range(4):
                    with lock:
                        stats["inflight"] += 1
                    ok, reason = _chat_call(c, key, f"execution {eid} call {k}", stream=bool((w + k) % 2))
                    with lock:
                        stats["inflight"] -= 1
                        stats["calls"] += 1
                        per_ex[eid][0] += 1
                        per_ex[eid][1] += ok
                        if not ok:
                            stats["harness_errors"] += 1
                            why[reason] += 1
                counters = c.post(f"/gyre/executions/{eid}/close").json().get("counters", {})
                with lock:
                    stats["retries"] += counters.get("retries", 0)
                    stats["reroutes"] += counters.get("reroutes", 0)

    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(workers)]
    for th in threads:
        th.start()
    done_kills = 0
    restart_s: list[float] = []
    try:
        with httpx.Client(base_url=base, timeout=CLIENT_TIMEOUT_S) as admin:
            for k in range(kills):
                if time.monotonic() > deadline:
                    break
                for _ in range(100):  # wait (bounded) for calls in flight
                    if stats["inflight"] >= 2:
                        break
                    time.sleep(0.05)
                time.sleep(r.uniform(0.05, 0.6))
                i = k % 2
                os.killpg(engines[i].proc.pid, signal.SIGKILL)
                engines[i].proc.wait(30)
                done_kills += 1
                for e in admin.get("/gyre/executions").json()["executions"]:
                    if not e["closed"] and e["engine_id"] == names[i]:
                        admin.post("/gyre/routes", json={"execution_id": e["execution_id"], "engine_id": names[1 - i]})
                t0 = time.monotonic()
                engines[i] = _start_engine(model, ports[i])
                restart_s.append(time.monotonic() - t0)
                _log(f"engine kill {done_kills}/{kills}: calls {stats['calls']}, errors {stats['harness_errors']}")
    finally:
        stop.set()
        for th in threads:
            th.join(120)
        proxy.send_signal(signal.SIGTERM)
        try:
            proxy.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proxy.pid, signal.SIGKILL)
        for e in engines:
            if e.proc is not None and e.proc.poll() is None:
                os.killpg(e.proc.pid, signal.SIGKILL)
    store = TrajectoryStore(save)
    lost = dup = 0
    for eid, (sent, ok) in per_ex.items():
        try:
            recs = store.read_records(eid)
        except FileNotFoundError:
            recs = []
        lost += max(0, ok - sum(bool(x.delivered) for x in recs))
        dup += max(0, len(recs) - sent)
    return {"engine_kills": done_kills, "harness_errors": stats["harness_errors"], "records_lost": lost,
            "records_duplicated": dup, "kill_calls": stats["calls"],
            "kill_proxy_retries": stats["retries"], "kill_proxy_reroutes": stats["reroutes"], "kill_errors_by_kind": dict(why),
            "engine_restart_s_max": round(max(restart_s, default=0.0), 1)}


# ---------------------------------------------------------------------------------- rank kills
def _torchrun(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
            str(ROOT / "pretrain_gyre.py"), "--config", str(ROOT / "examples" / "cpu_tiny.yaml"), "--run-dir", str(run),
            "--no-progress", *extra]


def _pids_of_ranks(launcher: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher), "-f", "pretrain_gyre.py"], capture_output=True, text=True)
    return sorted(int(p) for p in out.stdout.split())


def section_rank_kills(kills: int, seed: int, train_steps: int) -> dict:
    from gyre.metrics import read_metrics

    r = random.Random(seed)
    run = Path(tempfile.mkdtemp(prefix="chaos-rank-")) / "run"
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    steps = ["--train-steps", str(train_steps), "--save-interval", "1"]
    done_kills = 0
    attempts_failed = 0
    last_resume_at = 0
    log = run.parent / "job.log"
    for k in range(kills + 1):
        resume = ["--load", str(run)] if k > 0 else []
        have = int(tracker.read_text()) if tracker.exists() else 0
        if k < kills and have >= train_steps - 1:
            break  # nothing left to kill in
        with open(log, "a") as f:
            proc = subprocess.Popen(_torchrun(run, *steps, *resume), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                    stderr=f, start_new_session=True)
        if k > 0:
            last_resume_at = len((run / "executions.jsonl").read_text().splitlines())
        if k == kills:
            try:
                rc = proc.wait(1800)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = -9
            attempts_failed += rc != 0
            break
        # kill after this checkpoint, before the last, leaving a step for each kill still to come
        target = r.randint(have + 1, max(have + 1, train_steps - 1 - (kills - 1 - k)))
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline and proc.poll() is None:
            if tracker.exists() and tracker.read_text().strip() and int(tracker.read_text()) >= target:
                break
            time.sleep(0.2)
        time.sleep(r.uniform(0, 5))
        pids = _pids_of_ranks(proc.pid)
        if proc.poll() is None and pids:
            os.kill(r.choice(pids), signal.SIGKILL)
            done_kills += 1
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        _log(f"rank kill {done_kills}/{kills} after checkpoint {tracker.read_text().strip() if tracker.exists() else '-'}")
    # ---- the promises, from the final history
    events = [json.loads(x) for x in (run / "executions.jsonl").read_text().splitlines() if x.strip()]
    # an execution trained at two different steps (a step trained again after a kill, before its
    # checkpoint was written, shows in steps_repeated instead)
    steps_of: dict[str, set[int]] = {}
    for e in events:
        if e["event"] == "trained":
            steps_of.setdefault(e["execution_id"], set()).add(e["step"])
    trained_twice = sum(1 for v in steps_of.values() if len(v) > 1)
    # finished before the last resume: closed with an outcome in a killed attempt
    killed_part = events[:last_resume_at]
    finished = {e["execution_id"] for e in killed_part if e["event"] == "closed"
                and e.get("status") in ("completed", "timeout") and e.get("outcome") != "excluded"}
    carried = {e["execution_id"] for e in events[last_resume_at:] if e["event"] == "carried_over"}
    final = int(tracker.read_text()) if tracker.exists() else 0
    trained_final: set[str] = set()
    if final:
        ck = json.loads((run / "checkpoints" / f"iter_{final:07d}" / "controller.json").read_text())
        trained_final = set(ck.get("trained", []))
    finished_lost = len(finished - trained_final - carried)
    rows, _ = read_metrics(run / "metrics.jsonl")
    per_step = Counter(row["step"] for row in rows)
    steps_repeated = sum(n - 1 for n in per_step.values())
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    return {"rank_kills": done_kills, "finished_lost": finished_lost, "trained_twice": trained_twice,
            "steps_repeated": steps_repeated, "rank_final_checkpoint": final,
            "rank_attempts": summary.get("attempts", 0), "rank_final_attempt_failed": attempts_failed,
            "rank_finished": len(finished), "rank_carried_over": len(carried), "rank_run_dir": str(run)}


# ------------------------------------------------------------------------------------------ main
SECTIONS = ("fuzz", "retries", "engine_kills", "rank_kills")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run of a few minutes")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--fuzz-requests", type=int, default=None, help="default 10000 (--quick 300)")
    p.add_argument("--retry-calls", type=int, default=None, help="logical calls (default 60; --quick 12)")
    p.add_argument("--engine-kills", type=int, default=None, help="default 100 (--quick 3)")
    p.add_argument("--rank-kills", type=int, default=None, help="default 3 (--quick 1)")
    p.add_argument("--train-steps", type=int, default=None, help="main-job steps (default 6; --quick 3)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    q = a.quick
    wanted = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in wanted if s not in SECTIONS]
    if bad:
        p.error(f"argument --sections: unknown {bad}")
    out: dict = {f: 0 for f in FIELDS}
    out["quick"] = q
    out["sections"] = []
    t0 = time.monotonic()
    for s in SECTIONS:
        if s not in wanted:
            continue
        t = time.monotonic()
        _log(f"section {s}")
        if s == "fuzz":
            res = section_fuzz(a.fuzz_requests or (300 if q else 10000), a.seed, q)
        elif s == "retries":
            res = section_retries(a.retry_calls or (12 if q else 60), a.seed)
        elif s == "engine_kills":
            res = section_engine_kills(a.engine_kills if a.engine_kills is not None else (3 if q else 100), a.seed)
        else:
            res = section_rank_kills(a.rank_kills if a.rank_kills is not None else (1 if q else 3), a.seed,
                                     a.train_steps or (3 if q else 6))
        out.update(res)
        out["sections"].append(s)
        out[f"{s}_s"] = round(time.monotonic() - t, 1)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
