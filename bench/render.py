"""Benchmark: the proxy's per-call preparation time (restore, match, render, encode) for requests
with many new messages, and the longest time one preparation holds the event loop.

Usage::

    python bench/render.py [--tool-results 10,100,500,1000,2000] [--messages 1000,10000,50000]
                           [--result-chars 200] [--max-seconds 60]

In-process, no HTTP: one :class:`gyre.proxy.tito.TitoSession` per case on the embedded tiny Qwen
model's ``local`` tokenizer (Gyre's Qwen-format chat template), ``prepare_async`` awaited on an
asyncio loop with a two-thread pool, as the server runs it. Two workloads:

* **tool results** -- call 1 is system + task and is committed with an output of ``N`` tool calls;
  call 2 echoes that output followed by ``N`` tool results of ``--result-chars`` characters (one
  turn: all ``N`` results after one assistant message). Reported: call 2's preparation time.
* **messages** -- a conversation of ``N`` short messages (user and assistant alternating, none of
  them an output of the proxy). ``first``: its first call (everything is new); ``extend``: after
  the first call is committed, the next call (the same ``N`` messages, the output and one new user
  message).

For each call, ``hold_s`` is the longest gap a heartbeat task (``asyncio.sleep(0.0005)`` in a
loop) saw while the call was being prepared, less the sleep: the longest stretch the event loop
could not run anything else. ``gc_s`` is the longest pause of Python's garbage collector in that
time: a collection stops every thread, the loop included, whichever thread triggered it (the
server's :class:`gyre.proxy.gc_policy.CollectorPolicy` shortens later ones; this bench does not
install it). A series stops when one call took more than ``--max-seconds`` (later sizes are
reported as ``null``).

``template_calls`` counts the chat template's renders for the call (``template_messages``: the
messages passed to them, all calls together): the work that does not depend on the machine's load.

Prints ONE JSON line: ``{"tool_results": [{"n", "prepare_s", "hold_s", "gc_s", "template_calls",
"template_messages"}...], "messages": [{"n", "first_s", "first_hold_s", "first_gc_s",
"first_template_calls", "extend_s", "extend_hold_s", "extend_gc_s", "extend_template_calls"}...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
HEARTBEAT_S = 0.0005


def _renderer():
    """The renderer, its ``render`` counting template calls and the messages passed to them
    (``work``: ``[calls, messages]``)."""
    from gyre.embedded_model import ensure_tiny_model, load_tokenizer
    from gyre.proxy.render import ChatRenderer

    r = ChatRenderer(load_tokenizer(ensure_tiny_model("local")))
    render, r.work = r.render, [0, 0]

    def counted(messages, *args, **kw):
        r.work[0] += 1
        r.work[1] += len(messages)
        return render(messages, *args, **kw)

    r.render = counted
    return r


class _CollectorPauses:
    """The longest pause of Python's cyclic garbage collector while active (``gc.callbacks``)."""

    def __init__(self):
        self.longest, self._t = 0.0, 0.0

    def __call__(self, phase, _info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._t)

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


async def _timed_prepare(session, request, pool) -> tuple[object, float, float, float]:
    """``(prepared, seconds, longest event-loop hold, longest collector pause)`` of one
    ``prepare_async``."""
    done = False
    longest = 0.0

    async def heartbeat():
        nonlocal longest
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(HEARTBEAT_S)
            longest = max(longest, time.perf_counter() - t - HEARTBEAT_S)

    hb = asyncio.ensure_future(heartbeat())
    await asyncio.sleep(HEARTBEAT_S * 2)  # the heartbeat is running
    session.renderer.work[:] = [0, 0]
    with _CollectorPauses() as pauses:
        t0 = time.perf_counter()
        prep = await session.prepare_async(request, pool)
        dt = time.perf_counter() - t0
        done = True
        await hb
    return prep, dt, longest, pauses.longest


def _commit(session, prep, renderer, message):
    import numpy as np

    ids = renderer.encode(renderer.assistant_output_text(message))
    session.commit(prep, output_ids=ids, output_logprobs=np.zeros(len(ids), np.float32), finish_reason="stop",
                   output_message=message, role="main")


def tool_results_case(renderer, pool, n: int, chars: int) -> dict:
    from gyre.proxy.messages import ChatRequest, Message, ToolCall
    from gyre.proxy.tito import TitoSession

    s = TitoSession("bench", renderer)
    head = [Message("system", "You are a helpful agent."), Message("user", "Inspect every file.")]
    prep, *_ = asyncio.run(_timed_prepare(s, ChatRequest("chat", head, tools=TOOLS), pool))
    calls = tuple(ToolCall(f"call_{i}", "bash", json.dumps({"command": f"cat f{i}.py"})) for i in range(n))
    out = Message("assistant", "", None, calls)
    _commit(s, prep, renderer, out)
    filler = ("x = compute(y) + 1\n" * (chars // 19 + 1))[:chars]
    results = [Message("tool", f"{i}: {filler}", tool_call_id=f"call_{i}") for i in range(n)]
    req = ChatRequest("chat", head + [out] + results, tools=TOOLS)
    _, dt, hold, gc_s = asyncio.run(_timed_prepare(s, req, pool))
    return {"n": n, "prepare_s": round(dt, 4), "hold_s": round(hold, 4), "gc_s": round(gc_s, 4),
            "template_calls": renderer.work[0], "template_messages": renderer.work[1]}


def messages_case(renderer, pool, n: int) -> dict:
    from gyre.proxy.messages import ChatRequest, Message
    from gyre.proxy.tito import TitoSession

    s = TitoSession("bench", renderer)
    conv = [Message("user" if i % 2 == 0 else "assistant", f"m{i}") for i in range(n - 1 + n % 2)]
    prep, first, first_hold, first_gc = asyncio.run(_timed_prepare(s, ChatRequest("chat", conv), pool))
    first_work = list(renderer.work)
    out = Message("assistant", "done")
    _commit(s, prep, renderer, out)
    _, ext, ext_hold, ext_gc = asyncio.run(_timed_prepare(s, ChatRequest("chat", conv + [out, Message("user", "next")]),
                                                          pool))
    return {"n": len(conv), "first_s": round(first, 4), "first_hold_s": round(first_hold, 4),
            "first_gc_s": round(first_gc, 4), "first_template_calls": first_work[0], "extend_s": round(ext, 4),
            "extend_hold_s": round(ext_hold, 4), "extend_gc_s": round(ext_gc, 4),
            "extend_template_calls": renderer.work[0]}


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool-results", default="10,100,500,1000,2000", help="N tool results after one assistant message")
    ap.add_argument("--messages", default="1000,10000,50000", help="N small messages in one conversation")
    ap.add_argument("--result-chars", type=int, default=200, help="characters of each tool result")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="stop a series after a call this slow")
    args = ap.parse_args()
    renderer = _renderer()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench-encode")
    out: dict = {"tool_results": [], "messages": []}
    slow = False
    for n in _sizes(args.tool_results):
        row = {"n": n, "prepare_s": None} if slow else tool_results_case(renderer, pool, n, args.result_chars)
        slow = slow or row["prepare_s"] > args.max_seconds
        out["tool_results"].append(row)
    slow = False
    for n in _sizes(args.messages):
        row = {"n": n, "first_s": None} if slow else messages_case(renderer, pool, n)
        slow = slow or row["first_s"] > args.max_seconds
        out["messages"].append(row)
    pool.shutdown()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
