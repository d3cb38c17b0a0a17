"""Hostile request bodies for rank 0's proxy and what each must earn (sent and judged by
``gyre/testing/hostile_exchange.py``): shared by ``tests/proxy/test_hostile_bodies.py``
(hypothesis draws the parameters) and ``bench/chaos_hostile.py`` (a seeded ``random.Random`` draws them).

A :class:`Case` is one request: its API (``anthropic``, ``chat``, ``responses``, or ``count_tokens``
for Anthropic's ``/v1/messages/count_tokens``), the bytes, extra headers, how they are sent
(``whole`` with a true ``Content-Length``; ``chunked`` without one; ``declared_held``: a
``Content-Length`` above what is sent, the connection then kept open; ``declared_closed``: the same,
then the write side shut) and what the proxy promises for it (``expect``):

* ``"200"``: a whole answer; ``"400"`` / ``"413"``: that status; ``"4xx"``: any client error;
  ``"any"``: a whole answer or a client error; ``"4xx_or_closed"``: a client error or the
  connection closed without an answer.

Every request also has the promises :func:`gyre.testing.hostile_exchange.problems` checks: never a 5xx, an
answer within the time bound, an error in the API's own shape, a 200 stream that ends with the
API's closing event and no error event, and exactly one delivered record in the execution for an
answered model call (none for an error, none for ``count_tokens``).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from functools import lru_cache
from typing import Any

PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses",
         "count_tokens": "/v1/messages/count_tokens"}
MODEL_APIS = ("anthropic", "chat", "responses")
END_MARK = {"anthropic": b"message_stop", "chat": b"[DONE]", "responses": b"response.completed"}
#: a placeholder string replaced in the serialised body by a literal JSON cannot build from Python
HOLE = "@@HOSTILE@@"

# numbers no engine request can carry: non-finite, or integers beyond 64 bits (JSON literals)
BAD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", str(2 ** 64), str(-(2 ** 63) - 1), "1" + "0" * 30,
               "1" + "0" * 5000]
NUMERIC_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "seed", "min_tokens"]
LONE_SURROGATES = ["a\ud800b", "\udfff", "\udc00\ud800", "tail\ud83d"]
#: string fields whose text the proxy forwards to the engine or echoes (a lone surrogate there: 400)
ECHOED_FIELDS = ["content", "system", "tool_name", "stop", "tool_args", "model", "tool_result"]
MANY_KINDS = ["messages", "tools", "tool_results", "content_parts"]
COMPRESSION_VARIANTS = ["bomb", "under", "truncated", "mislabelled"]
BOMB_FACTORS = [1.05, 4, 256]
ENCODINGS = ["gzip", "deflate", "raw-deflate"]
DEPTHS = [5, 60, 129, 200, 1100, 100_000]
DEPTH_PLACES = ["schema", "tool_args", "content_part"]
RETRY_PHASES = ["in_flight", "after_finished", "after_drop"]
RETRY_KINDS = ["valid", "valid", "surrogate_stop", "surrogate_content", "big_seed"]


def size_amounts(cap: int) -> dict[str, list[int]]:
    """The byte amounts :func:`size_case` is tried with, by variant."""
    return {"declared_held": [1, 4096, 3 * cap, 64 << 20], "declared_closed": [1024, cap // 2],
            "over": [1, 100, 4096, cap], "chunked_over": [1, 4096, cap], "under": [0, 1, 4096],
            "chunked_under": [0, 1, 4096]}


def many_counts(kind: str, limits: dict[str, int]) -> list[int]:
    """Counts :func:`many_case` is tried with: just under, just over and three times the limit."""
    lim = limits.get(f"max_{kind}", 2000)
    return [lim - 2, lim + 1, 3 * lim]


class Case:
    """One hostile request (module docstring). Not a dataclass, so that hypothesis prints it by its
    ``repr``: the class, what it is, and how it is sent, without the bytes."""

    def __init__(self, api: str, raw: bytes, expect: str, cls: str, what: str, headers: dict[str, str] | None = None,
                 send: str = "whole", declared: int | None = None, stream: bool = False) -> None:
        self.api, self.raw, self.expect, self.cls, self.what = api, raw, expect, cls, what
        self.headers = headers or {}
        self.send, self.declared, self.stream = send, declared, stream

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return (f"Case({self.cls}: {self.what}; api={self.api} stream={self.stream} send={self.send} "
                f"bytes={len(self.raw)} declared={self.declared} headers={self.headers} expect={self.expect})")


# ------------------------------------------------------------------------------ valid bodies
def valid(api: str, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    """A small valid body with a tool, a tool call and its result, so that every field exists."""
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    if api in ("anthropic", "count_tokens"):
        b = {"model": "m", "system": "S", "tools": [{"name": "f", "description": "d", "input_schema": schema}],
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                          {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                              "input": {"x": "1"}}]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]}
        if api == "count_tokens":
            return b
        return dict(b, max_tokens=max_tokens, stop_sequences=["zz"], stream=stream)
    if api == "chat":
        return {"model": "m", "max_tokens": max_tokens, "stop": ["zz"], "stream": stream,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": "t1", "type": "function",
                                  "function": {"name": "f", "arguments": '{"x": "1"}'}}]},
                             {"role": "tool", "tool_call_id": "t1", "content": "r"}]}
    return {"model": "m", "max_output_tokens": max_tokens, "stream": stream, "instructions": "S",
            "tools": [{"type": "function", "name": "f", "parameters": schema}],
            "input": [{"type": "message", "role": "user", "content": "hi"},
                      {"type": "function_call", "call_id": "t1", "name": "f", "arguments": '{"x": "1"}'},
                      {"type": "function_call_output", "call_id": "t1", "output": "r"}]}


def put(body: dict[str, Any], api: str, place: str, value: Any) -> dict[str, Any]:
    """``body`` (from :func:`valid`) with ``value`` at ``place``, one of :data:`ECHOED_FIELDS`, ``schema``,
    ``content_part`` or a sampling field. ``tool_args`` holds ``{"x": value}``: as an object in
    Anthropic's ``input``, as JSON text in the OpenAI APIs' ``arguments``."""
    anth = api in ("anthropic", "count_tokens")
    if place == "content":
        if anth:
            body["messages"][0]["content"][0]["text"] = value
        elif api == "chat":
            body["messages"][1]["content"] = value
        else:
            body["input"][0]["content"] = value
    elif place == "content_part":
        part = [value] if not anth else [{"type": "text", "text": "p", "x": value}]
        if anth:
            body["messages"][0]["content"] = part + body["messages"][0]["content"]
        elif api == "chat":
            body["messages"][1]["content"] = [{"type": "text", "text": "p"}, value]
        else:
            body["input"][0]["content"] = [{"type": "input_text", "text": "p"}, value]
    elif place == "system":
        if anth:
            body["system"] = value
        elif api == "chat":
            body["messages"][0]["content"] = value
        else:
            body["instructions"] = value
    elif place == "tool_name":
        if anth:
            body["tools"][0]["name"] = value
        elif api == "chat":
            body["tools"][0]["function"]["name"] = value
        else:
            body["tools"][0]["name"] = value
    elif place == "schema":
        key = "input_schema" if anth else "parameters"
        tool = body["tools"][0]["function"] if api == "chat" else body["tools"][0]
        tool[key]["properties"]["x"] = value
    elif place == "stop":
        if api in ("chat", "anthropic"):
            body["stop" if api == "chat" else "stop_sequences"] = [value]
        else:  # Responses and count_tokens take no stop strings: the user's text instead
            return put(body, api, "content", value)
    elif place == "tool_args":
        if anth:
            body["messages"][1]["content"][0]["input"] = {"x": value}
        else:
            text = json.dumps({"x": value}, ensure_ascii=False)
            if api == "chat":
                body["messages"][2]["tool_calls"][0]["function"]["arguments"] = text
            else:
                body["input"][1]["arguments"] = text
    elif place == "tool_result":
        if anth:
            body["messages"][2]["content"][0]["content"] = value
        elif api == "chat":
            body["messages"][3]["content"] = value
        else:
            body["input"][2]["output"] = value
    elif place == "model":
        body["model"] = value
    else:  # a sampling field
        key = {"max_tokens": "max_output_tokens"}.get(place, place) if api == "responses" else place
        body[key] = value
    return body


def dumps(body: Any, hole: str | None = None) -> bytes:
    """``body`` as JSON (non-ASCII as ``\\u`` escapes, so a lone surrogate is sent as its escape), with
    the :data:`HOLE` string replaced by the literal ``hole``, also where it sits inside a JSON text
    held in a string (tool-call ``arguments``)."""
    raw = json.dumps(body).encode()
    if hole is not None:
        raw = raw.replace(f'"{HOLE}"'.encode(), hole.encode())
        raw = raw.replace(f'\\"{HOLE}\\"'.encode(), hole.replace('"', '\\"').encode())
    return raw


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings ignored)."""
    depth = best = 0
    for m in re.finditer(rb'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', raw):
        t = m.group()
        if t in (b"[", b"{"):
            depth += 1
            best = max(best, depth)
        elif t in (b"]", b"}"):
            depth -= 1
    return best


def padded(raw: bytes, total: int) -> bytes:
    """JSON ``raw`` (an object) grown to ``total`` bytes with whitespace before its closing brace."""
    return raw[:-1] + b" " * max(0, total - len(raw)) + b"}"


# ------------------------------------------------------------------------------ the classes
@lru_cache(maxsize=32)
def _encoded(api: str, stream: bool, total: int, enc: str) -> bytes:
    raw = padded(dumps(valid(api, stream)), total)
    if enc == "gzip":
        return gzip.compress(raw, 9)
    if enc == "deflate":
        return zlib.compress(raw, 9)
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)  # raw deflate, no zlib header
    return c.compress(raw) + c.flush()


def compression_case(api: str, stream: bool, variant: str, factor: float, enc: str, cap: int) -> Case:
    """``bomb``: a valid body inflating to ``factor`` x ``cap`` (413); ``under``: inflating to just under
    the cap (200); ``truncated``: the first half of a bomb (4xx); ``mislabelled``: plain JSON sent as
    ``enc``, or ``enc`` data sent as another encoding (4xx)."""
    wire = "deflate" if enc == "raw-deflate" else enc
    if variant == "bomb":
        data = _encoded(api, stream, int(cap * factor), enc)
        return Case(api, data, "413", "compression", f"{enc} bomb inflating to {factor}x the cap",
                    {"content-encoding": wire}, stream=stream)
    if variant == "under":
        data = _encoded(api, stream, cap - 4096, enc)
        return Case(api, data, "200", "compression", f"{enc} inflating to the cap - 4096", {"content-encoding": wire},
                    stream=stream)
    if variant == "truncated":
        data = _encoded(api, stream, int(cap * factor), enc)
        return Case(api, data[:len(data) // 2], "4xx", "compression", f"first half of a {enc} bomb",
                    {"content-encoding": wire}, stream=stream)
    data = _encoded(api, stream, 2048, enc)
    other = {"gzip": "deflate", "deflate": "gzip", "raw-deflate": "gzip"}[enc]
    if factor > 1:
        return Case(api, data, "4xx", "compression", f"{enc} data labelled {other}", {"content-encoding": other},
                    stream=stream)
    return Case(api, dumps(valid(api, stream)), "4xx", "compression", f"plain JSON labelled {wire}",
                {"content-encoding": wire}, stream=stream)


def size_case(api: str, stream: bool, variant: str, amount: int, cap: int) -> Case:
    """Body sizes against the cap: ``over`` / ``under`` sent whole (``cap`` + / - ``amount``),
    ``chunked_over`` / ``chunked_under`` without a Content-Length, ``declared_held``: a Content-Length
    of cap + ``amount`` with 1 KiB sent and the connection held open (413 at once, from the header),
    ``declared_closed``: a Content-Length under the cap, half of it sent, then the write side shut."""
    base = dumps(valid(api, stream))
    if variant in ("over", "chunked_over"):
        return Case(api, padded(base, cap + amount), "413", "sizes", f"{variant} by {amount} bytes",
                    send="chunked" if variant.startswith("chunked") else "whole", stream=stream)
    if variant in ("under", "chunked_under"):
        return Case(api, padded(base, cap - amount), "200", "sizes", f"{variant} by {amount} bytes",
                    send="chunked" if variant.startswith("chunked") else "whole", stream=stream)
    if variant == "declared_held":
        return Case(api, padded(base, 1024), "413", "sizes", f"declares cap + {amount} bytes, sends 1 KiB and waits",
                    send="declared_held", declared=cap + amount, stream=stream)
    body = padded(base, min(cap - 1, max(len(base) + 2, amount)))
    return Case(api, body[:len(body) // 2], "4xx_or_closed", "sizes", "declares its length, sends half, shuts writing",
                send="declared_closed", declared=len(body), stream=stream)


def depth_case(api: str, stream: bool, place: str, depth: int, obj: bool, limit: int) -> Case:
    """Arrays (or objects) nested ``depth`` deep at ``place`` (``schema``, ``tool_args``,
    ``content_part``); 400 when the body's nesting exceeds ``limit`` (any 4xx for a body of 128 KiB
    or more), else a whole answer or a
    client error. Deep JSON *text* inside tool-call ``arguments`` (a string) is not nesting of the body:
    any non-5xx answer."""
    inner = ('{"a":' * depth + "1" + "}" * depth) if obj else ("[" * depth + "1" + "]" * depth)
    raw = dumps(put(valid(api, stream), api, place, HOLE), inner)
    d = json_depth(raw)
    # a body this deep can also be over a small body cap, which may refuse it first (413)
    expect = ("400" if len(raw) < 128 << 10 else "4xx") if d > limit else "any"
    return Case(api, raw, expect, "depth", f"{'objects' if obj else 'arrays'} {depth} deep in {place} (body depth {d})",
                stream=stream)


def number_case(api: str, stream: bool, place: str, literal: str) -> Case:
    """A non-finite or beyond-64-bit number ``literal`` in a sampling field (400) or in tool arguments
    (a whole answer or a client error)."""
    raw = dumps(put(valid(api, stream), api, place, HOLE), literal)
    expect = "400" if place in NUMERIC_FIELDS else "any"
    return Case(api, raw, expect, "numbers", f"{literal[:24]} in {place}", stream=stream)


def surrogate_case(api: str, stream: bool, place: str, text: str) -> Case:
    """A string with a lone surrogate (sent as its ``\\u`` escape) at ``place``: 400 where the proxy
    forwards or echoes the text (:data:`ECHOED_FIELDS`)."""
    raw = dumps(put(valid(api, stream), api, place, text))
    return Case(api, raw, "400" if place in ECHOED_FIELDS else "any", "unencodable",
                f"{text.encode('unicode_escape').decode()} in {place}", stream=stream)


def many_case(api: str, stream: bool, kind: str, n: int, limits: dict[str, int]) -> Case:
    """``n`` tiny messages / tool definitions / tool results (one turn) / content parts (one message):
    400 above the configured limit, a whole answer at or under it; content parts have no limit
    (a whole answer or a client error)."""
    b = valid(api, stream)
    anth = api in ("anthropic", "count_tokens")
    if kind == "messages":  # alternating, ending with a user turn; n in all
        roles = ["user", "assistant"]
        msgs = [{"role": roles[i % 2], "content": f"m{i}"} for i in range(n - 1)] + [{"role": "user", "content": "e"}]
        if api == "responses":
            b["input"] = [dict(m, type="message") for m in msgs]
        else:
            b["messages"] = msgs
        limit = limits["max_messages"]
    elif kind == "tools":
        tools = [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(n)] if anth else (
            [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)] if api == "chat"
            else [{"type": "function", "name": f"f{i}"} for i in range(n)])
        b["tools"] = tools
        limit = limits["max_tools"]
    elif kind == "tool_results":
        ids = [f"t{i}" for i in range(n)]
        if anth:
            b["messages"][1]["content"] = [{"type": "tool_use", "id": t, "name": "f", "input": {}} for t in ids]
            b["messages"][2]["content"] = [{"type": "tool_result", "tool_use_id": t, "content": "r"} for t in ids]
        elif api == "chat":
            b["messages"][2]["tool_calls"] = [
                {"id": t, "type": "function", "function": {"name": "f", "arguments": "{}"}} for t in ids]
            b["messages"][3:] = [{"role": "tool", "tool_call_id": t, "content": "r"} for t in ids]
        else:
            b["input"][1:] = ([{"type": "function_call", "call_id": t, "name": "f", "arguments": "{}"} for t in ids]
                              + [{"type": "function_call_output", "call_id": t, "output": "r"} for t in ids])
        limit = limits["max_tool_results"]
    else:
        parts = [{"type": "text", "text": "p"} for _ in range(n)]
        if anth:
            b["messages"][0]["content"] = parts
        elif api == "chat":
            b["messages"][1]["content"] = parts
        else:
            b["input"][0]["content"] = [{"type": "input_text", "text": "p"} for _ in range(n)]
        limit = None
    expect = "any" if limit is None else ("400" if n > limit else "200")
    return Case(api, dumps(b), expect, "many", f"{n} {kind} (limit {limit})", stream=stream)


def retry_case(api: str, stream: bool, kind: str, max_tokens: int = 8) -> Case:
    """A body for a retried logical call (:data:`RETRY_KINDS`): valid (asking for ``max_tokens``,
    ``ignore_eos`` set), or with a lone surrogate in a stop string or the content, or a seed beyond
    64 bits."""
    if kind == "valid":
        body = put(valid(api, stream, max_tokens), api, "ignore_eos", True)
        return Case(api, dumps(body), "200", "retries", "valid body", stream=stream)
    if kind == "big_seed":
        return number_case(api, stream, "seed", str(2 ** 64))
    return surrogate_case(api, stream, kind.split("_")[1], "a\ud800")
