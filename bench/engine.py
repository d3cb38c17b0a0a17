#!/usr/bin/env python
"""Embedded engine vs. a naive one-request-at-a-time HF ``generate`` loop, same model, one run.

    python bench/engine.py [--model-dir DIR] [--concurrency 1,8,64] [--max-new-tokens 64]
                           [--prompt-tokens 16:64] [--threads 1] [--json]

For each concurrency ``c`` the same ``max(c, 4)`` requests (random prompts, sampled at
temperature 1 with EOS ignored, so every request yields exactly ``--max-new-tokens`` tokens) go

* to the embedded engine over HTTP on 127.0.0.1 with ``c`` requests in flight (closed loop,
  :class:`gyre.rollout.client.async_client.AsyncEngineClient`), continuous batching on;
* through ``model.generate`` one request at a time, in waves of ``c`` requests that arrive
  together (a request's latency includes waiting for the ones before it in its wave).

Prints output tokens/s, mean / p50 / p95 request latency (seconds) for both and the throughput
ratio engine / naive; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(latencies: list[float], tokens: int, wall: float) -> dict[str, float]:
    return {"tokens_per_s": tokens / wall, "latency_mean_s": statistics.fmean(latencies),
            "latency_p50_s": _pct(latencies, 0.5), "latency_p95_s": _pct(latencies, 0.95), "wall_s": wall,
            "requests": len(latencies), "tokens": tokens}


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def bench_naive(model, prompts: list[list[int]], c: int, new_tokens: int) -> dict[str, float]:
    import torch

    latencies, tokens = [], 0
    t_all = time.perf_counter()
    for w in range(0, len(prompts), c):
        t0 = time.perf_counter()
        for ids in prompts[w:w + c]:
            with torch.no_grad():
                out = model.generate(torch.tensor(ids)[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
            tokens += out.shape[1] - len(ids)
            latencies.append(time.perf_counter() - t0)
    return _summary(latencies, tokens, time.perf_counter() - t_all)


def bench_engine(url: str, prompts: list[list[int]], c: int, new_tokens: int) -> dict[str, float]:
    from gyre.rollout.client.async_client import AsyncEngineClient

    async def main():
        sem = asyncio.Semaphore(c)
        latencies: list[float] = []
        tokens = 0

        async with AsyncEngineClient(url, timeout=None) as client:
            async def one(ids):
                nonlocal tokens
                async with sem:
                    t0 = time.perf_counter()
                    r = await client.generate(ids, {"max_new_tokens": new_tokens, "temperature": 1.0,
                                                    "ignore_eos": True}, return_logprob=True)
                    latencies.append(time.perf_counter() - t0)
                    tokens += len(r.output_ids)

            t = time.perf_counter()
            await asyncio.gather(*[one(ids) for ids in prompts])
            return _summary(latencies, tokens, time.perf_counter() - t)

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", default="16:64", help="LO:HI prompt length range (tokens).")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for both systems (default 1: stable on a shared machine; 0 = torch's choice).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",") if x]
    lo, hi = (int(x) for x in a.prompt_tokens.split(":"))

    import logging

    import torch

    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer

    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = a.model_dir or str(ensure_tiny_model("local"))
    model = load_hf_model(model_dir)
    server = EngineServer(EngineConfig(model_dir=model_dir, max_running_requests=max(levels))).start()
    results: dict[str, dict] = {}
    try:
        warm = make_prompts(2, lo, hi, seed=a.seed + 999)
        bench_naive(model, warm, 1, 4)
        bench_engine(server.url, warm, 2, 4)
        for c in levels:
            prompts = make_prompts(max(c, 4), lo, hi, seed=a.seed + c)
            naive = bench_naive(model, prompts, c, a.max_new_tokens)
            engine = bench_engine(server.url, prompts, c, a.max_new_tokens)
            results[str(c)] = {"naive": naive, "engine": engine,
                               "throughput_ratio": engine["tokens_per_s"] / naive["tokens_per_s"]}
    finally:
        server.stop()

    meta = {"model_dir": model_dir, "threads": torch.get_num_threads(), "max_new_tokens": a.max_new_tokens,
            "prompt_tokens": [lo, hi]}
    if a.json:
        print(json.dumps({"config": meta, "results": results}, indent=2))
        return 0
    print(f"embedded engine vs naive HF generate loop  (threads={meta['threads']}, "
          f"{a.max_new_tokens} new tokens/request, prompts {lo}-{hi} tokens)")
    print(f"{'conc':>4} {'reqs':>4} {'system':<7} {'tok/s':>9} {'lat mean':>9} {'lat p50':>8} {'lat p95':>8}")
    for c, r in results.items():
        for name in ("naive", "engine"):
            s = r[name]
            print(f"{c:>4} {s['requests']:>4} {name:<7} {s['tokens_per_s']:>9.1f} {s['latency_mean_s']:>8.2f}s "
                  f"{s['latency_p50_s']:>7.2f}s {s['latency_p95_s']:>7.2f}s")
        print(f"{c:>4} {'':>4} {'ratio':<7} {r['throughput_ratio']:>8.2f}x  (engine tok/s / naive tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
