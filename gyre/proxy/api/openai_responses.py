"""OpenAI Responses (``POST /v1/responses``): request normalisation and response shapes.

Requests (https://platform.openai.com/docs/api-reference/responses/create) become a
:class:`~gyre.proxy.messages.ChatRequest` (:func:`normalize_responses`): ``instructions`` is
the first ``system`` message, a string ``input`` one user message. Consecutive
``reasoning``/assistant ``message``/``function_call``/``custom_tool_call`` items form one
assistant turn; a new turn starts when an item comes that the model's format would have emitted
earlier (reasoning after text or calls, text after calls). Namespaced functions are named
``"<namespace>.<name>"``; a custom tool call carries its input as a JSON string literal. Items
the model format has no slot for (``web_search_call``, ``item_reference``, ...) are skipped.
``previous_response_id`` is refused: the proxy keeps no conversation state.

:class:`ResponsesBuilder` follows the streaming reference
(https://platform.openai.com/docs/api-reference/responses-streaming).
"""

from __future__ import annotations

import json
from typing import Any

from gyre.proxy.api.common import (
    ResponseBuilder,
    Sse,
    array,
    arguments_text,
    content_text,
    dump_arguments,
    function_tool,
    model_name,
    obj,
    sampling_options,
    stream_flag,
    string,
)
from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER, ChatRequest, Message, ToolCall
from gyre.proxy.parse import OutputEvent

__all__ = ["normalize_responses", "responses_output_message", "reply_message", "ResponsesBuilder"]

#: Emission order of assistant items within one turn (calls may repeat).
_ASSISTANT_ITEM_ORDER = {"reasoning": 0, "message": 1, "function_call": 2, "custom_tool_call": 2}


# ----------------------------------------------------------------------------- requests
def _summary_text(parts: Any, where: str) -> str:
    texts = []
    for j, p in enumerate(array(parts, where)):
        p = obj(p, f"{where}[{j}]")
        texts.append(string(p.get("text", ""), f"{where}[{j}].text"))
    return "\n\n".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's ``content`` texts if any, else its ``summary`` texts."""
    content = item.get("content")
    if isinstance(content, list) and content:
        return _summary_text(content, f"{where}.content")
    summary = item.get("summary")
    return "" if summary is None else _summary_text(summary, f"{where}.summary")


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
        return Message(ROLE_ASSISTANT, "".join(self.texts), reasoning, tuple(self.calls), item_ids=tuple(self.ids))


def _call(item: dict[str, Any], where: str) -> ToolCall:
    cid = item.get("call_id") or item.get("id") or ""
    if not isinstance(cid, str):
        raise ProxyError(400, f"{where}.call_id must be a string")
    name = string(item.get("name"), f"{where}.name")
    ns = item.get("namespace")
    if ns is not None:
        name = f"{string(ns, f'{where}.namespace')}.{name}"
    iid = item.get("id")
    iid = iid if isinstance(iid, str) else None
    if item.get("type") == "custom_tool_call":
        inp = string(item.get("input", ""), f"{where}.input")
        return ToolCall(cid, name, dump_arguments(inp), "custom", iid)
    return ToolCall(cid, name, arguments_text(item.get("arguments"), f"{where}.arguments"), "function", iid)


def _items(items: list[Any], where: str, messages: list[Message]) -> None:
    """Append the messages of Responses ``items`` to ``messages``."""
    group: _AssistantGroup | None = None

    def flush() -> None:
        nonlocal group
        if group is not None:
            messages.append(group.message())
            group = None

    for i, it in enumerate(items):
        w = f"{where}[{i}]"
        it = obj(it, w)
        t = it.get("type")
        role = it.get("role")
        if t is None and role is not None:
            t = "message"  # EasyInputMessage
        if t == "message" and role == "assistant":
            order = 1
        elif t in ("reasoning", "function_call", "custom_tool_call"):
            order = _ASSISTANT_ITEM_ORDER[t]
        else:
            order = -1
        if order >= 0:
            if group is not None and (order < group.last or (order == group.last and order < 2)):
                flush()
            if group is None:
                group = _AssistantGroup()
            group.last = order
            iid = it.get("id")
            if t == "reasoning":
                group.reasoning.append(_reasoning_text(it, w))
            elif t == "message":
                group.texts.append(content_text(it.get("content"), f"{w}.content"))
            else:
                group.calls.append(_call(it, w))
            if t in ("reasoning", "message") and isinstance(iid, str):
                group.ids.append(iid)
            continue
        flush()
        if t == "message":
            text = content_text(it.get("content"), f"{w}.content")
            if role in ("system", "developer"):
                messages.append(Message(ROLE_SYSTEM, text))
            elif role == "user":
                messages.append(Message(ROLE_USER, text))
            else:
                raise ProxyError(400, f"{w}.role must be user, assistant, system or developer", param="role")
        elif t in ("function_call_output", "custom_tool_call_output"):
            cid = string(it.get("call_id", ""), f"{w}.call_id")
            out = it.get("output", "")
            text = out if isinstance(out, str) else content_text(out, f"{w}.output")
            messages.append(Message(ROLE_TOOL, text, tool_call_id=cid))
        elif not isinstance(t, str):
            raise ProxyError(400, f"{w}.type must be a string")
    flush()


def responses_output_message(output: Any, where: str = "output") -> Message:
    """The assistant :class:`Message` of a Responses ``output`` item list (one turn)."""
    msgs: list[Message] = []
    _items(array(output, where), where, msgs)
    asst = [m for m in msgs if m.role == ROLE_ASSISTANT]
    if len(asst) == 1:
        return asst[0]
    reasoning = [m.reasoning for m in asst if m.reasoning]
    return Message(
        ROLE_ASSISTANT,
        "".join(m.content for m in asst),
        "\n\n".join(reasoning) if reasoning else None,
        tuple(c for m in asst for c in m.tool_calls),
        item_ids=tuple(i for m in asst for i in m.item_ids),
    )


def _tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, tuple[str, str]]]:
    if tools is None:
        return [], {}, {}
    out: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}
    namespaces: dict[str, tuple[str, str]] = {}

    def function(t: dict[str, Any], where: str, ns: str | None) -> None:
        name = string(t.get("name"), f"{where}.name")
        qual = f"{ns}.{name}" if ns else name
        out.append(function_tool(qual, t, where))
        kinds[qual] = "function"
        if ns:
            namespaces[qual] = (ns, name)

    for i, t in enumerate(array(tools, "tools")):
        w = f"tools[{i}]"
        t = obj(t, w)
        ttype = t.get("type")
        if ttype == "function":
            function(t, w, None)
        elif ttype == "namespace":
            ns = string(t.get("name"), f"{w}.name")
            for j, sub in enumerate(array(t.get("tools", []), f"{w}.tools")):
                sub = obj(sub, f"{w}.tools[{j}]")
                if sub.get("type", "function") == "function":
                    function(sub, f"{w}.tools[{j}]", ns)
        elif ttype == "custom":
            name = string(t.get("name"), f"{w}.name")
            fn = {"name": name, "parameters": {"type": "string", "description": "free-form input"}}
            if t.get("description") is not None:
                fn["description"] = string(t["description"], f"{w}.description")
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
        ProxyError: 400 for a malformed body, or for ``previous_response_id``.
    """
    body = obj(body, "body")
    if body.get("previous_response_id") is not None:
        raise ProxyError(400, "previous_response_id is not supported (send the full input)",
                         param="previous_response_id")
    messages: list[Message] = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append(Message(ROLE_SYSTEM, string(instructions, "instructions")))
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append(Message(ROLE_USER, inp))
    else:
        _items(array(inp, "input"), "input", messages)
    tools, kinds, namespaces = _tools(body.get("tools"))
    sampling = sampling_options(body, "max_output_tokens", top_k=True, extended=True)
    stream = stream_flag(body)
    include = body.get("include")
    if include is not None:
        include = [string(x, "include[]") for x in array(include, "include")]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        obj(reasoning, "reasoning")
    return ChatRequest(
        api="responses",
        messages=messages,
        tools=tools,
        tool_kinds=kinds,
        namespaces=namespaces,
        sampling=sampling,
        stream=stream,
        model=model_name(body),
        extra={"include": include or [], "reasoning": reasoning, "tool_choice": body.get("tool_choice")},
    )


def reply_message(reply: dict[str, Any]) -> Message:
    """The assistant :class:`Message` of a complete ``response`` object."""
    return responses_output_message(reply.get("output") or [])


# ----------------------------------------------------------------------------- responses
class ResponsesBuilder(ResponseBuilder):
    """OpenAI Responses shapes (``response`` object and streaming events):
    ``response.created``, ``response.output_item.added/done``,
    ``response.reasoning_summary_text.delta``, ``response.output_text.delta``,
    ``response.function_call_arguments.delta/done``, ``response.custom_tool_call_input.delta/done``,
    then ``response.completed`` or ``response.incomplete``; every event carries a
    ``sequence_number``."""

    api = "responses"

    def __init__(self, request: ChatRequest, input_tokens: int, ids=None) -> None:
        super().__init__(request, input_tokens, ids)
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None
        self._seq = 0

    def _ev(self, etype: str, **data: Any) -> Sse:
        d = {"type": etype, "sequence_number": self._seq}
        d.update(data)
        self._seq += 1
        return (etype, d)

    def _status(self) -> str:
        return "incomplete" if self.outcome() == "length" else "completed"

    def _response(self, status: str) -> dict[str, Any]:
        r: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.request.model, "output": self.items if status != "in_progress" else [],
            "parallel_tool_calls": True, "tool_choice": self.request.extra.get("tool_choice") or "auto",
            "tools": [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": None,
        }
        if status != "in_progress":
            r["usage"] = {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": self.output_tokens,
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": self.input_tokens + self.output_tokens}
        return r

    def _start_events(self) -> list[Sse]:
        return [self._ev("response.created", response=self._response("in_progress")),
                self._ev("response.in_progress", response=self._response("in_progress"))]

    def _close(self, out: list[Sse]) -> None:
        if self._open is None:
            return
        idx = len(self.items) - 1
        item = self.items[idx]
        if self._open == "reasoning":
            text = item["summary"][0]["text"]
            out.append(self._ev("response.reasoning_summary_text.done", item_id=item["id"], output_index=idx,
                                summary_index=0, text=text))
            out.append(self._ev("response.reasoning_summary_part.done", item_id=item["id"], output_index=idx,
                                summary_index=0, part={"type": "summary_text", "text": text}))
        else:
            text = item["content"][0]["text"]
            out.append(self._ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                                text=text, logprobs=[]))
            out.append(self._ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                                part=item["content"][0]))
            item["status"] = "completed"
        out.append(self._ev("response.output_item.done", output_index=idx, item=item))
        self._open = None

    def _open_item(self, out: list[Sse], kind: str) -> int:
        """Close the open item and open a new ``kind`` item (``reasoning``/``message``)."""
        self._close(out)
        iid = self.ids.item_id(kind, len(self.items))
        self.item_ids.append(iid)
        idx = len(self.items)
        if kind == "reasoning":
            item: dict[str, Any] = {"type": "reasoning", "id": iid, "summary": []}
            if "reasoning.encrypted_content" in (self.request.extra.get("include") or []):
                item["encrypted_content"] = "gyre:" + iid
            self.items.append(item)
            out.append(self._ev("response.output_item.added", output_index=idx, item={**item, "summary": []}))
            item["summary"] = [{"type": "summary_text", "text": ""}]
            out.append(self._ev("response.reasoning_summary_part.added", item_id=iid, output_index=idx,
                                summary_index=0, part={"type": "summary_text", "text": ""}))
        else:
            item = {"type": "message", "id": iid, "status": "in_progress", "role": "assistant", "content": []}
            self.items.append(item)
            out.append(self._ev("response.output_item.added", output_index=idx, item=dict(item, content=[])))
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"] = [part]
            out.append(self._ev("response.content_part.added", item_id=iid, output_index=idx, content_index=0,
                                part=dict(part)))
        self._open = kind
        return idx

    def on_event(self, ev: OutputEvent) -> list[Sse]:
        out: list[Sse] = []
        if ev.kind in ("reasoning", "text"):
            kind = "reasoning" if ev.kind == "reasoning" else "message"
            (self.reasoning if kind == "reasoning" else self.text).append(ev.text)
            idx = self._open_item(out, kind) if self._open != kind else len(self.items) - 1
            item = self.items[idx]
            if kind == "reasoning":
                item["summary"][0]["text"] += ev.text
                out.append(self._ev("response.reasoning_summary_text.delta", item_id=item["id"], output_index=idx,
                                    summary_index=0, delta=ev.text))
            else:
                item["content"][0]["text"] += ev.text
                out.append(self._ev("response.output_text.delta", item_id=item["id"], output_index=idx,
                                    content_index=0, delta=ev.text, logprobs=[]))
            return out
        assert ev.tool_call is not None
        self._close(out)
        raw = ev.tool_call
        custom = raw.kind == "custom"
        iid = self.ids.item_id("custom_tool_call" if custom else "function_call", len(self.items))
        tc = ToolCall(self.ids.tool_call_id(self.api, len(self.calls)), raw.name, raw.arguments, raw.kind, iid)
        self.calls.append(tc)
        idx = len(self.items)
        if custom:
            inp = json.loads(raw.arguments)
            item = {"type": "custom_tool_call", "id": iid, "call_id": tc.id, "name": raw.name, "input": inp,
                    "status": "completed"}
            out.append(self._ev("response.output_item.added", output_index=idx,
                                item=dict(item, input="", status="in_progress")))
            out.append(self._ev("response.custom_tool_call_input.delta", item_id=iid, output_index=idx, delta=inp))
            out.append(self._ev("response.custom_tool_call_input.done", item_id=iid, output_index=idx, input=inp))
        else:
            ns = self.request.namespaces.get(raw.name)
            item = {"type": "function_call", "id": iid, "call_id": tc.id, "name": ns[1] if ns else raw.name,
                    "arguments": raw.arguments, "status": "completed"}
            if ns:
                item["namespace"] = ns[0]
            out.append(self._ev("response.output_item.added", output_index=idx,
                                item=dict(item, arguments="", status="in_progress")))
            out.append(self._ev("response.function_call_arguments.delta", item_id=iid, output_index=idx,
                                delta=raw.arguments))
            out.append(self._ev("response.function_call_arguments.done", item_id=iid, output_index=idx,
                                arguments=raw.arguments))
        self.items.append(item)
        out.append(self._ev("response.output_item.done", output_index=idx, item=item))
        return out

    def _finish_events(self) -> list[Sse]:
        out: list[Sse] = []
        self._close(out)
        status = self._status()
        out.append(self._ev(f"response.{status}", response=self._response(status)))
        return out

    def body(self) -> dict[str, Any]:
        r = self._response(self._status())
        r["output_text"] = "".join(self.text)
        return r

    def error_event(self, err: ProxyError) -> Sse:
        resp = {"id": self.id, "object": "response", "status": "failed",
                "error": {"code": "server_error", "message": err.message}}
        return ("response.failed", json.dumps({"type": "response.failed", "response": resp}))
