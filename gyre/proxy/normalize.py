"""Normalisation of Anthropic Messages, OpenAI Chat Completions and OpenAI Responses requests
into one :class:`~gyre.proxy.messages.ChatRequest` (pure functions, no state).

Sources: DESIGN.md §3.1; the issue's "Rendering and TITO" rules; ``shared/traces/README.md``
(what Claude Code, Codex CLI and mini-swe-agent send); upstream API references
(https://docs.anthropic.com/en/api/messages,
https://platform.openai.com/docs/api-reference/chat/create,
https://platform.openai.com/docs/api-reference/responses/create).

Rules applied to every API:

* ``cache_control`` and other transport-only keys are dropped; a string and a list of text
  blocks with the same text are equal (multi-part text is concatenated without a separator,
  like the chat template's ``text_of``); non-text parts become ``[image]``/``[document]``.
* Volatile system blocks (Claude Code's ``x-anthropic-billing-header`` block, whose
  ``cc_version`` suffix changes between calls of one session) are dropped
  (:data:`VOLATILE_SYSTEM_PATTERNS`).
* ``developer`` messages are ``system`` messages. Anthropic ``role: "system"`` entries inside
  ``messages`` are kept in place.
* Tool results become ``tool`` messages in the order they were sent (Claude Code returns
  parallel results in completion order); text blocks sharing a user message with tool results
  become separate ``user`` messages, order preserved.
* Assistant turns become one assistant message: thinking/reasoning -> ``reasoning``, text ->
  ``content``, tool calls -> ``tool_calls`` with ``arguments`` as JSON text (Anthropic
  ``input`` dicts are dumped with ``json.dumps(..., ensure_ascii=False)``; Chat/Responses
  argument strings are kept byte for byte). Restoring the proxy's own earlier outputs happens
  later, in :mod:`gyre.proxy.tito`.
* Responses items are grouped: consecutive ``reasoning``/assistant ``message``/
  ``function_call``/``custom_tool_call`` items form one assistant turn (a new turn starts when
  an item comes that the model's format would have emitted earlier: reasoning after text or
  calls, text after calls). Namespaced functions are named ``"<namespace>.<name>"``; custom
  (free-form) tool calls carry their input as a JSON string literal.

Malformed bodies raise :class:`~gyre.proxy.errors.ProxyError` (400) naming the field; nothing
here raises anything else on any JSON value (fuzzed in ``tests/proxy/test_fuzz.py``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import (
    ROLE_ASSISTANT,
    ROLE_SYSTEM,
    ROLE_TOOL,
    ROLE_USER,
    ChatRequest,
    Message,
    SamplingOptions,
    ToolCall,
)

__all__ = [
    "normalize",
    "normalize_anthropic",
    "normalize_chat",
    "normalize_responses",
    "anthropic_assistant_message",
    "chat_assistant_message",
    "responses_output_message",
    "VOLATILE_SYSTEM_PATTERNS",
    "dump_arguments",
]

#: System text blocks that change between calls without changing meaning; dropped.
VOLATILE_SYSTEM_PATTERNS: tuple[re.Pattern[str], ...] = (re.compile(r"^\s*x-anthropic-billing-header:"),)

_MAX_TOKENS_LIMIT = 1 << 30


# ----------------------------------------------------------------------------- helpers
def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProxyError(400, f"{where} must be an object", param=where)
    return v


def _list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise ProxyError(400, f"{where} must be an array", param=where)
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise ProxyError(400, f"{where} must be a string", param=where)
    return v


def _opt_str(d: dict[str, Any], key: str, where: str) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    return _str(v, f"{where}.{key}")


def _opt_bool(d: dict[str, Any], key: str, where: str) -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise ProxyError(400, f"{where}.{key} must be a boolean", param=key)
    return v


def _opt_num(d: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise ProxyError(400, f"{key} must be a number in [{lo}, {hi}]", param=key)
    return float(v)


def _opt_int(d: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProxyError(400, f"{key} must be an integer in [{lo}, {hi}]", param=key)
    return int(v)


def _stops(v: Any, key: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    items = _list(v, key)
    out = []
    for i, s in enumerate(items):
        out.append(_str(s, f"{key}[{i}]"))
    return tuple(s for s in out if s)


def dump_arguments(value: Any) -> str:
    """JSON text of a tool-call argument value, as the chat template's ``tojson`` writes it."""
    return json.dumps(value, ensure_ascii=False)


def _placeholder(kind: str) -> str:
    return f"[{kind}]"


def _join(parts: list[str]) -> str:
    return "".join(parts)


# ----------------------------------------------------------------------------- Anthropic
def _anthropic_text_blocks(content: Any, where: str, *, volatile: bool = False) -> str:
    """Text of a string or a list of content blocks (text and non-text placeholders)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    blocks = _list(content, where)
    parts: list[str] = []
    for i, b in enumerate(blocks):
        if isinstance(b, str):  # lenient: bare strings in a block list
            parts.append(b)
            continue
        b = _obj(b, f"{where}[{i}]")
        t = b.get("type", "text")
        if t == "text":
            text = _str(b.get("text", ""), f"{where}[{i}].text")
            if volatile and any(p.match(text) for p in VOLATILE_SYSTEM_PATTERNS):
                continue
            parts.append(text)
        elif isinstance(t, str):
            parts.append(_placeholder(t))
        else:
            raise ProxyError(400, f"{where}[{i}].type must be a string")
    return _join(parts)


def anthropic_assistant_message(content: Any, where: str = "content") -> Message:
    """An Anthropic assistant ``content`` (string or blocks) as one assistant :class:`Message`."""
    if isinstance(content, str) or content is None:
        return Message(ROLE_ASSISTANT, content or "")
    blocks = _list(content, where)
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    ids: list[str] = []
    for i, b in enumerate(blocks):
        b = _obj(b, f"{where}[{i}]")
        t = b.get("type")
        if t == "text":
            texts.append(_str(b.get("text", ""), f"{where}[{i}].text"))
        elif t == "thinking":
            thinking.append(_str(b.get("thinking", ""), f"{where}[{i}].thinking"))
            sig = b.get("signature")
            if isinstance(sig, str) and sig:
                ids.append(sig)
        elif t in ("tool_use", "server_tool_use"):
            cid = _str(b.get("id", ""), f"{where}[{i}].id")
            name = _str(b.get("name", ""), f"{where}[{i}].name")
            inp = b.get("input", {})
            if isinstance(inp, str):  # lenient: a JSON string
                args = inp
            else:
                args = dump_arguments(_obj(inp, f"{where}[{i}].input"))
            calls.append(ToolCall(cid, name, args))
        elif t == "redacted_thinking":
            continue
        elif isinstance(t, str):
            texts.append(_placeholder(t))
        else:
            raise ProxyError(400, f"{where}[{i}].type must be a string")
    reasoning = "\n".join(thinking) if thinking else None
    return Message(ROLE_ASSISTANT, _join(texts), reasoning, tuple(calls), item_ids=tuple(ids))


def _anthropic_user_messages(content: Any, where: str) -> list[Message]:
    if content is None or isinstance(content, str):
        return [Message(ROLE_USER, content or "")]
    blocks = _list(content, where)
    out: list[Message] = []
    pending: list[str] = []
    has_pending = False
    for i, b in enumerate(blocks):
        if isinstance(b, str):
            pending.append(b)
            has_pending = True
            continue
        b = _obj(b, f"{where}[{i}]")
        t = b.get("type")
        if t == "tool_result":
            if has_pending:
                out.append(Message(ROLE_USER, _join(pending)))
                pending, has_pending = [], False
            cid = _str(b.get("tool_use_id", ""), f"{where}[{i}].tool_use_id")
            text = _anthropic_text_blocks(b.get("content"), f"{where}[{i}].content")
            is_err = b.get("is_error")
            out.append(Message(ROLE_TOOL, text, tool_call_id=cid, is_error=bool(is_err is True)))
        elif t == "text":
            pending.append(_str(b.get("text", ""), f"{where}[{i}].text"))
            has_pending = True
        elif isinstance(t, str):
            pending.append(_placeholder(t))
            has_pending = True
        else:
            raise ProxyError(400, f"{where}[{i}].type must be a string")
    if has_pending or not out:
        out.append(Message(ROLE_USER, _join(pending)))
    return out


def _anthropic_tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    if tools is None:
        return [], {}
    out: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}
    for i, t in enumerate(_list(tools, "tools")):
        t = _obj(t, f"tools[{i}]")
        name = _str(t.get("name"), f"tools[{i}].name")
        ttype = t.get("type")
        if ttype in (None, "custom") or "input_schema" in t:
            fn: dict[str, Any] = {"name": name}
            desc = t.get("description")
            if desc is not None:
                fn["description"] = _str(desc, f"tools[{i}].description")
            schema = t.get("input_schema", {"type": "object", "properties": {}})
            fn["parameters"] = _obj(schema, f"tools[{i}].input_schema")
            out.append({"type": "function", "function": fn})
        else:  # server tools (web_search_2025..., bash_2025..., ...): passed by type and name
            out.append({"type": _str(ttype, f"tools[{i}].type"), "name": name})
        kinds[name] = "function"
    return out, kinds


def normalize_anthropic(body: Any) -> ChatRequest:
    """Normalise an Anthropic ``POST /v1/messages`` body (see the module docstring).

    Raises:
        ProxyError: 400 for a malformed body.
    """
    body = _obj(body, "body")
    msgs_raw = _list(body.get("messages"), "messages")
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        text = _anthropic_text_blocks(system, "system", volatile=True)
        messages.append(Message(ROLE_SYSTEM, text))
    for i, m in enumerate(msgs_raw):
        m = _obj(m, f"messages[{i}]")
        role = m.get("role")
        content = m.get("content")
        if role == "user":
            messages.extend(_anthropic_user_messages(content, f"messages[{i}].content"))
        elif role == "assistant":
            messages.append(anthropic_assistant_message(content, f"messages[{i}].content"))
        elif role == "system":
            messages.append(
                Message(ROLE_SYSTEM, _anthropic_text_blocks(content, f"messages[{i}].content", volatile=True))
            )
        else:
            raise ProxyError(400, f"messages[{i}].role must be 'user', 'assistant' or 'system'", param="role")
    tools, kinds = _anthropic_tools(body.get("tools"))
    sampling = SamplingOptions(
        max_tokens=_opt_int(body, "max_tokens", 1, _MAX_TOKENS_LIMIT),
        temperature=_opt_num(body, "temperature", 0.0, 2.0),
        top_p=_opt_num(body, "top_p", 0.0, 1.0),
        top_k=_opt_int(body, "top_k", -1, 1 << 20),
        stop=_stops(body.get("stop_sequences"), "stop_sequences"),
    )
    stream = _opt_bool(body, "stream", "body") or False
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ProxyError(400, "model must be a string", param="model")
    md = body.get("metadata")
    if md is not None:
        _obj(md, "metadata")
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


# ----------------------------------------------------------------------------- Chat Completions
def _chat_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for i, p in enumerate(_list(content, where)):
        if isinstance(p, str):
            parts.append(p)
            continue
        p = _obj(p, f"{where}[{i}]")
        t = p.get("type", "text")
        if t in ("text", "input_text", "output_text"):
            parts.append(_str(p.get("text", ""), f"{where}[{i}].text"))
        elif t == "refusal":
            parts.append(_str(p.get("refusal", ""), f"{where}[{i}].refusal"))
        elif isinstance(t, str):
            parts.append(_placeholder("image" if "image" in t else t))
        else:
            raise ProxyError(400, f"{where}[{i}].type must be a string")
    return _join(parts)


def _arguments_text(v: Any, where: str) -> str:
    if v is None:
        return "{}"
    if isinstance(v, str):
        return v
    if isinstance(v, (dict, list)):
        return dump_arguments(v)
    raise ProxyError(400, f"{where} must be a string", param=where)


def chat_assistant_message(m: dict[str, Any], where: str = "message") -> Message:
    """A Chat Completions assistant message (request history or ``choices[0].message``)."""
    m = _obj(m, where)
    content = _chat_content(m.get("content"), f"{where}.content")
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise ProxyError(400, f"{where}.reasoning_content must be a string")
    calls: list[ToolCall] = []
    tcs = m.get("tool_calls")
    if tcs is not None:
        for j, tc in enumerate(_list(tcs, f"{where}.tool_calls")):
            tc = _obj(tc, f"{where}.tool_calls[{j}]")
            fn = _obj(tc.get("function"), f"{where}.tool_calls[{j}].function")
            name = _str(fn.get("name"), f"{where}.tool_calls[{j}].function.name")
            args = _arguments_text(fn.get("arguments"), f"{where}.tool_calls[{j}].function.arguments")
            cid = tc.get("id") or ""
            if not isinstance(cid, str):
                raise ProxyError(400, f"{where}.tool_calls[{j}].id must be a string")
            calls.append(ToolCall(cid, name, args))
    return Message(ROLE_ASSISTANT, content, reasoning or None, tuple(calls))


def _chat_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    tools = body.get("tools")
    if tools is None and body.get("functions") is not None:  # legacy
        tools = [{"type": "function", "function": f} for f in _list(body.get("functions"), "functions")]
    if tools is None:
        return [], {}
    out: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}
    for i, t in enumerate(_list(tools, "tools")):
        t = _obj(t, f"tools[{i}]")
        ttype = t.get("type", "function")
        if ttype == "function":
            fn_in = _obj(t.get("function"), f"tools[{i}].function")
            name = _str(fn_in.get("name"), f"tools[{i}].function.name")
            fn: dict[str, Any] = {"name": name}
            if fn_in.get("description") is not None:
                fn["description"] = _str(fn_in["description"], f"tools[{i}].function.description")
            if fn_in.get("parameters") is not None:
                fn["parameters"] = _obj(fn_in["parameters"], f"tools[{i}].function.parameters")
            out.append({"type": "function", "function": fn})
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
    body = _obj(body, "body")
    msgs_raw = _list(body.get("messages"), "messages")
    messages: list[Message] = []
    for i, m in enumerate(msgs_raw):
        m = _obj(m, f"messages[{i}]")
        role = m.get("role")
        where = f"messages[{i}]"
        if role in ("system", "developer"):
            messages.append(Message(ROLE_SYSTEM, _chat_content(m.get("content"), f"{where}.content")))
        elif role == "user":
            messages.append(Message(ROLE_USER, _chat_content(m.get("content"), f"{where}.content")))
        elif role == "assistant":
            messages.append(chat_assistant_message(m, where))
        elif role in ("tool", "function"):
            cid = m.get("tool_call_id", m.get("name", ""))
            if cid is not None and not isinstance(cid, str):
                raise ProxyError(400, f"{where}.tool_call_id must be a string")
            messages.append(Message(ROLE_TOOL, _chat_content(m.get("content"), f"{where}.content"), tool_call_id=cid))
        else:
            raise ProxyError(400, f"{where}.role must be system, developer, user, assistant or tool", param="role")
    n = _opt_int(body, "n", 1, 1 << 20)
    if n is not None and n != 1:
        raise ProxyError(400, "only n=1 is supported", param="n")
    tools, kinds = _chat_tools(body)
    mt = _opt_int(body, "max_completion_tokens", 1, _MAX_TOKENS_LIMIT)
    if mt is None:
        mt = _opt_int(body, "max_tokens", 1, _MAX_TOKENS_LIMIT)
    sampling = SamplingOptions(
        max_tokens=mt,
        temperature=_opt_num(body, "temperature", 0.0, 2.0),
        top_p=_opt_num(body, "top_p", 0.0, 1.0),
        top_k=_opt_int(body, "top_k", -1, 1 << 20),
        stop=_stops(body.get("stop"), "stop"),
        seed=_opt_int(body, "seed", -(1 << 63), (1 << 63) - 1),
        min_tokens=_opt_int(body, "min_tokens", 0, _MAX_TOKENS_LIMIT),
        ignore_eos=_opt_bool(body, "ignore_eos", "body"),
    )
    stream = _opt_bool(body, "stream", "body") or False
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        include_usage = bool(_opt_bool(_obj(so, "stream_options"), "include_usage", "stream_options"))
    tk = body.get("chat_template_kwargs")
    template_kwargs = dict(_obj(tk, "chat_template_kwargs")) if tk is not None else {}
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ProxyError(400, "model must be a string", param="model")
    return ChatRequest(
        api="chat",
        messages=messages,
        tools=tools,
        tool_kinds=kinds,
        sampling=sampling,
        template_kwargs=template_kwargs,
        stream=stream,
        include_usage=include_usage,
        model=model,
        extra={"tool_choice": body.get("tool_choice")},
    )


# ----------------------------------------------------------------------------- Responses
_ASSISTANT_ITEM_ORDER = {"reasoning": 0, "message": 1, "function_call": 2, "custom_tool_call": 2}


def _responses_content(content: Any, where: str) -> str:
    return _chat_content(content, where)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    content = item.get("content")
    if isinstance(content, list) and content:
        texts = []
        for j, p in enumerate(content):
            p = _obj(p, f"{where}.content[{j}]")
            texts.append(_str(p.get("text", ""), f"{where}.content[{j}].text"))
        return "\n\n".join(texts)
    summary = item.get("summary")
    if summary is None:
        return ""
    texts = []
    for j, p in enumerate(_list(summary, f"{where}.summary")):
        p = _obj(p, f"{where}.summary[{j}]")
        texts.append(_str(p.get("text", ""), f"{where}.summary[{j}].text"))
    return "\n\n".join(texts)


class _AssistantGroup:
    __slots__ = ("reasoning", "texts", "calls", "ids", "last")

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.texts: list[str] = []
        self.calls: list[ToolCall] = []
        self.ids: list[str] = []
        self.last = -1

    def message(self) -> Message:
        reasoning = "\n\n".join(self.reasoning) if self.reasoning else None
        return Message(ROLE_ASSISTANT, _join(self.texts), reasoning, tuple(self.calls), item_ids=tuple(self.ids))


def _responses_call(item: dict[str, Any], where: str) -> ToolCall:
    t = item.get("type")
    cid = item.get("call_id") or item.get("id") or ""
    if not isinstance(cid, str):
        raise ProxyError(400, f"{where}.call_id must be a string")
    name = _str(item.get("name"), f"{where}.name")
    ns = item.get("namespace")
    if ns is not None:
        name = f"{_str(ns, f'{where}.namespace')}.{name}"
    iid = item.get("id")
    iid = iid if isinstance(iid, str) else None
    if t == "custom_tool_call":
        inp = _str(item.get("input", ""), f"{where}.input")
        return ToolCall(cid, name, dump_arguments(inp), "custom", iid)
    return ToolCall(cid, name, _arguments_text(item.get("arguments"), f"{where}.arguments"), "function", iid)


def _responses_items(items: list[Any], where: str, messages: list[Message]) -> None:
    group: _AssistantGroup | None = None

    def flush() -> None:
        nonlocal group
        if group is not None:
            messages.append(group.message())
            group = None

    for i, it in enumerate(items):
        w = f"{where}[{i}]"
        it = _obj(it, w)
        t = it.get("type")
        role = it.get("role")
        if t is None and role is not None:
            t = "message"  # EasyInputMessage
        if t == "message" and role == "assistant":
            t_order = 1
        elif t in ("reasoning", "function_call", "custom_tool_call"):
            t_order = _ASSISTANT_ITEM_ORDER[t]
        else:
            t_order = -1
        if t_order >= 0:
            if group is not None and (t_order < group.last or (t_order == group.last and t_order < 2)):
                flush()
            if group is None:
                group = _AssistantGroup()
            group.last = t_order
            iid = it.get("id")
            if t == "reasoning":
                group.reasoning.append(_reasoning_text(it, w))
                if isinstance(iid, str):
                    group.ids.append(iid)
            elif t == "message":
                group.texts.append(_responses_content(it.get("content"), f"{w}.content"))
                if isinstance(iid, str):
                    group.ids.append(iid)
            else:
                group.calls.append(_responses_call(it, w))
            continue
        flush()
        if t == "message":
            text = _responses_content(it.get("content"), f"{w}.content")
            if role in ("system", "developer"):
                messages.append(Message(ROLE_SYSTEM, text))
            elif role == "user":
                messages.append(Message(ROLE_USER, text))
            else:
                raise ProxyError(400, f"{w}.role must be user, assistant, system or developer", param="role")
        elif t in ("function_call_output", "custom_tool_call_output"):
            cid = _str(it.get("call_id", ""), f"{w}.call_id")
            out = it.get("output", "")
            text = out if isinstance(out, str) else _responses_content(out, f"{w}.output")
            messages.append(Message(ROLE_TOOL, text, tool_call_id=cid))
        elif isinstance(t, str):
            # Items the model format has no slot for (web_search_call, item_reference, ...)
            continue
        else:
            raise ProxyError(400, f"{w}.type must be a string")
    flush()


def responses_output_message(output: Any, where: str = "output") -> Message:
    """The assistant :class:`Message` of a Responses ``output`` item list (one turn)."""
    msgs: list[Message] = []
    _responses_items(_list(output, where), where, msgs)
    asst = [m for m in msgs if m.role == ROLE_ASSISTANT]
    if len(asst) != 1:
        reasoning = [m.reasoning for m in asst if m.reasoning]
        return Message(
            ROLE_ASSISTANT,
            "".join(m.content for m in asst),
            "\n\n".join(reasoning) if reasoning else None,
            tuple(c for m in asst for c in m.tool_calls),
            item_ids=tuple(i for m in asst for i in m.item_ids),
        )
    return asst[0]


def _responses_tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, tuple[str, str]]]:
    if tools is None:
        return [], {}, {}
    out: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}
    namespaces: dict[str, tuple[str, str]] = {}

    def function(t: dict[str, Any], where: str, ns: str | None) -> None:
        name = _str(t.get("name"), f"{where}.name")
        qual = f"{ns}.{name}" if ns else name
        fn: dict[str, Any] = {"name": qual}
        if t.get("description") is not None:
            fn["description"] = _str(t["description"], f"{where}.description")
        if t.get("parameters") is not None:
            fn["parameters"] = _obj(t["parameters"], f"{where}.parameters")
        out.append({"type": "function", "function": fn})
        kinds[qual] = "function"
        if ns:
            namespaces[qual] = (ns, name)

    for i, t in enumerate(_list(tools, "tools")):
        w = f"tools[{i}]"
        t = _obj(t, w)
        ttype = t.get("type")
        if ttype == "function":
            function(t, w, None)
        elif ttype == "namespace":
            ns = _str(t.get("name"), f"{w}.name")
            for j, sub in enumerate(_list(t.get("tools", []), f"{w}.tools")):
                sub = _obj(sub, f"{w}.tools[{j}]")
                if sub.get("type", "function") == "function":
                    function(sub, f"{w}.tools[{j}]", ns)
        elif ttype == "custom":
            name = _str(t.get("name"), f"{w}.name")
            fn = {"name": name, "parameters": {"type": "string", "description": "free-form input"}}
            if t.get("description") is not None:
                fn["description"] = _str(t["description"], f"{w}.description")
            fmt = t.get("format")
            if fmt is not None:
                fn["format"] = fmt
            out.append({"type": "function", "function": fn})
            kinds[name] = "custom"
        elif isinstance(ttype, str):
            out.append({"type": ttype})
        else:
            raise ProxyError(400, f"{w}.type must be a string")
    return out, kinds, namespaces


def normalize_responses(body: Any) -> ChatRequest:
    """Normalise an OpenAI ``POST /v1/responses`` body (see the module docstring).

    Raises:
        ProxyError: 400 for a malformed body, or for ``previous_response_id`` (the proxy keeps
            no server-side conversation state; harnesses send ``store: false``).
    """
    body = _obj(body, "body")
    if body.get("previous_response_id") is not None:
        raise ProxyError(400, "previous_response_id is not supported (send the full input)", param="previous_response_id")
    messages: list[Message] = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append(Message(ROLE_SYSTEM, _str(instructions, "instructions")))
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append(Message(ROLE_USER, inp))
    else:
        _responses_items(_list(inp, "input"), "input", messages)
    tools, kinds, namespaces = _responses_tools(body.get("tools"))
    sampling = SamplingOptions(
        max_tokens=_opt_int(body, "max_output_tokens", 1, _MAX_TOKENS_LIMIT),
        temperature=_opt_num(body, "temperature", 0.0, 2.0),
        top_p=_opt_num(body, "top_p", 0.0, 1.0),
    )
    stream = _opt_bool(body, "stream", "body") or False
    include = body.get("include")
    if include is not None:
        include = [_str(x, "include[]") for x in _list(include, "include")]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        _obj(reasoning, "reasoning")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ProxyError(400, "model must be a string", param="model")
    return ChatRequest(
        api="responses",
        messages=messages,
        tools=tools,
        tool_kinds=kinds,
        namespaces=namespaces,
        sampling=sampling,
        stream=stream,
        model=model,
        extra={"include": include or [], "reasoning": reasoning, "tool_choice": body.get("tool_choice")},
    )


_NORMALIZERS: dict[str, Callable[[Any], ChatRequest]] = {
    "anthropic": normalize_anthropic,
    "chat": normalize_chat,
    "responses": normalize_responses,
}


def normalize(api: str, body: Any) -> ChatRequest:
    """Dispatch to the normaliser of ``api`` (``anthropic`` | ``chat`` | ``responses``).

    Raises:
        ProxyError: 400 for a malformed body.
        KeyError: unknown ``api``.
    """
    return _NORMALIZERS[api](body)
