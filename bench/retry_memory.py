"""Benchmark: the bytes the proxy keeps per call for client retries, with long answers.

Usage::

    python bench/retry_memory.py [--answer-tokens 2000] [--executions 8] [--json [OUT.json]]

One :class:`gyre.proxy.server.ProxyServer` on the Qwen tokenizer and an in-process scripted engine
whose every answer is ``--answer-tokens`` tokens of English-like text, one token per streamed
chunk (the most SSE events an answer of that length can make). ``--executions`` executions per
API and mode (Anthropic Messages, OpenAI Chat, OpenAI Responses; streamed and not) each make
four calls, the calls an execution keeps for retries; the result is the proxy's own count
(``GET /gyre/stats`` ``retry_memory``) per kept call, and what 1,152 executions x 4 calls of
such answers would hold.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
WORDS = ("the agent reads a file then edits the function so that tests pass and it runs the build "
         "again with more output for each step of the plan while checking errors in code").split()


def _request(api: str, stream: bool, text: str) -> dict:
    if api == "responses":
        return {"model": "m", "max_output_tokens": 4096, "input": text, "stream": stream}
    return {"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": text}], "stream": stream}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answer-tokens", type=int, default=2000)
    ap.add_argument("--executions", type=int, default=8, help="per API and mode")
    ap.add_argument("--json", nargs="?", const="-", default=None)
    args = ap.parse_args()

    from gyre.embedded_model import ensure_tiny_model, load_tokenizer
    from gyre.proxy.engines import ScriptedEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer

    r = ChatRenderer(load_tokenizer(ensure_tiny_model("qwen")))
    rng = random.Random(0)
    answer = r.encode(" ".join(rng.choice(WORDS) for _ in range(4 * args.answer_tokens)))[: args.answer_tokens]
    srv = ProxyServer(r, config=ProxyConfig(max_context_tokens=1 << 16, max_tokens_cap=1 << 15,
                                            retry_memory_bytes=1 << 40))
    srv.add_engine(ScriptedEngine("e0", answer + [r.eos_id], chunk=1))
    srv.start()
    out: dict = {"answer_tokens": args.answer_tokens, "executions": args.executions, "by_mode": {}}
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            for api in PATHS:
                for stream in (True, False):
                    before = c.get("/gyre/stats").json()["retry_memory"]
                    for _ in range(args.executions):
                        key = srv.register_execution().api_key
                        for k in range(4):
                            resp = c.post(PATHS[api], json=_request(api, stream, f"task step {k}"),
                                          headers={"x-api-key": key, "authorization": f"Bearer {key}"})
                            assert resp.status_code == 200, resp.text
                    after = c.get("/gyre/stats").json()["retry_memory"]
                    n = after["calls"] - before["calls"]
                    per_call = (after["bytes"] - before["bytes"]) / n
                    mode = f"{api}/{'stream' if stream else 'body'}"
                    out["by_mode"][mode] = {"calls": n, "bytes_per_call": round(per_call),
                                            "bytes_per_answer_token": round(per_call / args.answer_tokens, 2)}
                    print(f"{mode:<20} {n} calls kept  {per_call / 1024:8.1f} KiB per call  "
                          f"{per_call / args.answer_tokens:6.2f} B per answer token", flush=True)
    finally:
        srv.stop()
    worst = max(v["bytes_per_call"] for v in out["by_mode"].values())
    out["paper_bytes_worst_mode"] = worst * 1152 * 4
    print(f"1,152 executions x 4 calls, every answer in the costliest mode: {out['paper_bytes_worst_mode'] / 2**20:.0f} MiB",
          flush=True)
    if args.json is not None:
        text = json.dumps(out, indent=1)
        print(text) if args.json == "-" else Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
