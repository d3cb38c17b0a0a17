"""A scripted fake LLM server for harness tests and trace recording (a test utility).

Speaks OpenAI Chat Completions (stream and not), Anthropic Messages (stream and not, plus
``count_tokens``), OpenAI Responses (stream and not) and ``GET /v1/models`` on 127.0.0.1. Every
request is logged (:class:`Logged`); the reply comes from a *policy*, a function
``policy(req: FakeRequest) -> Reply``. :func:`shell_script_policy` is the usual one: it counts the
tool results already in the context and answers step ``k`` of a list of shell commands with a
call of whatever shell tool the harness offers, then a final text.

A :class:`Reply` can also carry a thinking block (Anthropic) or a reasoning item (Responses),
custom and namespaced tool calls (Responses), a reported ``usage`` input-token count, and an
injected failure: an HTTP error status (with ``retry-after: 1`` for 429/503/529), a delay before
answering (``delay_s``), or a stream cut after its first event (``drop``).

With ``trace_path`` every request is also appended to a JSON-lines file, one object per request:
``seq`` (from 1), ``ts`` (arrival, unix seconds), ``method``, ``path``, ``query``, ``api``
(``anthropic``/``chat``/``responses``/``count_tokens``/``unknown``), ``headers`` (as received),
``body`` (parsed JSON, or the raw text), ``kind`` and ``step`` (from the reply's ``kind``/``step``,
set by the policy), ``injected`` (only on injected failures: ``"500"``, ``"delay 5.0s"``,
``"drop mid-stream"``), and ``response`` ``{status, stream, message}`` where ``message`` is the
complete reply object (for streams: the object the events assemble to; for a dropped stream the
reply it had started to send). Records are written when the reply has been produced, so their
order in the file is the order of ``seq`` only when requests do not overlap; the file is sorted
by ``seq`` on exit.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gyre.harness.roles import request_texts


@dataclass
class Reply:
    """A scripted reply: ``text`` and/or ``tool_calls`` as ``(name, arguments)`` or
    ``(name, arguments, options)`` where arguments is a dict (JSON-encoded) or a raw string and
    options may say ``{"custom": True}`` (a Responses custom tool call; arguments is its input
    text) or ``{"namespace": "..."}`` (a namespaced Responses function call). ``thinking`` adds an
    Anthropic thinking block, ``reasoning`` a Responses reasoning item; ``input_tokens`` is
    reported as usage. ``status`` != 200 answers an HTTP error, ``delay_s`` sleeps before
    answering, ``drop`` cuts a stream after its first event. ``kind`` and ``step`` go into the
    trace record only."""

    text: str = ""
    tool_calls: list[tuple[Any, ...]] = field(default_factory=list)
    input_tokens: int | None = None
    status: int = 200
    thinking: str | None = None
    reasoning: str | None = None
    delay_s: float = 0.0
    drop: bool = False
    kind: str | None = None
    step: int | None = None


@dataclass
class Logged:
    api: str
    path: str
    headers: dict[str, str]
    body: Any
    reply: Reply | None = None
    seq: int = 0
    ts: float = 0.0
    method: str = "POST"
    query: dict[str, str] = field(default_factory=dict)
    response: dict[str, Any] = field(default_factory=dict)
    injected: str | None = None

    def trace_record(self) -> dict[str, Any]:
        """The JSON-lines trace record of this request (module docstring)."""
        r = self.reply
        rec: dict[str, Any] = {"seq": self.seq, "ts": round(self.ts, 3), "method": self.method, "path": self.path,
                               "query": self.query, "api": self.api, "headers": self.headers, "body": self.body,
                               "kind": r.kind if r else None, "step": r.step if r else None}
        if self.injected:
            rec["injected"] = self.injected
        rec["response"] = self.response
        return rec


@dataclass
class FakeRequest:
    api: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def tool_names(self) -> list[str]:
        out = []
        for t in self.body.get("tools") or []:
            if "function" in t and isinstance(t["function"], dict):
                out.append(t["function"].get("name"))
            elif t.get("type") == "namespace":
                out.extend(f"{t.get('name')}.{x.get('name')}" for x in t.get("tools") or [])
            else:
                out.append(t.get("name"))
        return [n for n in out if n]

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)

    def tool_results(self) -> list[str]:
        """Texts of the tool results in the context, in order."""
        out: list[str] = []
        if self.api == "anthropic":
            for m in self.body.get("messages") or []:
                if isinstance(m.get("content"), list):
                    for b in m["content"]:
                        if isinstance(b, dict) and b.get("type") == "tool_result":
                            c = b.get("content")
                            out.append(c if isinstance(c, str) else json.dumps(c))
        elif self.api == "chat":
            out = [m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
                   for m in self.body.get("messages") or [] if m.get("role") == "tool"]
        else:
            items = self.body.get("input")
            for it in items if isinstance(items, list) else []:
                if isinstance(it, dict) and it.get("type") in ("function_call_output", "custom_tool_call_output"):
                    o = it.get("output")
                    out.append(o if isinstance(o, str) else json.dumps(o))
        return out

    def texts(self) -> dict[str, str]:
        return request_texts(self.body)


def shell_call(req: FakeRequest, command: str) -> tuple[str, Any]:
    """A call of the shell tool the harness offers, running ``command``."""
    names = req.tool_names
    if "Bash" in names:
        return "Bash", {"description": "Run the scripted command", "command": command}
    if "exec_command" in names:
        return "exec_command", {"cmd": command}
    if "shell" in names:
        return "shell", {"command": ["bash", "-lc", command]}
    if "bash" in names:
        return "bash", {"command": command}
    raise AssertionError(f"no shell tool offered: {names}")


def shell_script_policy(commands: Sequence[str], final: str = "All done. DONE_MARKER",
                        submit: str | None = None) -> Callable[[FakeRequest], Reply]:
    """Step k (= tool results in context) runs ``commands[k]``; then ``submit`` (a final
    command, e.g. mini-swe-agent's) if given; then the final text. Requests without tools get
    a short text (titles, summaries)."""

    def policy(req: FakeRequest) -> Reply:
        if not req.tool_names:
            return Reply(text="SUMMARY-MARKER: nothing to report")
        k = len(req.tool_results())
        if k < len(commands):
            return Reply(text=f"step {k}", tool_calls=[shell_call(req, commands[k])])
        if submit is not None and k == len(commands):
            return Reply(text="submitting", tool_calls=[shell_call(req, submit)])
        return Reply(text=final)

    return policy


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _args_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args)


def _call_parts(call: tuple[Any, ...]) -> tuple[str, Any, dict[str, Any]]:
    name, args = call[0], call[1]
    opts = call[2] if len(call) > 2 and isinstance(call[2], dict) else {}
    return name, args, opts


def _sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


class _Dropped(Exception):
    """Raised inside a streaming body to cut the connection (an injected mid-stream drop)."""


def _error_body(api: str, status: int) -> dict[str, Any]:
    if api == "anthropic":
        kind = {429: "rate_limit_error", 529: "overloaded_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": f"injected {status}"}}
    return {"error": {"message": f"injected {status}", "type": "server_error" if status >= 500 else "rate_limit",
                      "code": None}}


class FakeLLMServer:
    """``with FakeLLMServer(policy) as srv: srv.base_url`` -- the server runs in a thread.

    ``trace_path``: append every request's trace record (module docstring) to this file;
    ``port``: listen on this port (default: any free one)."""

    def __init__(self, policy: Callable[[FakeRequest], Reply], *, model: str = "fake-model",
                 api_key: str | None = None, trace_path: str | Path | None = None, port: int = 0) -> None:
        self.policy, self.model, self.api_key = policy, model, api_key
        self.trace_path = Path(trace_path) if trace_path is not None else None
        self.log: list[Logged] = []
        self._lock = threading.Lock()
        routes = [Route("/v1/chat/completions", self._chat, methods=["POST"]),
                  Route("/v1/messages", self._messages, methods=["POST"]),
                  Route("/v1/messages/count_tokens", self._count, methods=["POST"]),
                  Route("/v1/responses", self._responses, methods=["POST"]),
                  Route("/v1/models", self._models, methods=["GET"]),
                  Route("/{path:path}", self._other, methods=["GET", "POST", "HEAD"])]
        self.app = Starlette(routes=routes)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="critical", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeLLMServer":
        if self.trace_path is not None:
            self.trace_path.parent.mkdir(parents=True, exist_ok=True)
            self.trace_path.write_text("")
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake LLM server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        if self.trace_path is not None:
            with self._lock:
                logged = sorted(self.log, key=lambda e: e.seq)
            self.trace_path.write_text("".join(json.dumps(e.trace_record()) + "\n" for e in logged))

    def requests(self, api: str | None = None) -> list[Logged]:
        with self._lock:
            return [r for r in self.log if api is None or r.api == api]

    def _write(self, entry: Logged) -> None:
        if self.trace_path is not None:
            with self._lock, open(self.trace_path, "a") as f:
                f.write(json.dumps(entry.trace_record()) + "\n")

    async def _read(self, request: Request, api: str) -> tuple[FakeRequest, Logged, Response | None]:
        ts = time.time()
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = raw.decode(errors="replace")
        headers = dict(request.headers)
        entry = Logged(api, request.url.path, headers, body, ts=ts, method=request.method,
                       query=dict(request.query_params))
        with self._lock:
            self.log.append(entry)
            entry.seq = len(self.log)
        err: Response | None = None
        if self.api_key is not None:
            auth = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key")
            if auth != self.api_key:
                err = JSONResponse({"error": {"message": "bad key"}}, 401)
        if err is None and not isinstance(body, dict):
            err = JSONResponse({"error": {"message": "not JSON"}}, 400)
        if err is not None:
            entry.response = {"status": err.status_code, "stream": False, "message": json.loads(err.body)}
            self._write(entry)
            return FakeRequest(api, headers, {}), entry, err
        return FakeRequest(api, headers, body), entry, None

    async def _reply(self, req: FakeRequest, entry: Logged) -> tuple[Reply, Response | None]:
        """The policy's reply; an error response for an injected HTTP failure (logged here)."""
        reply = await asyncio.to_thread(self.policy, req)
        entry.reply = reply
        if reply.delay_s:
            entry.injected = f"delay {reply.delay_s:.1f}s"
            await asyncio.sleep(reply.delay_s)
        if reply.status != 200:
            entry.injected = str(reply.status)
            err = _error_body(req.api, reply.status)
            headers = {"retry-after": "1"} if reply.status in (429, 503, 529) else None
            entry.response = {"status": reply.status, "stream": False, "message": err}
            self._write(entry)
            return reply, JSONResponse(err, reply.status, headers=headers)
        if reply.drop:
            entry.injected = "drop mid-stream"
        return reply, None

    def _finish(self, entry: Logged, stream: bool, message: dict[str, Any]) -> None:
        entry.response = {"status": 200, "stream": stream, "message": message}
        self._write(entry)

    def _stream(self, entry: Logged, reply: Reply, events: list[bytes], message: dict[str, Any]) -> Response:
        self._finish(entry, True, message)

        async def gen():
            for i, ev in enumerate(events):
                yield ev
                if reply.drop and i == 0:
                    await asyncio.sleep(0.05)
                    raise _Dropped("injected mid-stream drop")

        return StreamingResponse(gen(), media_type="text/event-stream")

    # ------------------------------------------------------------------ OpenAI chat

    async def _chat(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "chat")
        if err:
            return err
        r, err = await self._reply(req, entry)
        if err:
            return err
        calls = [{"id": _id("call_fake_"), "type": "function", "function": {"name": n, "arguments": _args_text(a)}}
                 for n, a, _ in map(_call_parts, r.tool_calls)]
        finish = "tool_calls" if calls else "stop"
        usage = {"prompt_tokens": r.input_tokens or 100, "completion_tokens": 10,
                 "total_tokens": (r.input_tokens or 100) + 10}
        cid = _id("chatcmpl-fake")
        msg: dict[str, Any] = {"role": "assistant", "content": r.text or None}
        if calls:
            msg["tool_calls"] = calls
        done = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish}], "usage": usage}
        if not req.body.get("stream"):
            self._finish(entry, False, done)
            return JSONResponse(done)

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            return _sse(None, {"id": cid, "object": "chat.completion.chunk", "created": done["created"],
                               "model": self.model, "choices": [{"index": 0, "delta": delta,
                                                                  "finish_reason": finish_reason}]})

        events = [chunk({"role": "assistant", "content": ""})]
        if r.text:
            events.append(chunk({"content": r.text}))
        for i, c in enumerate(calls):
            events.append(chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                                 "function": {"name": c["function"]["name"], "arguments": ""}}]}))
            events.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]}))
        events.append(chunk({}, finish))
        if (req.body.get("stream_options") or {}).get("include_usage"):
            events.append(_sse(None, {"id": cid, "object": "chat.completion.chunk", "model": self.model,
                                      "choices": [], "usage": usage}))
        events.append(_sse(None, "[DONE]"))
        return self._stream(entry, r, events, done)

    # ------------------------------------------------------------------ Anthropic

    async def _count(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "count_tokens")
        if err:
            return err
        entry.response = {"status": 200, "stream": False, "message": {"input_tokens": 100}}
        self._write(entry)
        return JSONResponse({"input_tokens": 100})

    async def _messages(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "anthropic")
        if err:
            return err
        r, err = await self._reply(req, entry)
        if err:
            return err
        blocks: list[dict[str, Any]] = []
        if r.thinking is not None:
            blocks.append({"type": "thinking", "thinking": r.thinking, "signature": _id("sig_fake_")})
        if r.text:
            blocks.append({"type": "text", "text": r.text})
        for n, a, _ in map(_call_parts, r.tool_calls):
            blocks.append({"type": "tool_use", "id": _id("toolu_fake_"), "name": n,
                           "input": a if isinstance(a, dict) else json.loads(a)})
        stop = "tool_use" if r.tool_calls else "end_turn"
        usage = {"input_tokens": r.input_tokens or 100, "output_tokens": 10, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        mid = _id("msg_fake_")
        model = req.body.get("model") or self.model
        done = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
                "stop_reason": stop, "stop_sequence": None, "usage": usage}
        if not req.body.get("stream"):
            self._finish(entry, False, done)
            return JSONResponse(done)
        events = [_sse("message_start", {"type": "message_start", "message": {
            **done, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}})]
        for i, b in enumerate(blocks):
            if b["type"] == "thinking":
                events.append(_sse("content_block_start", {"type": "content_block_start", "index": i,
                                                           "content_block": {"type": "thinking", "thinking": ""}}))
                events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "thinking_delta", "thinking": b["thinking"]}}))
                events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "signature_delta", "signature": b["signature"]}}))
            elif b["type"] == "text":
                events.append(_sse("content_block_start", {"type": "content_block_start", "index": i,
                                                           "content_block": {"type": "text", "text": ""}}))
                events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": i,
                                                           "delta": {"type": "text_delta", "text": b["text"]}}))
            else:
                events.append(_sse("content_block_start", {"type": "content_block_start", "index": i,
                                                           "content_block": {"type": "tool_use", "id": b["id"],
                                                                             "name": b["name"], "input": {}}}))
                events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(b["input"])}}))
            events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": i}))
        events.append(_sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop,
                                                                                "stop_sequence": None},
                                             "usage": {"output_tokens": 10}}))
        events.append(_sse("message_stop", {"type": "message_stop"}))
        return self._stream(entry, r, events, done)

    # ------------------------------------------------------------------ Responses

    async def _responses(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "responses")
        if err:
            return err
        r, err = await self._reply(req, entry)
        if err:
            return err
        items: list[dict[str, Any]] = []
        if r.reasoning is not None:
            it: dict[str, Any] = {"type": "reasoning", "id": _id("rs_fake_"),
                                  "summary": [{"type": "summary_text", "text": r.reasoning}]}
            if "reasoning.encrypted_content" in (req.body.get("include") or []):
                it["encrypted_content"] = _id("fakeenc_")
            items.append(it)
        if r.text:
            items.append({"type": "message", "id": _id("msg_fake_"), "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": r.text, "annotations": []}]})
        for n, a, opts in map(_call_parts, r.tool_calls):
            if opts.get("custom"):
                items.append({"type": "custom_tool_call", "id": _id("ctc_fake_"), "call_id": _id("call_fake_"),
                              "name": n, "input": a, "status": "completed"})
                continue
            call = {"type": "function_call", "id": _id("fc_fake_"), "call_id": _id("call_fake_"), "name": n,
                    "arguments": _args_text(a), "status": "completed"}
            if opts.get("namespace"):
                call["namespace"] = opts["namespace"]
            items.append(call)
        rid = _id("resp_fake_")
        usage = {"input_tokens": r.input_tokens or 100, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": (r.input_tokens or 100) + 10}
        model = req.body.get("model") or self.model
        base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        done = {**base, "status": "completed", "output": items, "usage": usage}
        if not req.body.get("stream"):
            self._finish(entry, False, done)
            return JSONResponse(done)
        seq = 0

        def ev(kind: str, **data: Any) -> bytes:
            nonlocal seq
            seq += 1
            return _sse(kind, {"type": kind, "sequence_number": seq, **data})

        events = [ev("response.created", response={**base, "status": "in_progress", "output": []})]
        for i, it in enumerate(items):
            events.append(ev("response.output_item.added", output_index=i, item=it))
            if it["type"] == "message":
                events.append(ev("response.output_text.delta", item_id=it["id"], output_index=i, content_index=0,
                                 delta=it["content"][0]["text"]))
            events.append(ev("response.output_item.done", output_index=i, item=it))
        events.append(ev("response.completed", response=done))
        return self._stream(entry, r, events, done)

    async def _models(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "unknown")
        msg = {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "gyre"}]}
        entry.response = {"status": 200, "stream": False, "message": msg}
        self._write(entry)
        return JSONResponse(msg)

    async def _other(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "unknown")
        msg = {"error": {"message": "not found"}}
        entry.response = {"status": 404, "stream": False, "message": msg}
        self._write(entry)
        return JSONResponse(msg, 404)
