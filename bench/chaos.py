#!/usr/bin/env python
"""The main job's promises under injected faults; prints ONE JSON line.

Usage::

    python bench/chaos.py [--quick] [--sections fuzz,retries,huge_bodies,hostile,engine_kills,rank_kills]
        [--fuzz-requests N] [--retry-calls N] [--huge-bodies N] [--hostile-requests N] [--hostile-cap BYTES]
        [--engine-kills N] [--rank-kills K] [--seed S]

The process-level sections live in ``bench/chaos_processes.py``, the ``hostile`` section in
``bench/chaos_hostile.py``, what all share in ``bench/chaos_common.py``.

Sections (each self-contained; ``sections`` in the JSON line lists those that ran, a field of a
section that did not run is 0):

* ``fuzz`` -- seeded random malformed bodies (wrong types, missing fields, huge and deeply nested
  values, invalid UTF-8, broken or mislabelled gzip, out-of-range sampling parameters) against
  the three model APIs of a real :class:`~gyre.proxy.server.ProxyServer` in front of an embedded
  engine (:class:`~gyre.rollout.embedded.server.EngineServer`), both on 127.0.0.1. Counts answers
  by status (``fuzz_status``), ``responses_5xx``, ``requests_over_30s`` (client timeout 35 s),
  transport errors, and checks the proxy still answers a valid call afterwards.
* ``retries`` -- a harness-like client that gives up after a short read timeout and sends the
  same bytes again, as an SDK does (numbered by ``x-stainless-retry-count``), up to 3 times, then
  once more with a long timeout; an attempt answered in time ends the logical call. One
  execution per logical call, so the records of a logical call are its execution's records.
  ``retry_records_extra`` counts records beyond one per logical call; ``retry_delivered_extra``
  counts delivered ones beyond one; ``retry_answered_undelivered`` the logical calls answered
  (200) with no delivered record; ``retry_client_timeouts`` the attempts that hit the read
  timeout.
* ``huge_bodies`` -- a 33 MB Chat body (a tool name of millions of tokens; the proxy's context is
  131,072 tokens) alone, then ``--huge-bodies`` of them at once, each from its own execution
  (its sender process started and the body read before any sends),
  while two threads of other executions make 10 small calls each: ``huge_alone_s`` and
  ``huge_refused_s_max`` (time to the answer), ``huge_not_400``, ``huge_small_p50_s`` /
  ``huge_small_p99_s`` and ``huge_small_failed``.
* ``hostile`` -- seeded hostile requests of seven classes (compression bombs, body sizes around the
  cap, deep nesting, unrepresentable numbers, lone surrogates, many small parts, client retries at
  every phase; ``--hostile-requests`` of each) against a proxy with a ``--hostile-cap`` body cap,
  with another execution's small calls beside them: per class and overall ``hostile_5xx``,
  ``hostile_hangs``, ``hostile_delivery_errors``, ``hostile_wrong_status``, the largest RSS growth
  (bytes and x the cap), the other calls' p99 / max latency and failures, and ``hostile_targets``
  (``bench/chaos_hostile.py``).
* ``engine_kills`` -- two engines as processes (``python -m gyre.rollout.embedded.serve``) behind
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
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.testing.json_paths import json_deleted, json_paths, json_replaced  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from chaos_common import CLIENT_TIMEOUT_S, ENV, MAX_KEY, PATHS, _headers, _in_process_proxy, _log, _valid  # noqa: E402
from chaos_hostile import section_hostile  # noqa: E402
from chaos_processes import section_engine_kills, section_rank_kills  # noqa: E402

FIELDS = ["engine_kills", "harness_errors", "records_lost", "records_duplicated", "rank_kills", "finished_lost",
          "trained_twice", "steps_repeated", "fuzz_requests", "responses_5xx", "requests_over_30s", "retry_calls",
          "retry_records_extra"]


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
    extra = delivered_extra = failed = answered_undelivered = 0
    for eid, sent, final in calls:
        try:
            recs = store.read_records(eid)
        except FileNotFoundError:
            recs = []
        extra += max(0, len(recs) - 1)
        delivered_extra += max(0, sum(bool(x.delivered) for x in recs) - 1)
        answered_undelivered += final == 200 and not any(x.delivered for x in recs)
        failed += final != 200
    return {"retry_calls": len(calls), "retry_requests_sent": sum(s for _, s, _ in calls),
            "retry_client_timeouts": gave_up,
            "retry_records_extra": extra, "retry_delivered_extra": delivered_extra, "retry_final_not_200": failed,
            "retry_answered_undelivered": answered_undelivered}


# --------------------------------------------------------------------------------- huge bodies
def section_huge_bodies(n: int, small_per_thread: int = 10) -> dict:
    """One 33 MB Chat body alone, then ``n`` at once (an execution each) with two threads of small
    calls of other executions beside them; the proxy's context is 131,072 tokens."""
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="chaos-huge-"))
    engine, srv, _ = _in_process_proxy(tmp, cap=8, max_context=131072)
    name = "tool_" * (33_000_000 // 5)  # a tool name of millions of tokens
    raw = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
                      }).encode()
    small = json.dumps(_valid("chat", "hi", max_tokens=4)).encode()
    statuses: list[int] = []
    refused_s: list[float] = []
    small_s: list[float] = []
    small_bad = 0

    body_file = tmp / "huge.json"
    body_file.write_bytes(raw)
    sender = ("import sys, time, httpx\n"
              "raw = open(sys.argv[1], 'rb').read()\n"
              "print('ready', flush=True)\n"
              "sys.stdin.readline()\n"  # go
              "t0 = time.perf_counter()\n"
              "try:\n"
              "    st = httpx.post(sys.argv[2], content=raw, timeout=%r,\n"
              "                    headers={'authorization': 'Bearer ' + sys.argv[3]}).status_code\n"
              "except httpx.HTTPError:\n"
              "    st = -1\n"
              "print(st, time.perf_counter() - t0)\n" % CLIENT_TIMEOUT_S)

    def big_senders(k: int) -> list[subprocess.Popen]:
        """``k`` client processes (the load generator stays off the proxy's process), started and
        their body read before any sends: what is measured is the proxy with ``k`` bodies
        arriving, not ``k`` interpreters starting on the same cores."""
        procs = [subprocess.Popen([sys.executable, "-c", sender, str(body_file), srv.url + PATHS["chat"],
                                   srv.register_execution().api_key], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=ENV) for _ in range(k)]
        for pr in procs:
            assert pr.stdout.readline().strip() == "ready"
        for pr in procs:
            pr.stdin.write("go\n")
            pr.stdin.flush()
        return procs

    def collect(procs: list[subprocess.Popen]) -> None:
        for pr in procs:
            out, _ = pr.communicate(timeout=300)
            st, took = out.split() if out.strip() else ("-1", "0")
            statuses.append(int(st))
            refused_s.append(float(took))

    def smalls() -> None:
        nonlocal small_bad
        ex = srv.register_execution()
        with httpx.Client(base_url=srv.url, timeout=CLIENT_TIMEOUT_S) as c:
            for _ in range(small_per_thread):
                t0 = time.perf_counter()
                try:
                    ok = c.post(PATHS["chat"], content=small, headers=_headers("chat", ex.api_key)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                small_s.append(time.perf_counter() - t0)
                small_bad += not ok

    try:
        collect(big_senders(1))
        alone_status, alone_s = statuses.pop(), refused_s.pop()
        procs = big_senders(n)
        time.sleep(0.5)  # the bodies are on their way
        threads = [threading.Thread(target=smalls) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        collect(procs)
    finally:
        srv.stop()
        engine.stop()
    return {"huge_body_bytes": len(raw), "huge_alone_status": alone_status, "huge_alone_s": round(alone_s, 3),
            "huge_bodies": n, "huge_not_400": sum(s != 400 for s in statuses),
            "huge_refused_s_max": round(max(refused_s, default=0.0), 3), "huge_small_calls": len(small_s),
            "huge_small_failed": small_bad,
            "huge_small_p50_s": round(float(np.percentile(small_s, 50)), 3) if small_s else 0.0,
            "huge_small_p99_s": round(float(np.percentile(small_s, 99)), 3) if small_s else 0.0}


# ------------------------------------------------------------------------------------------ main
SECTIONS = ("fuzz", "retries", "huge_bodies", "hostile", "engine_kills", "rank_kills")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run of a few minutes")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--fuzz-requests", type=int, default=None, help="default 10000 (--quick 300)")
    p.add_argument("--retry-calls", type=int, default=None, help="logical calls (default 60; --quick 12)")
    p.add_argument("--huge-bodies", type=int, default=None, help="33 MB bodies in flight at once (default 8; --quick 2)")
    p.add_argument("--hostile-requests", type=int, default=None, help="cases of each hostile class (default 40; --quick 6)")
    p.add_argument("--hostile-cap", type=int, default=256 << 10, help="the proxy's body cap in the hostile section (bytes)")
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
        elif s == "huge_bodies":
            res = section_huge_bodies(a.huge_bodies or (2 if q else 8))
        elif s == "hostile":
            res = section_hostile(a.hostile_requests or (6 if q else 40), a.seed, a.hostile_cap)
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
