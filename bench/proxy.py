"""Benchmark: latency the Gyre proxy adds over calling the engine directly, vs a plain forwarder,
and the proxy's CPU time per call by stage.

Usage::

    python bench/proxy.py [--concurrency 1,64,256] [--max-context 100000] [--turn-tokens 10000]
                          [--flat-turn-tokens 1000] [--decode-ms 0] [--think-ms 0] [--transport-only-engine]
                          [--durability flush|fsync] [--quick] [--json OUT.json]

Processes (each its own Python process, all on this machine):

* **engine** -- a stand-in SGLang server (:mod:`gyre.testing.stand_in_engine`) that answers instantly (after ``--decode-ms``) with a
  fixed short tool-call reply: ``POST /generate`` (SGLang-native, ``input_ids``, SSE streaming)
  and ``POST /v1/chat/completions``. Its chat endpoint renders and tokenises the *whole* prompt
  with the chat template before answering, as SGLang's OpenAI server does (its tokenizer manager
  applies the template and encodes every request) -- so "calling the engine directly" costs what
  it costs a harness pointed at SGLang, and Gyre's ``/generate`` calls with token ids spare the
  engine that work.  ``--transport-only-engine`` makes the chat endpoint skip it (a diagnostic:
  then Gyre's added latency includes every token it encodes, against an engine that encodes none).
* **forwarder** -- a plain aiohttp pass-through (bytes in, bytes out, no parsing or recording).
* **gyre** -- :class:`gyre.proxy.server.ProxyServer` -> engine ``/generate`` (token ids), with the
  record store (each record written before its response completes; ``--durability fsync`` also
  fsyncs it, group-committed) and trajectory trees.

The load generator runs ``C`` executions concurrently (``C`` in ``--concurrency``); each runs a
mini-swe-agent-like loop of Chat Completions calls: system + task, then per turn the reply
(a tool call) and a tool result of ``--turn-tokens`` new tokens (after ``--think-ms`` of
"tool execution"), until the context reaches ``--max-context`` tokens. The same workload is sent four ways: ``direct-chat`` (to the engine's
chat endpoint), ``direct-generate`` (``/generate`` with token ids: the pure engine round trip),
``forwarder`` and ``gyre``. Reported per concurrency: p50/p99 latency of each, the latency
added by (a) the forwarder and (b) Gyre over ``direct-chat`` -- the harness calling the engine
itself -- and Gyre's added latency over ``direct-generate``.

Gyre's CPU time per call is split into JSON parsing, normalisation (API -> messages),
matching (restoration + message-trie walk), rendering + encoding of new content, and
recording (store append + tree insert), from ``GET /gyre/stats``. A second sweep runs one
execution with ``--flat-turn-tokens`` new tokens per turn from 1k to ``--max-context`` context
tokens in-process (no HTTP, no other load; each call's read-only stages repeated 5 times) and
prints those stage times by context length (target: matching/encoding flat).

Targets: (b) <= 1.5 x (a) at each concurrency; matching + encoding per call
independent of the context length.
"""


import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.testing.stand_in_engine import TOOL_REPLY, serve_aiohttp, serve_engine

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


# ----------------------------------------------------------------------------- servers
def _tokenizer(kind: str):
    from gyre.embedded_model import ensure_tiny_model, load_tokenizer

    return ensure_tiny_model(kind), load_tokenizer(ensure_tiny_model(kind))


def serve_forwarder(port: int, upstream: str) -> None:
    """A plain aiohttp pass-through: forwards the body bytes, returns the response bytes."""
    from aiohttp import ClientSession, TCPConnector, web

    session: ClientSession | None = None

    async def handle(request: web.Request) -> web.Response:
        nonlocal session
        session = session or ClientSession(connector=TCPConnector(limit=1024))
        body = await request.read()
        async with session.post(upstream + request.path, data=body,
                                headers={"content-type": request.headers.get("content-type", "application/json")}) as r:
            data = await r.read()
            return web.Response(body=data, status=r.status, content_type=r.content_type)

    app = web.Application(client_max_size=1 << 28)
    app.router.add_post("/{tail:.*}", handle)
    serve_aiohttp(app, port)


def serve_gyre(port: int, upstream: str, kind: str, store_dir: str, durability: str) -> None:
    """Gyre's proxy routing to the stand-in engine's ``/generate``; records to ``store_dir``."""
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.trajectory.store import TrajectoryStore

    _, tok = _tokenizer(kind)
    srv = ProxyServer(ChatRenderer(tok), store=TrajectoryStore(store_dir, fsync_every=0, max_open=1024),
                      config=ProxyConfig(max_context_tokens=1 << 20, default_max_tokens=256, durability=durability))
    srv.add_engine(ClientEngine(AsyncEngineClient(upstream), "engine-0"))
    srv.start("127.0.0.1", port)
    print(json.dumps({"url": srv.url}), flush=True)
    threading.Event().wait()


def _spawn(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = proc.stdout.readline()
    try:
        return proc, json.loads(line)["url"]
    except (ValueError, KeyError):
        proc.kill()
        raise RuntimeError(f"server {args[:2]} did not start: {line!r}") from None


# ----------------------------------------------------------------------------- load generator
class Words:
    """Deterministic filler text of about ``n`` tokens (calibrated on the tokenizer)."""

    def __init__(self, tok, seed: int = 0) -> None:
        rnd = random.Random(seed)
        vocab = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 9))) for _ in range(5000)]
        self.rnd = rnd
        self.vocab = vocab
        sample = self.text_words(2000)
        self.tokens_per_word = len(tok.encode(sample, add_special_tokens=False)) / 2000

    def text_words(self, n: int) -> str:
        lines, line = [], []
        for i in range(n):
            line.append(self.rnd.choice(self.vocab))
            if len(line) == 12:
                lines.append(" ".join(line))
                line = []
        lines.append(" ".join(line))
        return "\n".join(lines)

    def text(self, tokens: int) -> str:
        return self.text_words(max(1, int(tokens / self.tokens_per_word)))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def run_phase(target: str, url: str, conc: int, args, words: Words, keys: list[str]) -> list[float]:
    """Run ``conc`` executions through ``target``; return per-call latencies (seconds)."""
    import httpx

    system = words.text(800)
    lat: list[float] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def execution(i: int) -> None:
            msgs: list[dict[str, Any]] = [{"role": "system", "content": system},
                                          {"role": "user", "content": f"Task {i}: " + words.text(200)}]
            n_ctx = 1100
            turns = max(1, -(-(args.max_context - n_ctx) // args.turn_tokens))  # same work on every target
            headers = {"content-type": "application/json"}
            if target == "gyre":
                headers["authorization"] = f"Bearer {keys[i]}"
            turn = 0
            while turn < turns:
                if target == "direct-generate":
                    body = json.dumps({"input_ids": [7] * n_ctx, "sampling_params": {"max_new_tokens": 256},
                                       "return_logprob": True}).encode()
                    path = "/generate"
                else:
                    body = json.dumps({"model": "bench", "messages": msgs, "tools": TOOLS}).encode()
                    path = "/v1/chat/completions"
                for attempt in range(5):
                    t0 = time.perf_counter()
                    try:
                        r = await client.post(path, content=body, headers=headers)
                        break
                    except httpx.TransportError:  # a reused keep-alive connection closed under us
                        errors.append(target)
                        if attempt == 4:
                            raise
                lat.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"{target}: HTTP {r.status_code}: {r.text[:300]}")
                res = r.json()
                if target == "direct-generate":
                    n_ctx += len(res["output_ids"]) + args.turn_tokens
                    turn += 1
                    if args.think_ms:
                        await asyncio.sleep(random.expovariate(1000.0 / args.think_ms))
                    continue
                msg = res["choices"][0]["message"]
                msgs.append(msg)
                call_id = msg["tool_calls"][0]["id"]
                msgs.append({"role": "tool", "tool_call_id": call_id, "content": words.text(args.turn_tokens)})
                turn += 1
                if args.think_ms:
                    await asyncio.sleep(random.expovariate(1000.0 / args.think_ms))

        await asyncio.gather(*(execution(i) for i in range(conc)))
    if errors:
        print(f"  ({len(errors)} transport errors retried)", flush=True)
    return lat


def _register(url: str, n: int) -> list[str]:
    import httpx

    with httpx.Client(base_url=url, timeout=60) as c:
        return [c.post("/gyre/executions", json={"task_id": f"bench-{i}", "harness": "generic"}).json()["api_key"]
                for i in range(n)]


def _stats(url: str) -> list[dict[str, float]]:
    import httpx

    return httpx.get(url + "/gyre/stats", timeout=60).json()["stage_times"]


STAGES = ("parse_s", "normalize_s", "match_s", "render_s", "record_s")


def flatness(kind: str, max_context: int, turn_tokens: int, repeats: int = 5) -> list[dict[str, float]]:
    """In-process stage times of one execution growing by ``turn_tokens`` per turn (module
    docstring): per turn the median of ``repeats`` runs of JSON parsing, normalisation, and
    :meth:`TitoSession.prepare` (read-only, so repeatable), then one commit to a record store."""
    import numpy as np

    from gyre.proxy.messages import Message, ToolCall
    from gyre.proxy.api.openai_chat import normalize_chat
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.tito import TitoSession
    from gyre.trajectory.store import TrajectoryStore

    _, tok = _tokenizer(kind)
    r = ChatRenderer(tok)
    words = Words(tok, seed=1)
    store = TrajectoryStore(tempfile.mkdtemp(prefix="gyre-bench-flat-"), fsync_every=0)
    sess = TitoSession("flat", r, append=store.append)
    out = r.encode(TOOL_REPLY) + [r.eos_id]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": words.text(800)}, {"role": "user", "content": "Task"}]
    rows = []
    turn = 0
    while True:
        raw = json.dumps({"model": "bench", "messages": msgs, "tools": TOOLS}).encode()
        t: dict[str, list[float]] = {k: [] for k in STAGES}
        for _ in range(repeats):
            t0 = time.perf_counter()
            body = json.loads(raw)
            t1 = time.perf_counter()
            req = normalize_chat(body)
            t2 = time.perf_counter()
            prep = sess.prepare(req)
            t["parse_s"].append(t1 - t0)
            t["normalize_s"].append(t2 - t1)
            t["match_s"].append(prep.timings["match_s"])
            t["render_s"].append(prep.timings["render_s"])
        call = f"call_{turn}"
        msg = Message("assistant", "", None, (ToolCall(call, "bash", '{"command": "cat src/module.py"}'),))
        t3 = time.perf_counter()
        sess.commit(prep, output_ids=out, output_logprobs=np.full(len(out), -0.1), finish_reason="stop",
                    output_message=msg, role="main")
        t["record_s"].append(time.perf_counter() - t3)
        row = {k: statistics.median(v) for k, v in t.items()}
        row["input_tokens"] = int(prep.input_ids.shape[0])
        row["reused_tokens"] = prep.reused_tokens
        row["rendered_tokens"] = prep.rendered_tokens
        rows.append(row)
        if row["input_tokens"] >= max_context:
            break
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call, "type": "function", "function": {"name": "bash", "arguments": '{"command": "cat src/module.py"}'}}]})
        msgs.append({"role": "tool", "tool_call_id": call, "content": words.text(turn_tokens)})
        turn += 1
    store.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", choices=("engine", "forwarder", "gyre"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sites", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--store-dir", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--max-context", type=int, default=100_000, help="context tokens an execution grows to")
    ap.add_argument("--turn-tokens", type=int, default=2_000, help="new tokens per turn in the latency runs")
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="mean harness time between a reply and the next request (tool execution), ms")
    ap.add_argument("--transport-only-engine", action="store_true",
                    help="diagnostic: the engine's chat endpoint skips rendering/tokenising the prompt (default: it "
                         "renders and tokenises the whole prompt, like SGLang's OpenAI server)")
    ap.add_argument("--flat-turn-tokens", type=int, default=1_000, help="new tokens per turn in the flatness sweep")
    ap.add_argument("--decode-ms", type=float, default=0.0, help="engine 'generation' time per call (ms)")
    ap.add_argument("--tokenizer", choices=("local", "qwen"), default="local")
    ap.add_argument("--durability", choices=("flush", "fsync"), default="flush",
                    help="Gyre's record durability before a response (ProxyConfig.durability)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: concurrency 1,8, contexts to 20k tokens (the full run takes 20-40 min on 2 cores)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.serve == "engine":
        serve_engine(args.port, args.tokenizer, args.decode_ms, not args.transport_only_engine, args.sites)
        return 0
    if args.serve == "forwarder":
        serve_forwarder(args.port, args.upstream)
        return 0
    if args.serve == "gyre":
        serve_gyre(args.port, args.upstream, args.tokenizer, args.store_dir, args.durability)
        return 0

    if args.quick:
        args.concurrency, args.max_context, args.turn_tokens, args.flat_turn_tokens = "1,8", 20_000, 4_000, 1_000
    _, tok = _tokenizer(args.tokenizer)
    words = Words(tok)
    procs = []
    results: dict[str, Any] = {"config": vars(args), "latency": {}, "cpu": {}, "flat": []}
    store = tempfile.mkdtemp(prefix="gyre-bench-proxy-")
    try:
        eng, eng_url = _spawn("--serve", "engine", "--tokenizer", args.tokenizer, "--decode-ms", str(args.decode_ms),
                              *(["--transport-only-engine"] if args.transport_only_engine else []))
        procs.append(eng)
        fwd, fwd_url = _spawn("--serve", "forwarder", "--upstream", eng_url)
        procs.append(fwd)
        gy, gy_url = _spawn("--serve", "gyre", "--upstream", eng_url, "--tokenizer", args.tokenizer, "--store-dir", store,
                            "--durability", args.durability)
        procs.append(gy)
        targets = {"direct-chat": eng_url, "direct-generate": eng_url, "forwarder": fwd_url, "gyre": gy_url}
        print(f"{'C':>4} {'target':<16} {'calls':>6} {'p50 ms':>9} {'p99 ms':>9}")
        for conc in [int(x) for x in args.concurrency.split(",")]:
            row: dict[str, Any] = {}
            for target, url in targets.items():
                keys = _register(gy_url, conc) if target == "gyre" else []
                before = len(_stats(gy_url)) if target == "gyre" else 0
                t0 = time.perf_counter()
                lat = asyncio.run(run_phase(target, url, conc, args, words, keys))
                wall = time.perf_counter() - t0
                row[target] = {"calls": len(lat), "p50_ms": 1e3 * _pct(lat, 0.5), "p99_ms": 1e3 * _pct(lat, 0.99),
                               "wall_s": wall}
                print(f"{conc:>4} {target:<16} {len(lat):>6} {row[target]['p50_ms']:>9.2f} {row[target]['p99_ms']:>9.2f}",
                      flush=True)
                if target == "gyre":
                    st = _stats(gy_url)[before:]
                    results["cpu"][conc] = {s: 1e3 * statistics.mean(x[s] for x in st) for s in STAGES}
            for q in ("p50_ms", "p99_ms"):
                a = row["forwarder"][q] - row["direct-chat"][q]
                b = row["gyre"][q] - row["direct-chat"][q]
                row[f"added_forwarder_{q}"] = a
                row[f"added_gyre_{q}"] = b
                row[f"added_gyre_vs_generate_{q}"] = row["gyre"][q] - row["direct-generate"][q]
            results["latency"][conc] = row
    finally:
        for p in procs:
            p.kill()
            p.wait()
    results["flat"] = flatness(args.tokenizer, args.max_context, args.flat_turn_tokens)
    # ------------------------------------------------------------------ report
    print("\nAdded latency over calling the engine directly (ms); (a) forwarder, (b) Gyre; target (b) <= 1.5 x (a), "
          "where a negative (a) (the forwarder's run beat the direct one: noise) counts as 0")
    print(f"{'C':>4} | {'(a) p50':>8} {'(a) p99':>8} | {'(b) p50':>8} {'(b) p99':>8} | {'b/a p50':>7} {'b/a p99':>7}"
          f" | {'met':>3} | {'Gyre vs /generate p50':>21} {'p99':>7}")
    for conc, row in results["latency"].items():
        a50, a99 = row["added_forwarder_p50_ms"], row["added_forwarder_p99_ms"]
        b50, b99 = row["added_gyre_p50_ms"], row["added_gyre_p99_ms"]
        r50 = b50 / a50 if a50 > 0 else float("nan")
        r99 = b99 / a99 if a99 > 0 else float("nan")
        row["target_met"] = bool(b50 <= 1.5 * max(a50, 0.0) and b99 <= 1.5 * max(a99, 0.0))
        print(f"{conc:>4} | {a50:>8.2f} {a99:>8.2f} | {b50:>8.2f} {b99:>8.2f} | {r50:>7.2f} {r99:>7.2f} | "
              f"{'yes' if row['target_met'] else 'no':>3} | "
              f"{row['added_gyre_vs_generate_p50_ms']:>21.2f} {row['added_gyre_vs_generate_p99_ms']:>7.2f}")
    print("\nGyre CPU per call (ms, mean): " + " ".join(f"{s[:-2]:>10}" for s in STAGES))
    for conc, c in results["cpu"].items():
        print(f"  C={conc:<4} {'':>19}" + " ".join(f"{c[s]:>10.3f}" for s in STAGES))
    print(f"\nFlatness (in-process, one execution, {args.flat_turn_tokens} new tokens per turn; median of 5 per call, "
          f"mean per bucket, ms)")
    print(f"{'context tokens':>16} {'calls':>5} " + " ".join(f"{s[:-2]:>10}" for s in STAGES) + f" {'match+render':>12}")
    buckets = [(0, 2_000), (2_000, 5_000), (5_000, 15_000), (15_000, 35_000), (35_000, 65_000), (65_000, 1 << 30)]
    for lo, hi in buckets:
        xs = [x for x in results["flat"] if lo <= x["input_tokens"] < hi]
        if not xs:
            continue
        m = {s: 1e3 * statistics.mean(x[s] for x in xs) for s in STAGES}
        label = f"{lo // 1000}k-{hi // 1000}k" if hi < (1 << 30) else f">={lo // 1000}k"
        print(f"{label:>16} {len(xs):>5} " + " ".join(f"{m[s]:>10.3f}" for s in STAGES)
              + f" {m['match_s'] + m['render_s']:>12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
