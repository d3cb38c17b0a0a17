#!/usr/bin/env python
"""KV migration on reroute: what a rerouted call recomputes, with and without migration.

    python bench/kv_migration.py [--contexts 4096 16384 32704] [--transport mooncake|http] [--json]

Two embedded engines (the tiny Qwen3 with the real Qwen tokenizer) behind the proxy. For each
context length, one execution streams a greedy Chat call on engine-0 whose prompt is a long
document (the repository's own docs, repeated); after ``--split`` chunks cell 0 switches
rollout -> training (:class:`gyre.training.cell.CellRoles`: reroute to engine-1, abort, release
memory) and the proxy retries the call on engine-1. Each length runs twice on fresh engines,
migration off and on. Reported per length:

* ``context_tokens``: the retried input (prompt + output before the abort) of the migrated run
  (``context_tokens_off``: of the other run; the abort lands a token or two apart);
* ``recomputed_tokens_*``: tokens engine-1 prefilled for the retry (its ``num_prefill_tokens``);
* ``logprob_max_abs_diff``: the call's output log-probs, migration on vs off (same greedy output);
* ``retry_latency_s_*``: from the start of the role switch to the end of the call (the retry's
  prefill or copy, plus decoding the rest, which is the same in both runs);
* ``switch_s_*``: the rollout -> training latency of cell 0 (with migration it waits for the copy);
* ``mb_moved``, ``mb_per_s``: payload bytes copied and the rate of export + transfer + import.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PAPER_RT_S = 8.52  # the paper's rollout -> training switch


def document(tokenizer, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of the repository's docs (repeated as needed)."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode(text)
    ids = (ids * (n_tokens // len(ids) + 1))[:n_tokens]
    return tokenizer.decode(ids)


def one_run(model_dir: str, tokenizer, renderer, prompt: str, *, migration: bool, transport: str,
            split: int, max_new: int, context_limit: int) -> dict:
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer
    from gyre.training.cell import CellRoles
    from gyre.trajectory.store import TrajectoryStore

    engines = [EngineServer(EngineConfig(model_dir=model_dir, max_running_requests=2)).start() for _ in range(2)]
    tmp = tempfile.TemporaryDirectory(prefix="gyre-bench-kv-")
    store = TrajectoryStore(Path(tmp.name) / "records", fsync_every=0)
    srv = ProxyServer(renderer, store=store, config=ProxyConfig(max_context_tokens=context_limit, retry_timeout_s=600,
                                                                kv_migration=migration, kv_transport=transport))
    for i, e in enumerate(engines):
        srv.add_engine(ClientEngine(AsyncEngineClient(e.url, timeout=600), f"engine-{i}"))
    srv.start()
    dest = EngineClient(engines[1].url, timeout=600)
    cell = CellRoles(0, "engine-0", EngineClient(engines[0].url, timeout=600), srv)
    try:
        ex = srv.register_execution(engine_id="engine-0")
        body = {"model": "m", "stream": True, "max_tokens": max_new, "temperature": 0.0, "ignore_eos": True,
                "messages": [{"role": "user", "content": prompt}]}
        prefill_before = dest.get_server_info()["internal_states"][0]["num_prefill_tokens"]
        chunks, t_switch, switch = 0, None, None
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=900,
                          headers={"authorization": f"Bearer {ex.api_key}"}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"proxy answered {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                if chunks == split:  # mid-call: cell 0 leaves rollout
                    t_switch = time.perf_counter()
                    switch = cell.to_train("engine-1")
        t_end = time.perf_counter()
        if switch is None:
            raise RuntimeError(f"the call ended after {chunks} chunks, before the switch at {split}")
        prefilled = dest.get_server_info()["internal_states"][0]["num_prefill_tokens"] - prefill_before
        srv.close_execution(ex.execution_id)
        (rec,) = store.read_records(ex.execution_id)
        first = rec.metadata["attempts"][0]
        stats = dict(srv.router.migration_stats)
        return {"context": len(rec.input_ids) + first["tokens"], "prompt": len(rec.input_ids),
                "recomputed": prefilled, "retry_latency_s": t_end - t_switch, "switch_s": switch.latency_s,
                "output_ids": [int(t) for t in rec.output_ids], "logprobs": [float(x) for x in rec.output_logprobs],
                "attempts": len(rec.metadata["attempts"]), "stats": stats}
    finally:
        srv.stop()
        for e in engines:
            e.stop()
        tmp.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32704],
                   help="Context lengths (prompt + output before the switch) in tokens.")
    p.add_argument("--transport", choices=("mooncake", "http"), default="mooncake")
    p.add_argument("--split", type=int, default=16, help="Stream chunks before the role switch.")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true", help="One JSON line per context length.")
    a = p.parse_args()

    import torch

    from gyre.embedded_model import ensure_tiny_model, load_tokenizer
    from gyre.proxy.render import ChatRenderer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = str(ensure_tiny_model("qwen"))
    tokenizer = load_tokenizer(model_dir)
    renderer = ChatRenderer(tokenizer)
    limit = 32768
    rows = []
    for n in a.contexts:
        prompt = document(tokenizer, n - a.split - 16)  # the chat template and the split's output fill the rest
        runs = {mode: one_run(model_dir, tokenizer, renderer, prompt, migration=mode == "on", transport=a.transport,
                              split=a.split, max_new=a.max_new_tokens, context_limit=limit)
                for mode in ("off", "on")}
        off, on = runs["off"], runs["on"]
        same = off["output_ids"] == on["output_ids"]
        diff = max(abs(x - y) for x, y in zip(off["logprobs"], on["logprobs"]))
        st = on["stats"]
        row = {"context_tokens": on["context"], "context_tokens_off": off["context"], "prompt_tokens": on["prompt"],
               "recomputed_tokens_migrated": on["recomputed"], "recomputed_tokens_off": off["recomputed"],
               "recomputed_fraction_migrated": round(on["recomputed"] / on["context"], 5),
               "logprob_max_abs_diff": diff, "same_output": same,
               "retry_latency_s_migrated": round(on["retry_latency_s"], 3),
               "retry_latency_s_off": round(off["retry_latency_s"], 3),
               "switch_s_migrated": round(on["switch_s"], 3), "switch_s_off": round(off["switch_s"], 3),
               "migrated_tokens": st["tokens"], "mb_moved": round(st["bytes"] / 1e6, 2),
               "mb_per_s": round(st["bytes"] / 1e6 / st["seconds"], 1) if st["seconds"] else None,
               "copy_s": round(st["seconds"], 3), "transport": a.transport, "copies_failed": st["failed"]}
        rows.append(row)
        if a.json:
            print(json.dumps(row), flush=True)
    if a.json:
        return
    print(f"KV migration on reroute ({a.transport}); the paper's rollout -> training switch: {PAPER_RT_S} s")
    print(f"{'context':>8} {'recomputed':>17} {'retry latency s':>17} {'R->T switch s':>15} {'MB':>7} {'MB/s':>7} "
          f"{'logprob diff':>12}")
    print(f"{'':>8} {'on':>8} {'off':>8} {'on':>8} {'off':>8} {'on':>7} {'off':>7}")
    for r in rows:
        print(f"{r['context_tokens']:>8} {r['recomputed_tokens_migrated']:>8} {r['recomputed_tokens_off']:>8} "
              f"{r['retry_latency_s_migrated']:>8.2f} {r['retry_latency_s_off']:>8.2f} "
              f"{r['switch_s_migrated']:>7.2f} {r['switch_s_off']:>7.2f} {r['mb_moved']:>7.1f} "
              f"{r['mb_per_s'] or 0:>7.1f} {r['logprob_max_abs_diff']:>12.2e}")


if __name__ == "__main__":
    main()
