"""OpenAI Chat Completions (``POST /v1/chat/completions``): request normalisation and
response shapes.

Requests (https://platform.openai.com/docs/api-reference/chat/create) become a
:class:`~gyre.proxy.messages.ChatRequest`: ``developer`` messages are ``system`` messages;
``tool`` (and legacy ``function``) messages are tool results; an assistant message keeps its
``tool_calls[].function.arguments`` strings byte for byte, its ``reasoning_content`` (or
``reasoning``) as reasoning. Legacy ``functions`` declare tools when ``tools`` is absent.
``chat_template_kwargs`` pass through to the chat template, ``stream_options.include_usage``
adds a usage chunk; ``n`` other than 1 is refused.

Responses are ``chat.completion`` bodies or ``chat.completion.chunk`` streams
(https://platform.openai.com/docs/api-reference/chat/object): ``delta.content``,
``delta.reasoning_content`` (the vLLM/SGLang convention), ``delta.tool_calls[index]``, a final
``finish_reason``, the optional usage chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from gyre.proxy.api.common import (
    MAX_TOKENS_LIMIT,
    ResponseBuilder,
    Sse,
    array,
    arguments_text,
    content_text,
    function_tool,
    model_name,
    obj,
    opt_bool,
    opt_int,
    sampling_options,
    stream_flag,
    string,
)
from gyre.proxy.errors import ProxyError, error_body
from gyre.proxy.messages import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER, ChatRequest, Message, ToolCall
from gyre.proxy.parse import OutputEvent

__all__ = ["normalize_chat", "chat_assistant_message", "reply_message", "ChatBuilder"]


# ----------------------------------------------------------------------------- requests
def chat_assistant_message(m: dict[str, Any], where: str = "message") -> Message:
    """A Chat Completions assistant message (request history or ``choices[0].message``)."""
    m = obj(m, where)
    content = content_text(m.get("content"), f"{where}.content")
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise ProxyError(400, f"{where}.reasoning_content must be a string")
    calls: list[ToolCall] = []
    tcs = m.get("tool_calls")
    if tcs is not None:
        for j, tc in enumerate(array(tcs, f"{where}.tool_calls")):
            w = f"{where}.tool_calls[{j}]"
            tc = obj(tc, w)
            fn = obj(tc.get("function"), f"{w}.function")
            name = string(fn.get("name"), f"{w}.function.name")
            args = arguments_text(fn.get("arguments"), f"{w}.function.arguments")
            cid = tc.get("id") or ""
            if not isinstance(cid, str):
                raise ProxyError(400, f"{w}.id must be a string")
            calls.append(ToolCall(cid, name, args))
    return Message(ROLE_ASSISTANT, content, reasoning or None, tuple(calls))


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    tools = body.get("tools")
    if tools is None and body.get("functions") is not None:  # legacy
        tools = [{"type": "function", "function": f} for f in array(body.get("functions"), "functions")]
    if tools is None:
        return [], {}
    out: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}
    for i, t in enumerate(array(tools, "tools")):
        t = obj(t, f"tools[{i}]")
        ttype = t.get("type", "function")
        if ttype == "function":
            fn = obj(t.get("function"), f"tools[{i}].function")
            name = string(fn.get("name"), f"tools[{i}].function.name")
            out.append(function_tool(name, fn, f"tools[{i}].function"))
            kinds[name] = "function"
        elif isinstance(ttype, str):
            out.append(t)
        else:
            raise ProxyError(400, f"tools[{i}].type must be a string")
    return out, kinds


def normalize_chat(body: Any) -> ChatRequest:
    """Normalise an OpenAI ``POST /v1/chat/completions`` body (see the module docstring).

    Raises:
        ProxyError: 400 for a malformed body or ``n != 1``.
    """
    body = obj(body, "body")
    messages: list[Message] = []
    for i, m in enumerate(array(body.get("messages"), "messages")):
        where = f"messages[{i}]"
        m = obj(m, where)
        role = m.get("role")
        if role in ("system", "developer"):
            messages.append(Message(ROLE_SYSTEM, content_text(m.get("content"), f"{where}.content")))
        elif role == "user":
            messages.append(Message(ROLE_USER, content_text(m.get("content"), f"{where}.content")))
        elif role == "assistant":
            messages.append(chat_assistant_message(m, where))
        elif role in ("tool", "function"):
            cid = m.get("tool_call_id", m.get("name", ""))
            if cid is not None and not isinstance(cid, str):
                raise ProxyError(400, f"{where}.tool_call_id must be a string")
            messages.append(Message(ROLE_TOOL, content_text(m.get("content"), f"{where}.content"), tool_call_id=cid))
        else:
            raise ProxyError(400, f"{where}.role must be system, developer, user, assistant or tool", param="role")
    n = opt_int(body, "n", 1, 1 << 20)
    if n is not None and n != 1:
        raise ProxyError(400, "only n=1 is supported", param="n")
    tools, kinds = _tools(body)
    max_tokens = opt_int(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    sampling = sampling_options(body, "max_tokens", max_tokens=max_tokens, top_k=True, stop_key="stop", extended=True)
    stream = stream_flag(body)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        include_usage = bool(opt_bool(obj(so, "stream_options"), "include_usage", "stream_options"))
    tk = body.get("chat_template_kwargs")
    template_kwargs = dict(obj(tk, "chat_template_kwargs")) if tk is not None else {}
    return ChatRequest(
        api="chat",
        messages=messages,
        tools=tools,
        tool_kinds=kinds,
        sampling=sampling,
        template_kwargs=template_kwargs,
        stream=stream,
        include_usage=include_usage,
        model=model_name(body),
        extra={"tool_choice": body.get("tool_choice")},
    )


def reply_message(reply: dict[str, Any]) -> Message:
    """The assistant :class:`Message` of a complete ``chat.completion`` object."""
    return chat_assistant_message((reply.get("choices") or [{}])[0].get("message") or {})


# ----------------------------------------------------------------------------- responses
class ChatBuilder(ResponseBuilder):
    """OpenAI Chat Completions shapes (``chat.completion`` / ``chat.completion.chunk``)."""

    api = "chat"

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> Sse:
        return (None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.request.model,
                       "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    def _start_events(self) -> list[Sse]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def on_event(self, ev: OutputEvent) -> list[Sse]:
        if ev.kind == "reasoning":
            self.reasoning.append(ev.text)
            return [self._chunk({"reasoning_content": ev.text})]
        if ev.kind == "text":
            self.text.append(ev.text)
            return [self._chunk({"content": ev.text})]
        assert ev.tool_call is not None
        tc = self._call_with_id(ev.tool_call)
        k = len(self.calls)
        self.calls.append(tc)
        return [self._chunk({"tool_calls": [{"index": k, **tc.openai_dict()}]})]

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.input_tokens, "completion_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens}

    def _finish_events(self) -> list[Sse]:
        out = [self._chunk({}, self.outcome())]
        if self.request.include_usage:
            out.append((None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.request.model, "choices": [], "usage": self._usage()}))
        out.append((None, "[DONE]"))
        return out

    def body(self) -> dict[str, Any]:
        content = "".join(self.text) if (self.text or not self.calls) else None
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [tc.openai_dict() for tc in self.calls]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.request.model,
                "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": self.outcome()}],
                "usage": self._usage()}

    def error_event(self, err: ProxyError) -> Sse:
        return (None, json.dumps(error_body("chat", err.status, err.message)))
