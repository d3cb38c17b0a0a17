"""Response shapes of the three APIs: complete bodies and SSE event sequences.

Sources (upstream references):

* Anthropic Messages streaming: https://docs.anthropic.com/en/docs/build-with-claude/streaming
  (``message_start``, ``content_block_start``/``_delta``/``_stop`` with ``thinking_delta``,
  ``signature_delta``, ``text_delta``, ``input_json_delta``; ``message_delta`` with
  ``stop_reason`` and ``usage``; ``message_stop``).
* OpenAI Chat Completions: https://platform.openai.com/docs/api-reference/chat/object and
  ``chat.completion.chunk`` (``delta.content``, ``delta.tool_calls[index]``, final
  ``finish_reason``, optional usage chunk, ``data: [DONE]``); reasoning as
  ``reasoning_content`` (the vLLM/SGLang convention).
* OpenAI Responses streaming: https://platform.openai.com/docs/api-reference/responses-streaming
  (``response.created`` ... ``response.output_item.added/done``,
  ``response.reasoning_summary_text.delta``, ``response.output_text.delta``,
  ``response.function_call_arguments.delta/done``, ``response.custom_tool_call_input.delta/done``,
  ``response.completed``/``response.incomplete``, each with ``sequence_number``).

A :class:`ResponseBuilder` consumes the parser's :class:`~gyre.proxy.parse.OutputEvent` deltas
and produces SSE events as they come; :meth:`ResponseBuilder.body` gives the equivalent
non-streaming body, and :meth:`ResponseBuilder.output_message` the output as the harness will
echo it (ids assigned), for the restoration cache. Ids come from an :class:`IdFactory` (random by
default; ``tools/replay_trace.py`` injects the recorded ones).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from gyre.proxy.messages import ROLE_ASSISTANT, ChatRequest, Message, ToolCall
from gyre.proxy.parse import OutputEvent

__all__ = ["IdFactory", "ResponseBuilder", "AnthropicBuilder", "ChatBuilder", "ResponsesBuilder", "make_builder", "Sse"]

#: One SSE event: ``(event name or None, JSON-serialisable data or the raw string "[DONE]")``.
Sse = tuple[str | None, Any]


class IdFactory:
    """Ids the proxy hands out (override for deterministic replays)."""

    def _hex(self) -> str:
        return uuid.uuid4().hex[:24]

    def message_id(self, api: str) -> str:
        """Anthropic ``msg_...``, Chat ``chatcmpl-...``, Responses ``resp_...``."""
        return {"anthropic": "msg_gyre_", "chat": "chatcmpl-gyre", "responses": "resp_gyre_"}[api] + self._hex()

    def tool_call_id(self, api: str, index: int) -> str:
        """Anthropic ``toolu_...``, OpenAI ``call_...``."""
        return ("toolu_gyre_" if api == "anthropic" else "call_gyre_") + self._hex()

    def item_id(self, kind: str, index: int) -> str:
        """Responses item ids: ``rs_`` (reasoning), ``msg_`` (message), ``fc_``, ``ctc_``."""
        prefix = {"reasoning": "rs_gyre_", "message": "msg_gyre_", "function_call": "fc_gyre_",
                  "custom_tool_call": "ctc_gyre_"}[kind]
        return prefix + self._hex()

    def signature(self) -> str:
        """Anthropic thinking-block signature (opaque to clients)."""
        return "gyre_sig_" + self._hex()


class ResponseBuilder:
    """Base class; see the module docstring.

    Args:
        request: the normalised request (model name, tool kinds, namespaces, options).
        input_tokens: prompt length (tokens) for ``usage``.
        ids: id source.
    """

    api = ""

    def __init__(self, request: ChatRequest, input_tokens: int, ids: IdFactory | None = None) -> None:
        self.request = request
        self.ids = ids or IdFactory()
        self.input_tokens = int(input_tokens)
        self.output_tokens = 0
        self.created = int(time.time())
        self.id = self.ids.message_id(self.api)
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.calls: list[ToolCall] = []
        self.item_ids: list[str] = []
        self.finish_reason = "stop"
        self.started = False

    def start(self) -> list[Sse]:
        """Events sent before any output (``message_start`` / ``response.created``)."""
        self.started = True
        return []

    def on_event(self, ev: OutputEvent) -> list[Sse]:
        """SSE events for one parser delta."""
        raise NotImplementedError

    def finish(self, finish_reason: str, output_tokens: int) -> list[Sse]:
        """Closing events; records the finish reason and usage."""
        raise NotImplementedError

    def body(self) -> dict[str, Any]:
        """The complete non-streaming response body."""
        raise NotImplementedError

    def output_message(self) -> Message:
        """The output as the harness will echo it (ids assigned)."""
        return Message(
            ROLE_ASSISTANT,
            "".join(self.text),
            "".join(self.reasoning) if self.reasoning else None,
            tuple(self.calls),
            item_ids=tuple(self.item_ids),
        )

    def _call_with_id(self, tc: ToolCall) -> ToolCall:
        k = len(self.calls)
        return ToolCall(self.ids.tool_call_id(self.api, k), tc.name, tc.arguments, tc.kind)


# ----------------------------------------------------------------------------- Anthropic
class AnthropicBuilder(ResponseBuilder):
    """Anthropic Messages shapes."""

    api = "anthropic"

    def __init__(self, request: ChatRequest, input_tokens: int, ids: IdFactory | None = None) -> None:
        super().__init__(request, input_tokens, ids)
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None
        self._sig: str | None = None

    def start(self) -> list[Sse]:
        self.started = True
        msg = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.request.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": msg})]

    def _close(self, out: list[Sse]) -> None:
        if self._open is None:
            return
        idx = len(self.blocks) - 1
        if self._open == "thinking":
            sig = self._sig or self.ids.signature()
            self.blocks[idx]["signature"] = sig
            self.item_ids.append(sig)
            out.append(("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                "delta": {"type": "signature_delta", "signature": sig}}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": idx}))
        self._open = None

    def on_event(self, ev: OutputEvent) -> list[Sse]:
        out: list[Sse] = []
        if ev.kind in ("reasoning", "text"):
            btype = "thinking" if ev.kind == "reasoning" else "text"
            (self.reasoning if ev.kind == "reasoning" else self.text).append(ev.text)
            if self._open != btype:
                self._close(out)
                block = {"type": "thinking", "thinking": "", "signature": ""} if btype == "thinking" else {"type": "text", "text": ""}
                self.blocks.append(dict(block))
                self._open = btype
                out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                    "content_block": block}))
            idx = len(self.blocks) - 1
            field = "thinking" if btype == "thinking" else "text"
            self.blocks[idx][field] += ev.text
            delta = {"type": "thinking_delta", "thinking": ev.text} if btype == "thinking" else {"type": "text_delta", "text": ev.text}
            out.append(("content_block_delta", {"type": "content_block_delta", "index": idx, "delta": delta}))
            return out
        assert ev.tool_call is not None
        self._close(out)
        tc = self._call_with_id(ev.tool_call)
        self.calls.append(tc)
        idx = len(self.blocks)
        self.blocks.append({"type": "tool_use", "id": tc.id, "name": tc.name, "input": json.loads(tc.arguments)})
        out.append(("content_block_start", {"type": "content_block_start", "index": idx,
                                            "content_block": {"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}}}))
        out.append(("content_block_delta", {"type": "content_block_delta", "index": idx,
                                            "delta": {"type": "input_json_delta", "partial_json": tc.arguments}}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": idx}))
        return out

    def _stop_reason(self) -> str:
        if self.calls:
            return "tool_use"
        return {"length": "max_tokens"}.get(self.finish_reason, "end_turn")

    def finish(self, finish_reason: str, output_tokens: int) -> list[Sse]:
        out: list[Sse] = []
        self._close(out)
        self.finish_reason = finish_reason
        self.output_tokens = int(output_tokens)
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": self._stop_reason(), "stop_sequence": None},
                                      "usage": {"output_tokens": self.output_tokens}}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.request.model,
            "content": self.blocks, "stop_reason": self._stop_reason(), "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }


# ----------------------------------------------------------------------------- Chat Completions
class ChatBuilder(ResponseBuilder):
    """OpenAI Chat Completions shapes (``chat.completion`` / ``chat.completion.chunk``)."""

    api = "chat"

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> Sse:
        return (None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.request.model,
                       "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    def start(self) -> list[Sse]:
        self.started = True
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
        return [self._chunk({"tool_calls": [{"index": k, "id": tc.id, "type": "function",
                                             "function": {"name": tc.name, "arguments": tc.arguments}}]})]

    def _finish_reason(self) -> str:
        if self.calls:
            return "tool_calls"
        return "length" if self.finish_reason == "length" else "stop"

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.input_tokens, "completion_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens}

    def finish(self, finish_reason: str, output_tokens: int) -> list[Sse]:
        self.finish_reason = finish_reason
        self.output_tokens = int(output_tokens)
        out = [self._chunk({}, self._finish_reason())]
        if self.request.include_usage:
            out.append((None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.request.model, "choices": [], "usage": self._usage()}))
        out.append((None, "[DONE]"))
        return out

    def body(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) if (self.text or not self.calls) else None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [{"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                                 for tc in self.calls]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.request.model,
                "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": self._finish_reason()}],
                "usage": self._usage()}


# ----------------------------------------------------------------------------- Responses
class ResponsesBuilder(ResponseBuilder):
    """OpenAI Responses shapes (``response`` object and streaming events)."""

    api = "responses"

    def __init__(self, request: ChatRequest, input_tokens: int, ids: IdFactory | None = None) -> None:
        super().__init__(request, input_tokens, ids)
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None
        self._seq = 0

    def _ev(self, etype: str, **data: Any) -> Sse:
        d = {"type": etype, "sequence_number": self._seq}
        d.update(data)
        self._seq += 1
        return (etype, d)

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

    def start(self) -> list[Sse]:
        self.started = True
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

    def on_event(self, ev: OutputEvent) -> list[Sse]:
        out: list[Sse] = []
        if ev.kind == "reasoning":
            self.reasoning.append(ev.text)
            if self._open != "reasoning":
                self._close(out)
                rid = self.ids.item_id("reasoning", len(self.items))
                self.item_ids.append(rid)
                item: dict[str, Any] = {"type": "reasoning", "id": rid, "summary": []}
                if "reasoning.encrypted_content" in (self.request.extra.get("include") or []):
                    item["encrypted_content"] = "gyre:" + rid
                self.items.append(item)
                self._open = "reasoning"
                idx = len(self.items) - 1
                out.append(self._ev("response.output_item.added", output_index=idx,
                                    item={**item, "summary": []}))
                item["summary"] = [{"type": "summary_text", "text": ""}]
                out.append(self._ev("response.reasoning_summary_part.added", item_id=rid, output_index=idx,
                                    summary_index=0, part={"type": "summary_text", "text": ""}))
            idx = len(self.items) - 1
            self.items[idx]["summary"][0]["text"] += ev.text
            out.append(self._ev("response.reasoning_summary_text.delta", item_id=self.items[idx]["id"],
                                output_index=idx, summary_index=0, delta=ev.text))
            return out
        if ev.kind == "text":
            self.text.append(ev.text)
            if self._open != "message":
                self._close(out)
                mid = self.ids.item_id("message", len(self.items))
                self.item_ids.append(mid)
                item = {"type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []}
                self.items.append(item)
                self._open = "message"
                idx = len(self.items) - 1
                out.append(self._ev("response.output_item.added", output_index=idx, item=dict(item, content=[])))
                part = {"type": "output_text", "text": "", "annotations": []}
                item["content"] = [part]
                out.append(self._ev("response.content_part.added", item_id=mid, output_index=idx, content_index=0,
                                    part=dict(part)))
            idx = len(self.items) - 1
            self.items[idx]["content"][0]["text"] += ev.text
            out.append(self._ev("response.output_text.delta", item_id=self.items[idx]["id"], output_index=idx,
                                content_index=0, delta=ev.text, logprobs=[]))
            return out
        assert ev.tool_call is not None
        self._close(out)
        raw = ev.tool_call
        k = len(self.calls)
        custom = raw.kind == "custom"
        iid = self.ids.item_id("custom_tool_call" if custom else "function_call", len(self.items))
        tc = ToolCall(self.ids.tool_call_id(self.api, k), raw.name, raw.arguments, raw.kind, iid)
        self.calls.append(tc)
        ns = self.request.namespaces.get(raw.name)
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

    def finish(self, finish_reason: str, output_tokens: int) -> list[Sse]:
        out: list[Sse] = []
        self._close(out)
        self.finish_reason = finish_reason
        self.output_tokens = int(output_tokens)
        status = "incomplete" if finish_reason == "length" and not self.calls else "completed"
        out.append(self._ev(f"response.{status}", response=self._response(status)))
        return out

    def body(self) -> dict[str, Any]:
        status = "incomplete" if self.finish_reason == "length" and not self.calls else "completed"
        r = self._response(status)
        r["output_text"] = "".join(self.text)
        return r


_BUILDERS = {"anthropic": AnthropicBuilder, "chat": ChatBuilder, "responses": ResponsesBuilder}


def make_builder(request: ChatRequest, input_tokens: int, ids: IdFactory | None = None) -> ResponseBuilder:
    """The builder of ``request.api``."""
    return _BUILDERS[request.api](request, input_tokens, ids)
