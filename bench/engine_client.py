"""Benchmark: the CPU one streamed generation costs the proxy's engine client, per prompt length.

Starts the stand-in engine of ``bench/proxy.py`` (transport only: it answers at once) in its own
process and streams ``--calls`` generations one after another from this process, first through
Gyre's :class:`~gyre.rollout.client.async_client.AsyncEngineClient` (aiohttp), then through a plain
``httpx.AsyncClient`` sending the same body and reading the same SSE lines (the transport the
client used before).  The figure is this process's CPU time (user + system) per call: what rank 0
pays to hand one call to an engine, writing the prompt's JSON included (the same code for both).

Usage: ``python bench/engine_client.py [--tokens 10000,700000] [--calls 200] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gyre.rollout.client.async_client import AsyncEngineClient  # noqa: E402
from gyre.rollout.client.messages import build_generate_body, json_content  # noqa: E402
from scale import _spawn  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _gyre(url: str, ids: np.ndarray, calls: int) -> int:
    chunks = 0
    async with AsyncEngineClient(url) as client:
        for i in range(calls):
            async for _ in client.stream(ids, {"max_new_tokens": 16}, rid=f"g{i}"):
                chunks += 1
    return chunks


async def _httpx(url: str, ids: np.ndarray, calls: int) -> int:
    import httpx

    chunks = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for i in range(calls):
            post = json_content(build_generate_body(ids, {"max_new_tokens": 16}, rid=f"h{i}", return_logprob=True,
                                                    stream=True))
            async with client.stream("POST", "/generate", **post) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    chunks += line.startswith("data:") and line != "data: [DONE]"
    return chunks


def measure(run, calls: int) -> dict[str, float]:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run(max(2, calls // 10)))  # connections opened, tables built
        c0, t0 = _cpu_s(), time.perf_counter()
        chunks = runner.run(run(calls))
        cpu, wall = _cpu_s() - c0, time.perf_counter() - t0
    return {"cpu_ms_per_call": 1e3 * cpu / calls, "wall_ms_per_call": 1e3 * wall / calls, "chunks": chunks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="10000,700000", help="prompt lengths (input ids)")
    ap.add_argument("--calls", type=int, default=200, help="calls per prompt length and client")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line")
    args = ap.parse_args(argv)
    try:
        tokens = [int(x) for x in args.tokens.split(",") if x]
    except ValueError:
        ap.error(f"--tokens: not a comma-separated list of integers: {args.tokens!r}")
    if not tokens or min(tokens) < 1 or args.calls < 1:
        ap.error("--tokens and --calls must be positive")
    engine, url = _spawn([str(ROOT / "bench" / "proxy.py"), "--serve", "engine", "--transport-only-engine",
                          "--tokenizer", "qwen"])
    rows = []
    try:
        rng = np.random.default_rng(0)
        for n in tokens:
            ids = rng.integers(0, 150_000, n).astype(np.int32)
            body = json_content(build_generate_body(ids, {"max_new_tokens": 16}, rid="h", stream=True))["content"]
            row = {"tokens": n, "body_bytes": len(body),
                   "gyre": measure(lambda k: _gyre(url, ids, k), args.calls),
                   "httpx": measure(lambda k: _httpx(url, ids, k), args.calls)}
            rows.append(row)
            if not args.json:
                print(f"{n:>9,} ids ({row['body_bytes'] / 1e6:5.2f} MB):  AsyncEngineClient "
                      f"{row['gyre']['cpu_ms_per_call']:6.2f} ms CPU/call  "
                      f"httpx.AsyncClient {row['httpx']['cpu_ms_per_call']:6.2f} ms CPU/call",
                      flush=True)
    finally:
        engine.kill()
        engine.wait()
    if args.json:
        print(json.dumps({"calls": args.calls, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
