"""A scripted fake LLM server for harness tests (in the spirit of shared/traces' fake_llm.py).

Speaks OpenAI Chat Completions (stream and not), Anthropic Messages (stream and not, plus
``count_tokens``), OpenAI Responses (stream and not) and ``GET /v1/models`` on 127.0.0.1. Every
request is logged (:class:`Logged`); the reply comes from a *policy*, a function
``policy(req: FakeRequest) -> Reply``. :func:`shell_script_policy` is the usual one: it counts the
tool results already in the context and answers step ``k`` of a list of shell commands with a
call of whatever shell tool the harness offers, then a final text.
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
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gyre.harness.roles import request_texts


@dataclass
class Reply:
    """A scripted reply: ``text`` and/or ``tool_calls`` as ``(name, arguments)`` where
    arguments is a dict (JSON-encoded) or a raw string; ``input_tokens`` is reported as usage."""

    text: str = ""
    tool_calls: list[tuple[str, Any]] = field(default_factory=list)
    input_tokens: int | None = None
    status: int = 200


@dataclass
class Logged:
    api: str
    path: str
    headers: dict[str, str]
    body: Any
    reply: Reply | None = None


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


def _sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


class FakeLLMServer:
    """``with FakeLLMServer(policy) as srv: srv.base_url`` -- the server runs in a thread."""

    def __init__(self, policy: Callable[[FakeRequest], Reply], *, model: str = "fake-model",
                 api_key: str | None = None) -> None:
        self.policy, self.model, self.api_key = policy, model, api_key
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
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeLLMServer":
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

    def requests(self, api: str | None = None) -> list[Logged]:
        with self._lock:
            return [r for r in self.log if api is None or r.api == api]

    async def _read(self, request: Request, api: str) -> tuple[FakeRequest, Logged, Response | None]:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = raw.decode(errors="replace")
        headers = dict(request.headers)
        entry = Logged(api, request.url.path, headers, body)
        with self._lock:
            self.log.append(entry)
        if self.api_key is not None:
            auth = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key")
            if auth != self.api_key:
                return FakeRequest(api, headers, {}), entry, JSONResponse({"error": {"message": "bad key"}}, 401)
        if not isinstance(body, dict):
            return FakeRequest(api, headers, {}), entry, JSONResponse({"error": {"message": "not JSON"}}, 400)
        return FakeRequest(api, headers, body), entry, None

    def _reply(self, req: FakeRequest, entry: Logged) -> Reply:
        reply = self.policy(req)
        entry.reply = reply
        return reply

    # ------------------------------------------------------------------ OpenAI chat

    async def _chat(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "chat")
        if err:
            return err
        r = await asyncio.to_thread(self._reply, req, entry)
        if r.status != 200:
            return JSONResponse({"error": {"message": "injected", "type": "server_error"}}, r.status)
        calls = [{"id": _id("call_"), "type": "function", "function": {"name": n, "arguments": _args_text(a)}}
                 for n, a in r.tool_calls]
        finish = "tool_calls" if calls else "stop"
        usage = {"prompt_tokens": r.input_tokens or 100, "completion_tokens": 10,
                 "total_tokens": (r.input_tokens or 100) + 10}
        cid = _id("chatcmpl-")
        if not req.body.get("stream"):
            msg: dict[str, Any] = {"role": "assistant", "content": r.text or None}
            if calls:
                msg["tool_calls"] = calls
            return JSONResponse({"id": cid, "object": "chat.completion", "created": int(time.time()),
                                 "model": self.model, "choices": [{"index": 0, "message": msg,
                                                                    "finish_reason": finish}], "usage": usage})

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            return _sse(None, {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                               "model": self.model, "choices": [{"index": 0, "delta": delta,
                                                                  "finish_reason": finish_reason}]})

        async def gen():
            yield chunk({"role": "assistant", "content": ""})
            if r.text:
                yield chunk({"content": r.text})
            for i, c in enumerate(calls):
                yield chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                             "function": {"name": c["function"]["name"], "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
            yield chunk({}, finish)
            if (req.body.get("stream_options") or {}).get("include_usage"):
                yield _sse(None, {"id": cid, "object": "chat.completion.chunk", "model": self.model, "choices": [],
                                  "usage": usage})
            yield _sse(None, "[DONE]")

        return StreamingResponse(gen(), media_type="text/event-stream")

    # ------------------------------------------------------------------ Anthropic

    async def _count(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "count_tokens")
        return err or JSONResponse({"input_tokens": 100})

    async def _messages(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "anthropic")
        if err:
            return err
        r = await asyncio.to_thread(self._reply, req, entry)
        if r.status != 200:
            return JSONResponse({"type": "error", "error": {"type": "api_error", "message": "injected"}}, r.status)
        blocks: list[dict[str, Any]] = []
        if r.text:
            blocks.append({"type": "text", "text": r.text})
        for n, a in r.tool_calls:
            blocks.append({"type": "tool_use", "id": _id("toolu_fake_"), "name": n,
                           "input": a if isinstance(a, dict) else json.loads(a)})
        stop = "tool_use" if r.tool_calls else "end_turn"
        usage = {"input_tokens": r.input_tokens or 100, "output_tokens": 10, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        mid = _id("msg_fake_")
        model = req.body.get("model") or self.model
        if not req.body.get("stream"):
            return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
                                 "stop_reason": stop, "stop_sequence": None, "usage": usage})

        async def gen():
            yield _sse("message_start", {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 1}}})
            for i, b in enumerate(blocks):
                if b["type"] == "text":
                    yield _sse("content_block_start", {"type": "content_block_start", "index": i,
                                                       "content_block": {"type": "text", "text": ""}})
                    yield _sse("content_block_delta", {"type": "content_block_delta", "index": i,
                                                       "delta": {"type": "text_delta", "text": b["text"]}})
                else:
                    yield _sse("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                        "type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}})
                    yield _sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(b["input"])}})
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": i})
            yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                         "usage": {"output_tokens": 10}})
            yield _sse("message_stop", {"type": "message_stop"})

        return StreamingResponse(gen(), media_type="text/event-stream")

    # ------------------------------------------------------------------ Responses

    async def _responses(self, request: Request) -> Response:
        req, entry, err = await self._read(request, "responses")
        if err:
            return err
        r = await asyncio.to_thread(self._reply, req, entry)
        if r.status != 200:
            return JSONResponse({"error": {"message": "injected", "type": "server_error"}}, r.status)
        items: list[dict[str, Any]] = []
        if r.text:
            items.append({"type": "message", "id": _id("msg_"), "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": r.text, "annotations": []}]})
        for n, a in r.tool_calls:
            items.append({"type": "function_call", "id": _id("fc_"), "call_id": _id("call_"), "name": n,
                          "arguments": _args_text(a), "status": "completed"})
        rid = _id("resp_")
        usage = {"input_tokens": r.input_tokens or 100, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": (r.input_tokens or 100) + 10}
        base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": self.model,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        done = {**base, "status": "completed", "output": items, "usage": usage}
        if not req.body.get("stream"):
            return JSONResponse(done)

        async def gen():
            seq = 0

            def ev(kind: str, **data: Any) -> bytes:
                nonlocal seq
                seq += 1
                return _sse(kind, {"type": kind, "sequence_number": seq, **data})

            yield ev("response.created", response={**base, "status": "in_progress", "output": []})
            for i, it in enumerate(items):
                yield ev("response.output_item.added", output_index=i, item=it)
                if it["type"] == "message":
                    yield ev("response.output_text.delta", item_id=it["id"], output_index=i, content_index=0,
                             delta=it["content"][0]["text"])
                yield ev("response.output_item.done", output_index=i, item=it)
            yield ev("response.completed", response=done)

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "gyre"}]})

    async def _other(self, request: Request) -> Response:
        await self._read(request, "unknown")
        return JSONResponse({"error": {"message": "not found"}}, 404)
