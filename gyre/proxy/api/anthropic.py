"""Anthropic Messages (``POST /v1/messages``): request normalisation and response shapes.

Requests (https://docs.anthropic.com/en/api/messages) become a
:class:`~gyre.proxy.messages.ChatRequest` (:func:`normalize_anthropic`):

* ``system`` is the first ``system`` message; blocks matching :data:`VOLATILE_SYSTEM_PATTERNS`
  (Claude Code's billing-header block, which changes between calls of one session) are dropped;
* a user turn's ``tool_result`` blocks become ``tool`` messages in the order sent; text sharing
  the turn becomes separate ``user`` messages, order kept;
* an assistant turn is one message: ``thinking`` -> reasoning (``signature`` kept as an item
  id), ``text`` -> content, ``tool_use`` -> a tool call (``input`` dumped with
  ``ensure_ascii=False``); ``redacted_thinking`` is dropped.

:class:`AnthropicBuilder` follows the streaming reference
(https://docs.anthropic.com/en/docs/build-with-claude/streaming).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gyre.proxy.api.common import (
    ResponseBuilder,
    Sse,
    array,
    dump_arguments,
    function_tool,
    model_name,
    obj,
    placeholder,
    sampling_options,
    stream_flag,
    string,
)
from gyre.proxy.errors import ProxyError, error_body
from gyre.proxy.messages import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER, ChatRequest, Message, ToolCall
from gyre.proxy.parse import OutputEvent

__all__ = [
    "VOLATILE_SYSTEM_PATTERNS", "normalize_anthropic", "anthropic_assistant_message", "reply_message",
    "AnthropicBuilder",
]

#: System text blocks that change between calls without changing meaning; dropped.
VOLATILE_SYSTEM_PATTERNS: tuple[re.Pattern[str], ...] = (re.compile(r"^\s*x-anthropic-billing-header:"),)


# ----------------------------------------------------------------------------- requests
def _text_blocks(content: Any, where: str, *, volatile: bool = False) -> str:
    """Text of a string or a list of content blocks (text and non-text placeholders)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for i, b in enumerate(array(content, where)):
        if isinstance(b, str):  # lenient: bare strings in a block list
            parts.append(b)
            continue
        b = obj(b, f"{where}[{i}]")
        t = b.get("type", "text")
        if t == "text":
            text = string(b.get("text", ""), f"{where}[{i}].text")
            if volatile and any(p.match(text) for p in VOLATILE_SYSTEM_PATTERNS):
                continue
            parts.append(text)
        elif isinstance(t, str):
            parts.append(placeholder(t))
        else:
            raise ProxyError(400, f"{where}[{i}].type must be a string")
    return "".join(parts)


def anthropic_assistant_message(content: Any, where: str = "content") -> Message:
    """An Anthropic assistant ``content`` (string or blocks) as one assistant :class:`Message`."""
    if isinstance(content, str) or content is None:
        return Message(ROLE_ASSISTANT, content or "")
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    ids: list[str] = []
    for i, b in enumerate(array(content, where)):
        w = f"{where}[{i}]"
        b = obj(b, w)
        t = b.get("type")
        if t == "text":
            texts.append(string(b.get("text", ""), f"{w}.text"))
        elif t == "thinking":
            thinking.append(string(b.get("thinking", ""), f"{w}.thinking"))
            sig = b.get("signature")
            if isinstance(sig, str) and sig:
                ids.append(sig)
        elif t in ("tool_use", "server_tool_use"):
            cid = string(b.get("id", ""), f"{w}.id")
            name = string(b.get("name", ""), f"{w}.name")
            inp = b.get("input", {})
            args = inp if isinstance(inp, str) else dump_arguments(obj(inp, f"{w}.input"))  # lenient: JSON text
            calls.append(ToolCall(cid, name, args))
        elif t == "redacted_thinking":
            continue
        elif isinstance(t, str):
            texts.append(placeholder(t))
        else:
            raise ProxyError(400, f"{w}.type must be a string")
    reasoning = "\n".join(thinking) if thinking else None
    return Message(ROLE_ASSISTANT, "".join(texts), reasoning, tuple(calls), item_ids=tuple(ids))


def _user_messages(content: Any, where: str) -> list[Message]:
    if content is None or isinstance(content, str):
        return [Message(ROLE_USER, content or "")]
    out: list[Message] = []
    pending: list[str] | None = None  # text of the user message being collected

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            out.append(Message(ROLE_USER, "".join(pending)))
            pending = None

    for i, b in enumerate(array(content, where)):
        if isinstance(b, str):
            text = b
        else:
            b = obj(b, f"{where}[{i}]")
            t = b.get("type")
            if t == "tool_result":
                flush()
                cid = string(b.get("tool_use_id", ""), f"{where}[{i}].tool_use_id")
                result = _text_blocks(b.get("content"), f"{where}[{i}].content")
                out.append(Message(ROLE_TOOL, result, tool_call_id=cid, is_error=b.get("is_error") is True))
                continue
            if t == "text":
                text = string(b.get("text", ""), f"{where}[{i}].text")
            elif isinstance(t, str):
                text = placeholder(t)
            else:
                raise ProxyError(400, f"{where}[{i}].type must be a string")
        if pending is None:
            pending = []
        pending.append(text)
    if pending is None and not out:
        pending = []
    flush()
    return out


def _tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    if tools is None:
        return [], {}
    out: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}
    for i, t in enumerate(array(tools, "tools")):
        t = obj(t, f"tools[{i}]")
        name = string(t.get("name"), f"tools[{i}].name")
        ttype = t.get("type")
        if ttype in (None, "custom") or "input_schema" in t:
            out.append(function_tool(name, t, f"tools[{i}]", parameters_key="input_schema",
                                     default_parameters={"type": "object", "properties": {}}))
        else:  # server tools (web_search_2025..., bash_2025..., ...): passed by type and name
            out.append({"type": string(ttype, f"tools[{i}].type"), "name": name})
        kinds[name] = "function"
    return out, kinds


def normalize_anthropic(body: Any) -> ChatRequest:
    """Normalise an Anthropic ``POST /v1/messages`` body (see the module docstring).

    Raises:
        ProxyError: 400 for a malformed body.
    """
    body = obj(body, "body")
    msgs_raw = array(body.get("messages"), "messages")
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        messages.append(Message(ROLE_SYSTEM, _text_blocks(system, "system", volatile=True)))
    for i, m in enumerate(msgs_raw):
        m = obj(m, f"messages[{i}]")
        role = m.get("role")
        content = m.get("content")
        where = f"messages[{i}].content"
        if role == "user":
            messages.extend(_user_messages(content, where))
        elif role == "assistant":
            messages.append(anthropic_assistant_message(content, where))
        elif role == "system":
            messages.append(Message(ROLE_SYSTEM, _text_blocks(content, where, volatile=True)))
        else:
            raise ProxyError(400, f"messages[{i}].role must be 'user', 'assistant' or 'system'", param="role")
    tools, kinds = _tools(body.get("tools"))
    sampling = sampling_options(body, "max_tokens", top_k=True, stop_key="stop_sequences", extended=True)
    stream = stream_flag(body)
    model = model_name(body)
    md = body.get("metadata")
    if md is not None:
        obj(md, "metadata")
    return ChatRequest(
        api="anthropic",
        messages=messages,
        tools=tools,
        tool_kinds=kinds,
        sampling=sampling,
        stream=stream,
        model=model,
        extra={"tool_choice": body.get("tool_choice"), "thinking": body.get("thinking")},
    )


def reply_message(reply: dict[str, Any]) -> Message:
    """The assistant :class:`Message` of a complete Anthropic response object."""
    return anthropic_assistant_message(reply.get("content") or [])


# ----------------------------------------------------------------------------- responses
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


class AnthropicBuilder(ResponseBuilder):
    """Anthropic Messages shapes (``message`` object and streaming events):
    ``message_start``, content blocks with ``thinking_delta``/``signature_delta``/``text_delta``/
    ``input_json_delta``, ``message_delta`` with ``stop_reason`` and usage, ``message_stop``."""

    api = "anthropic"

    def __init__(self, request: ChatRequest, input_tokens: int, ids=None) -> None:
        super().__init__(request, input_tokens, ids)
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.request.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }

    def _start_events(self) -> list[Sse]:
        return [("message_start", {"type": "message_start", "message": self._message([], None)})]

    def _close(self, out: list[Sse]) -> None:
        if self._open is None:
            return
        idx = len(self.blocks) - 1
        if self._open == "thinking":
            sig = self.ids.signature()
            self.blocks[idx]["signature"] = sig
            self.item_ids.append(sig)
            out.append(("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                "delta": {"type": "signature_delta", "signature": sig}}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": idx}))
        self._open = None

    def on_event(self, ev: OutputEvent) -> list[Sse]:
        out: list[Sse] = []
        if ev.kind in ("reasoning", "text"):
            thinking = ev.kind == "reasoning"
            btype, field = ("thinking", "thinking") if thinking else ("text", "text")
            (self.reasoning if thinking else self.text).append(ev.text)
            if self._open != btype:
                self._close(out)
                block = ({"type": "thinking", "thinking": "", "signature": ""} if thinking
                         else {"type": "text", "text": ""})
                self.blocks.append(dict(block))
                self._open = btype
                out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                    "content_block": block}))
            idx = len(self.blocks) - 1
            self.blocks[idx][field] += ev.text
            delta = {"type": f"{btype}_delta", field: ev.text}
            out.append(("content_block_delta", {"type": "content_block_delta", "index": idx, "delta": delta}))
            return out
        assert ev.tool_call is not None
        self._close(out)
        tc = self._call_with_id(ev.tool_call)
        self.calls.append(tc)
        idx = len(self.blocks)
        self.blocks.append({"type": "tool_use", "id": tc.id, "name": tc.name, "input": json.loads(tc.arguments)})
        start = {"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}}
        out.append(("content_block_start", {"type": "content_block_start", "index": idx, "content_block": start}))
        out.append(("content_block_delta", {"type": "content_block_delta", "index": idx,
                                            "delta": {"type": "input_json_delta", "partial_json": tc.arguments}}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": idx}))
        return out

    def _finish_events(self) -> list[Sse]:
        out: list[Sse] = []
        self._close(out)
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": _STOP_REASONS[self.outcome()], "stop_sequence": None},
                                      "usage": {"output_tokens": self.output_tokens}}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def body(self) -> dict[str, Any]:
        return self._message(self.blocks, _STOP_REASONS[self.outcome()])

    def error_event(self, err: ProxyError) -> Sse:
        return ("error", json.dumps(error_body("anthropic", err.status, err.message)))
