"""The load generator of ``bench/scale.py``: synthetic black-box executions in their own process.

One process owns a slice of the executions and runs them on one asyncio loop (uvloop) with an
aiohttp client and orjson (the generator shares this machine's cores with the proxy it loads,
so it is kept cheap). Each
execution is a tool-calling agent on one of the three APIs (Anthropic Messages, OpenAI Chat,
OpenAI Responses), streaming or not, that sends its *whole* conversation on every call (as a
black-box harness does) and appends the reply's tool call and a tool result of about
``turn_tokens`` new tokens after it. Some calls are a sub-agent's (its own fresh conversation,
``x-gyre-role: subagent``); some executions compact (a summary request, ``x-gyre-role:
compaction``, then a new conversation that starts from a summary).

The parent drives the process through stdin, one JSON command per line, and reads one JSON
result line per command on stdout:

* ``{"op": "warm"}``: every execution makes one call (its whole initial context is new to the
  proxy), at most ``concurrency`` at once;
* ``{"op": "open", "rate": R, "duration": S}``: open loop: calls start at Poisson rate ``R``
  (this process's share), each on an idle execution picked at random, for ``S`` seconds, then
  the process waits for the calls in flight;
* ``{"op": "closed", "concurrency": C, "duration": S}``: ``C`` workers call idle executions back
  to back (no think time) for ``S`` seconds;
* ``{"op": "quit"}``.

A result carries the calls answered (HTTP 200), their latencies, the errors, and the live
context tokens (the prompt length of each execution's last call, from ``usage``).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}
ARGS = '{"command": "cat src/module.py"}'
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                               "parameters": SCHEMA}}],
    "anthropic": [{"name": "bash", "description": "Run a shell command.", "input_schema": SCHEMA}],
    "responses": [{"type": "function", "name": "bash", "description": "Run a shell command.", "parameters": SCHEMA}],
}


@dataclass
class Conversation:
    """One conversation of an execution in its API's own shape."""

    api: str
    system: str
    items: list[dict[str, Any]] = field(default_factory=list)

    def body(self, stream: bool, max_tokens: int) -> dict[str, Any]:
        if self.api == "chat":
            b = {"model": "policy", "messages": [{"role": "system", "content": self.system}, *self.items],
                 "tools": TOOLS["chat"], "max_tokens": max_tokens}
            if stream:
                b["stream_options"] = {"include_usage": True}
        elif self.api == "anthropic":
            b = {"model": "policy", "system": self.system, "messages": self.items, "tools": TOOLS["anthropic"],
                 "max_tokens": max_tokens}
        else:
            b = {"model": "policy", "instructions": self.system, "input": self.items, "tools": TOOLS["responses"],
                 "max_output_tokens": max_tokens}
        b["stream"] = stream
        return b

    def user(self, text: str) -> None:
        if self.api == "responses":
            self.items.append({"type": "message", "role": "user", "content": text})
        else:
            self.items.append({"role": "user", "content": text})

    def tool_turn(self, call_id: str, result: str) -> None:
        """The reply's tool call and its result."""
        if self.api == "chat":
            self.items += [{"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": ARGS}}]},
                {"role": "tool", "tool_call_id": call_id, "content": result}]
        elif self.api == "anthropic":
            self.items += [{"role": "assistant", "content": [
                {"type": "tool_use", "id": call_id, "name": "bash", "input": json.loads(ARGS)}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]}]
        else:
            self.items += [{"type": "function_call", "call_id": call_id, "name": "bash", "arguments": ARGS},
                           {"type": "function_call_output", "call_id": call_id, "output": result}]


def reply_of(api: str, stream: bool, raw: bytes) -> tuple[str, int]:
    """``(tool call id, prompt tokens)`` of a reply (whole body, or all SSE bytes when streamed)."""
    if not stream:
        r = orjson.loads(raw)
        if api == "chat":
            return r["choices"][0]["message"]["tool_calls"][0]["id"], r["usage"]["prompt_tokens"]
        if api == "anthropic":
            return next(b["id"] for b in r["content"] if b["type"] == "tool_use"), r["usage"]["input_tokens"]
        call = next(o for o in r["output"] if o["type"] == "function_call")
        return call["call_id"], r["usage"]["input_tokens"]
    call_id, tokens = None, 0
    for line in raw.decode().splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        ev = orjson.loads(line[5:])
        if api == "chat":
            for ch in ev.get("choices") or ():
                for tc in (ch.get("delta") or {}).get("tool_calls") or ():
                    call_id = call_id or tc.get("id")
            if ev.get("usage"):
                tokens = ev["usage"]["prompt_tokens"]
        elif api == "anthropic":
            if ev.get("type") == "message_start":
                tokens = ev["message"]["usage"]["input_tokens"]
            elif ev.get("type") == "content_block_start" and ev["content_block"]["type"] == "tool_use":
                call_id = call_id or ev["content_block"]["id"]
        elif ev.get("type") == "response.completed":
            resp = ev["response"]
            call_id = next(o["call_id"] for o in resp["output"] if o["type"] == "function_call")
            tokens = resp["usage"]["input_tokens"]
    if call_id is None:
        raise ValueError("the reply has no tool call")
    return call_id, tokens


class Execution:
    """One synthetic execution: its key, API, streaming, main conversation and an optional sub-agent's."""

    def __init__(self, index: int, key: str, rnd: random.Random, texts: "Texts", init_tokens: int) -> None:
        self.index, self.key, self.rnd, self.texts = index, key, rnd, texts
        self.api = ("anthropic", "chat", "responses")[index % 3]
        self.stream = rnd.random() < 0.5
        self.turn = 0
        self.main = self._fresh(texts.system, f"Task {index}: fix the failing tests.\n" + texts.chunk(init_tokens))
        self.sub: Conversation | None = None
        self.context_tokens = 0
        self.base_url = ""  # the proxy worker that owns it

    def _fresh(self, system: str, task: str) -> Conversation:
        c = Conversation(self.api, system)
        c.user(task)
        return c

    def headers(self, role: str) -> dict[str, str]:
        h = {"content-type": "application/json", "x-gyre-role": role}
        if self.api == "anthropic":
            h["x-api-key"] = self.key
        else:
            h["authorization"] = f"Bearer {self.key}"
        return h

    def next_call(self, subagent_share: float, compaction_share: float) -> tuple[str, Conversation]:
        """The role and conversation of the next call."""
        r = self.rnd.random()
        if self.sub is not None or r < subagent_share:
            if self.sub is None:
                self.sub = self._fresh(self.texts.sub_system, f"Sub-task of {self.index}: read the module.")
            return "subagent", self.sub
        if r < subagent_share + compaction_share and len(self.main.items) > 4:
            return "compaction", self.main
        return "main", self.main

    def after(self, role: str, conv: Conversation, call_id: str, turn_tokens: int) -> None:
        self.turn += 1
        result = f"[{self.index}.{self.turn}] " + self.texts.chunk(turn_tokens)
        if role == "compaction":
            self.main = self._fresh(self.texts.system, "Summary of the work so far:\n" + self.texts.chunk(turn_tokens))
            return
        conv.tool_turn(call_id, result)
        if role == "subagent" and len(conv.items) >= 8:  # the sub-agent returns after a few calls
            self.sub = None


class Texts:
    """Filler text by tokens, from a fixed pool of words; ``chars_per_token`` is measured by the
    parent on the proxy's tokenizer (:func:`chars_per_token`)."""

    def __init__(self, seed: int, chars_per_token: float = 2.0) -> None:
        self.chars_per_token = chars_per_token
        rnd = random.Random(seed)
        vocab = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 9))) for _ in range(4000)]
        words = [rnd.choice(vocab) for _ in range(400_000)]
        self.pool = "\n".join(" ".join(words[i:i + 12]) for i in range(0, len(words), 12))
        self.rnd = rnd
        self.system = "You are a coding agent.\n" + self.chunk(2000)
        self.sub_system = "You are a read-only helper.\n" + self.chunk(1200)

    def chunk(self, tokens: int) -> str:
        """About ``tokens`` tokens of text: a slice of the pool (a cheap view-free copy) or repeats of it."""
        chars = int(tokens * self.chars_per_token)
        if chars <= 0:
            return ""
        if chars >= len(self.pool):
            return (self.pool * (chars // len(self.pool) + 1))[:chars]
        start = self.rnd.randrange(0, len(self.pool) - chars)
        return self.pool[start:start + chars]


def chars_per_token(tokenizer, seed: int = 0) -> float:
    """Characters per token of :class:`Texts` on ``tokenizer`` (a 200k-character sample)."""
    sample = Texts(seed).chunk(100_000)
    return len(sample) / len(tokenizer.encode(sample, add_special_tokens=False))


async def serve(cfg: dict[str, Any]) -> None:
    import aiohttp

    rnd = random.Random(cfg["seed"])
    texts = Texts(cfg["seed"], cfg["chars_per_token"])
    execs = [Execution(i, k, random.Random(cfg["seed"] * 100_003 + i), texts,
                       rnd.randint(cfg["init_tokens_min"], cfg["init_tokens_max"]))
             for i, k in zip(cfg["indices"], cfg["keys"])]
    for ex, url in zip(execs, cfg["urls"]):  # each execution calls the proxy worker that owns it
        ex.base_url = url
    idle = list(range(len(execs)))
    connector = aiohttp.TCPConnector(limit=len(execs) + 8, limit_per_host=0)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:
        lat: list[float] = []
        errors: list[str] = []

        async def call(i: int) -> None:
            ex = execs[i]
            try:
                role, conv = ex.next_call(cfg["subagent_share"], cfg["compaction_share"])
                body = conv.body(ex.stream, 256)
                if role == "compaction":
                    summary = "Summarize the conversation so far."
                    key = "input" if ex.api == "responses" else "messages"
                    extra = ({"type": "message", "role": "user", "content": summary} if ex.api == "responses"
                             else {"role": "user", "content": summary})
                    body[key] = [*body[key], extra]
                data = orjson.dumps(body)
                t0 = time.perf_counter()
                async with client.post(ex.base_url + PATHS[ex.api], data=data, headers=ex.headers(role)) as r:
                    raw, status = await r.read(), r.status  # the whole body, or every SSE event
                dt = time.perf_counter() - t0
                if status != 200:
                    errors.append(f"{ex.api}: HTTP {status}: {raw[:200]!r}")
                    return
                call_id, tokens = reply_of(ex.api, ex.stream, raw)
                lat.append(dt)
                if role == "main":
                    ex.context_tokens = tokens
                ex.after(role, conv, call_id, cfg["turn_tokens"])
            except Exception as exc:  # counted, never fatal: the bench reports errors
                errors.append(f"{ex.api}: {type(exc).__name__}: {exc}"[:300])
            finally:
                idle.append(i)

        def take() -> int | None:
            if not idle:
                return None
            j = rnd.randrange(len(idle))
            idle[j], idle[-1] = idle[-1], idle[j]
            return idle.pop()

        while True:
            line = await reader.readline()
            if not line:
                return
            cmd = json.loads(line)
            lat, errors = [], []
            t_start = time.perf_counter()
            tasks: set[asyncio.Task] = set()
            if cmd["op"] == "quit":
                return
            if cmd["op"] == "warm":
                sem = asyncio.Semaphore(cmd.get("concurrency", 16))

                async def warm(i: int) -> None:
                    async with sem:
                        idle.remove(i)
                        await call(i)

                await asyncio.gather(*(warm(i) for i in range(len(execs))))
            elif cmd["op"] == "open":
                end = t_start + cmd["duration"]
                skipped = 0
                while True:
                    await asyncio.sleep(rnd.expovariate(cmd["rate"]))
                    if time.perf_counter() >= end:
                        break
                    i = take()
                    if i is None:
                        skipped += 1
                        continue
                    t = asyncio.create_task(call(i))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks)
            elif cmd["op"] == "closed":
                end = t_start + cmd["duration"]

                async def worker() -> None:
                    while time.perf_counter() < end:
                        i = take()
                        if i is None:
                            await asyncio.sleep(0.01)
                            continue
                        await call(i)

                await asyncio.gather(*(worker() for _ in range(cmd["concurrency"])))
            out = {"calls": len(lat), "latencies": lat, "errors": errors[:20], "num_errors": len(errors),
                   "wall_s": time.perf_counter() - t_start,
                   "context_tokens": sum(e.context_tokens for e in execs)}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()


def main() -> int:
    cfg = json.loads(open(sys.argv[1]).read())
    try:
        from uvloop import new_event_loop
    except ImportError:  # the stdlib loop: more CPU per call, same behaviour
        new_event_loop = None
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
