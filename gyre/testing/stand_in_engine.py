"""A stand-in SGLang engine for benches and tests: it answers at once (after ``decode_ms``) with
one fixed short tool-call reply, on ``POST /generate`` (SGLang-native, ``input_ids``, SSE
streaming as one body) and ``POST /v1/chat/completions`` (which renders and tokenises the whole
prompt with the chat template first, as SGLang's OpenAI server does, unless ``tokenizes`` is
off: a transport-only stand-in). It is kept cheap because it shares the machine's cores with the
proxy it answers: :func:`count_input_ids` counts a ``/generate`` prompt's ids without parsing them.

Usage: ``python -m gyre.testing.stand_in_engine [--port 0] [--sites N] [--tokenizer local|qwen]
[--decode-ms MS] [--transport-only-engine]``; it prints ``{"url": ..., "urls": [...]}`` as one
JSON line once it serves, and runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from typing import Any

import orjson

from gyre.embedded_model import ensure_tiny_model, load_tokenizer

__all__ = ["TOOL_REPLY", "count_input_ids", "serve_aiohttp", "serve_engine"]

#: The reply of every call.
TOOL_REPLY = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat src/module.py"}}\n</tool_call>'

_IDS_KEY = b'{"input_ids":'


def count_input_ids(raw: bytes) -> tuple[int, dict[str, Any]]:
    """``(number of prompt ids, the body's other fields)`` of a ``/generate`` body.  A body that
    starts with its ``input_ids`` list (as Gyre writes it) has the list's commas counted, not its
    numbers parsed: the stand-in engine shares the proxy's cores, and parsing a long prompt would
    cost it more than the proxy's own work; other bodies are parsed whole."""
    if not raw.startswith(_IDS_KEY):
        body = orjson.loads(raw)
        return len(body.get("input_ids") or ()), body
    end = raw.index(b"]", len(_IDS_KEY))
    open_ = raw.index(b"[", len(_IDS_KEY), end)
    empty = not raw[open_ + 1:end].strip()
    n = 0 if empty else raw.count(b",", open_, end) + 1
    rest = raw[end + 1:].lstrip()
    return n, orjson.loads(b"{" + rest[1:]) if rest.startswith(b",") else {}


def serve_engine(port: int, kind: str, decode_ms: float, tokenizes: bool, sites: int = 1) -> None:
    """The stand-in SGLang engine on ``port`` (module docstring), on aiohttp with orjson: it shares
    this machine's cores with the proxy it answers, so it is kept cheap. ``sites`` > 1 serves as
    many engines, each on its own port, from this one process (one event loop wakes for all)."""
    from aiohttp import web

    tok = load_tokenizer(ensure_tiny_model(kind))
    out_ids = tok.encode(TOOL_REPLY, add_special_tokens=False) + [tok.eos_token_id]
    lps = [[-0.1, i, None] for i in out_ids]

    def meta(rid, n_in):
        return {"id": rid, "finish_reason": {"type": "stop", "matched": tok.eos_token_id}, "prompt_tokens": n_in,
                "completion_tokens": len(out_ids), "cached_tokens": 0, "weight_version": "0",
                "output_token_logprobs": lps}

    def json_response(obj) -> web.Response:
        return web.Response(body=orjson.dumps(obj), content_type="application/json")

    async def info(_request):
        return json_response({"incremental_streaming_output": False})

    async def abort(_request):
        return json_response({})

    async def generate(request):
        n_in, body = count_input_ids(await request.read())
        if decode_ms:
            await asyncio.sleep(decode_ms / 1000)
        res = orjson.dumps({"text": TOOL_REPLY, "output_ids": out_ids, "meta_info": meta(body.get("rid") or "r", n_in)})
        if body.get("stream"):  # the whole SSE stream in one body: no per-event work in the stand-in
            return web.Response(body=b"data: " + res + b"\n\ndata: [DONE]\n\n", content_type="text/event-stream")
        return web.Response(body=res, content_type="application/json")

    async def chat(request):
        body = orjson.loads(await request.read())
        if tokenizes:  # what SGLang's OpenAI server does before generating
            n_in = len(tok.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
        else:  # a transport-only stand-in: estimate the prompt length from its size
            n_in = sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4
        if decode_ms:
            await asyncio.sleep(decode_ms / 1000)
        return json_response({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "", "tool_calls": [{"id": f"call_{random.getrandbits(48):x}",
                "type": "function", "function": {"name": "bash", "arguments": '{"command": "cat src/module.py"}'}}]}}],
            "usage": {"prompt_tokens": n_in, "completion_tokens": len(out_ids), "total_tokens": n_in + len(out_ids)}})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/get_server_info", info)
    app.router.add_post("/abort_request", abort)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/chat/completions", chat)
    serve_aiohttp(app, port, sites)


def serve_aiohttp(app, port: int, sites: int = 1) -> None:
    """Serve ``app`` on 127.0.0.1 (uvloop where installed) on ``sites`` ports (``port`` the first,
    0: any free ones), print their URLs as one JSON line (``url``: the first, ``urls``: all), run
    until killed."""
    from aiohttp import web

    async def main():
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=3600)
        await runner.setup()
        urls = []
        for i in range(sites):
            site = web.TCPSite(runner, "127.0.0.1", port + i if port else 0, backlog=4096)
            await site.start()
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        print(json.dumps({"url": urls[0], "urls": urls}), flush=True)
        await asyncio.Event().wait()

    try:
        from uvloop import new_event_loop
    except ImportError:
        new_event_loop = None
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gyre.testing.stand_in_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0, help="the first port (0: free ones)")
    ap.add_argument("--sites", type=int, default=1, help="engines served by this process, each on its own port")
    ap.add_argument("--tokenizer", choices=("local", "qwen"), default="local")
    ap.add_argument("--decode-ms", type=float, default=0.0, help="'generation' time per call (ms)")
    ap.add_argument("--transport-only-engine", action="store_true",
                    help="the chat endpoint estimates the prompt length instead of tokenising it")
    a = ap.parse_args(argv)
    serve_engine(a.port, a.tokenizer, a.decode_ms, not a.transport_only_engine, a.sites)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
