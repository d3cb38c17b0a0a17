"""Reading a model-call request body under limits that hold before anything costs memory or time.

A harness's request is written largely by the policy under training, so rank 0 treats every
body as hostile until it has passed these checks, in this order:

1. :func:`read_body` -- the declared ``Content-Length`` and then the bytes actually received are
   capped by :attr:`RequestLimits.max_body_bytes` (413 at once: nothing is allocated for a
   declared size, and reading stops at the first byte over the cap).
2. :func:`inflate` -- a ``gzip`` / ``deflate`` body is inflated in a streaming way with an
   output limit of ``max_body_bytes`` (413 at the first byte over it), so a small compressed body
   cannot become gigabytes; the server runs it off the event loop (zlib releases the GIL).
3. :func:`decode_json` -- JSON by orjson where it reads as the standard library does and the body
   is small beside the cap (orjson's working memory is 13-18 times the body), else by the
   standard library; then one pass over the value refuses (400) nesting deeper than
   ``max_json_depth`` and values that cannot be represented on the way out: strings holding a
   lone surrogate (they cannot be encoded as UTF-8, so nothing could echo or forward them) and
   non-finite numbers (``NaN``, ``Infinity``, literals beyond the float range).
4. :func:`check_body_counts` before normalisation and :func:`check_request_counts` after it -- the
   number of messages, tools and tool results in one turn are capped (400).

Every refusal is a :class:`~gyre.proxy.errors.ProxyError` with a message naming the limit and its
setting, answered in the API's own error shape; none of them records anything.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ROLE_TOOL, ChatRequest

__all__ = ["RequestLimits", "limits_from_args", "read_body", "read_json", "inflate", "decode_json", "check_json_value",
           "check_body_counts", "check_request_counts", "parses_with_orjson", "ORJSON_MAX_SHARE"]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits (the proxy's :class:`~gyre.proxy.server.ProxyConfig` carries them).

    * ``max_body_bytes`` -- the body as declared, as received and after content decoding.
    * ``max_json_depth`` -- nesting of arrays and objects (the body's top level is depth 1).
    * ``max_messages`` -- messages of one request (Responses: input items).
    * ``max_tools`` -- tool definitions of one request.
    * ``max_tool_results`` -- tool results in one turn (consecutive results after one assistant
      message, i.e. the calls of one parallel tool-call batch).
    """

    max_body_bytes: int = 32 << 20
    max_json_depth: int = 128
    max_messages: int = 20_000
    max_tools: int = 1_024
    max_tool_results: int = 2_048


def limits_from_args(args: Any) -> RequestLimits:
    """The limits of Gyre's ``--proxy-max-*`` flags (:mod:`gyre.arguments`)."""
    return RequestLimits(args.proxy_max_body_bytes, args.proxy_max_json_depth, args.proxy_max_messages,
                         args.proxy_max_tools, args.proxy_max_tool_results)


def _too_large(n: int, limit: int, what: str) -> ProxyError:
    return ProxyError(413, f"request body is too large: {what} {n} bytes > {limit} (max_body_bytes)")


async def read_body(request: Any, max_bytes: int) -> bytearray:
    """A Starlette request's body, at most ``max_bytes`` long (module docstring, step 1).

    The chunks are appended to one growing buffer as they arrive (amortised growth: no moment
    holds the event loop for a copy of the whole body at once).

    Raises:
        ProxyError: 413 when ``Content-Length`` or the bytes received exceed ``max_bytes``.
        ClientDisconnect: the client left while sending.
    """
    raw_length = request.headers.get("content-length")
    if raw_length is not None:
        try:
            declared = int(raw_length)
        except ValueError:
            raise ProxyError(400, f"Content-Length is not an integer: {raw_length[:40]!r}") from None
        if declared > max_bytes:
            raise _too_large(declared, max_bytes, "Content-Length says")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > max_bytes:
            raise _too_large(len(buf), max_bytes, "received more than")
    return buf


async def read_json(request: Any, limits: RequestLimits | None = None) -> Any:
    """:func:`decode_json` of a Starlette request's body read by :func:`read_body` (on the event
    loop: for the small bodies of the admin routes)."""
    limits = limits or RequestLimits()
    raw = await read_body(request, limits.max_body_bytes)
    return decode_json(raw, request.headers.get("content-encoding", ""), limits)


#: Bytes of compressed input fed per step, and most bytes inflated per step: the decoded body grows
#: by at most one step's output beside itself, and zlib's copy of the input it has not read yet
#: (``unconsumed_tail``) is at most one input step.
INFLATE_STEP_BYTES = 16 << 10


def _inflate_stream(raw: bytes | bytearray, wbits: int, limit: int, multi_member: bool) -> bytearray:
    out = bytearray()
    view = memoryview(raw)
    d, pos, data = zlib.decompressobj(wbits), 0, b""
    while True:
        if not len(data):
            data = view[pos:pos + INFLATE_STEP_BYTES]
            pos += len(data)
        step = d.decompress(data, min(INFLATE_STEP_BYTES, limit + 1 - len(out)))
        out += step
        if len(out) > limit:
            raise _too_large(len(out), limit, "decoded to more than")
        data = d.unconsumed_tail
        if d.eof:
            end = pos - len(data) - len(d.unused_data)  # where this stream's end marker ended
            if multi_member and raw.count(b"\0", end) < len(raw) - end:  # another gzip member follows
                d, pos, data = zlib.decompressobj(wbits), end, b""
                continue
            return out
        if not len(data) and not step and pos >= len(view):  # all read, nothing more out, no end marker
            raise EOFError("compressed data ended before the end-of-stream marker")


def inflate(raw: bytes | bytearray, encoding: str, limit: int) -> bytes | bytearray:
    """The body as sent before ``Content-Encoding: encoding`` (identity, gzip, or deflate: zlib-
    wrapped or raw), at most ``limit`` bytes; the identity encoding returns ``raw`` itself.

    Raises:
        ProxyError: 415 for another encoding; 413 when the decoded body exceeds ``limit``; 400
            for truncated or corrupt compressed data.
    """
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return raw
    try:
        if enc == "gzip":
            return _inflate_stream(raw, 16 + zlib.MAX_WBITS, limit, multi_member=True)
        if enc == "deflate":
            try:
                return _inflate_stream(raw, zlib.MAX_WBITS, limit, multi_member=False)
            except zlib.error:
                return _inflate_stream(raw, -zlib.MAX_WBITS, limit, multi_member=False)  # raw deflate
    except (EOFError, zlib.error) as exc:
        raise ProxyError(400, f"request body is not valid {enc} data: {type(exc).__name__}: {exc}") from None
    raise ProxyError(415, f"unsupported content-encoding {enc!r}")


_NOT_PARSED = object()
_UTF8_BOM = b"\xef\xbb\xbf"
#: orjson reads an integer literal beyond 64 bits as a float; a float this large sends the body to
#: the standard library's parser, which keeps such integers exact.
_FLOAT_FROM_BIG_INT = 2.0 ** 63
#: orjson parses a body at most ``max_body_bytes / ORJSON_MAX_SHARE`` long: its working memory (the
#: yyjson document it builds, sized by the body's length) peaks at 13-18 times the body, the standard
#: library's at 2-8 times, so a body orjson parses costs at most about the cap at its peak
#: (docs/proxy.md, "Hostile bodies").
ORJSON_MAX_SHARE = 16


def parses_with_orjson(n: int, max_body_bytes: int) -> bool:
    """Whether :func:`decode_json` first tries orjson on a body of ``n`` bytes (:data:`ORJSON_MAX_SHARE`)."""
    return n * ORJSON_MAX_SHARE <= max_body_bytes


def decode_json(raw: bytes | bytearray, encoding: str = "", limits: RequestLimits | None = None, *,
                consume: bool = False) -> Any:
    """The JSON value of a body sent with ``Content-Encoding: encoding``, checked by
    :func:`check_json_value` (module docstring, steps 2-3). orjson reads a body of at most
    ``max_body_bytes / ORJSON_MAX_SHARE`` bytes (faster than the standard library: docs/proxy.md,
    "Parsing the request"), unless orjson's reading could differ from ``json.loads`` -- orjson
    refuses what the standard library accepts (``NaN``, ``1e400``, a lone surrogate escape) and reads
    integer literals beyond 64 bits as floats; a longer body, and every body orjson refuses, goes to
    the standard library (a lower peak of working memory), whose errors are the ones reported. The
    value is the same whichever parser read it. With ``consume`` (the caller gives ``raw`` up), a
    ``bytearray`` body is emptied once the standard library has its text, so that the body is not
    held beside the text and the value parsed from it.

    Raises:
        ProxyError: as :func:`inflate`; 400 for bytes that are not UTF-8, text that is not JSON,
            and values :func:`check_json_value` refuses.
    """
    limits = limits or RequestLimits()
    raw = inflate(raw, encoding, limits.max_body_bytes)
    if len(raw) > limits.max_body_bytes:
        raise _too_large(len(raw), limits.max_body_bytes, "")
    if parses_with_orjson(len(raw), limits.max_body_bytes):
        try:
            value = orjson.loads(raw[3:] if raw.startswith(_UTF8_BOM) else raw)
        except orjson.JSONDecodeError:
            value = _NOT_PARSED
        if value is not _NOT_PARSED and check_json_value(value, limits.max_json_depth, strict=False):
            return value
        value = None  # not held while the standard library parses
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ProxyError(400, f"request body is not valid UTF-8: {exc}") from None
    if consume and isinstance(raw, bytearray):
        try:
            raw.clear()
        except BufferError:  # a view of it is still alive: it stays as it is
            pass
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProxyError(400, f"request body is not valid JSON: {type(exc).__name__}") from None
    check_json_value(value, limits.max_json_depth, strict=True)
    return value


def _has_lone_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json_value(value: Any, max_depth: int, *, strict: bool) -> bool:
    """One pass over a decoded JSON value: refuse nesting deeper than ``max_depth`` (400).

    ``strict=False`` (a value orjson produced) returns ``False`` when a float is so large that it
    may have been an integer literal orjson rounded, so that the caller reads the body again with
    the standard library. ``strict=True`` (a value ``json.loads`` produced) refuses (400) strings
    with a lone surrogate and non-finite floats, and returns ``True``.
    """
    stack: list[tuple[Any, int]] = [([value], 0)]  # the body's top level, at depth 1, is an item of this list
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v
        if depth > max_depth:
            raise ProxyError(400, f"request body is nested deeper than {max_depth} levels (max_json_depth)")
        if strict and isinstance(v, dict) and any(_has_lone_surrogate(k) for k in v):
            raise ProxyError(400, "request body holds a key with a lone surrogate (\\ud800-\\udfff), "
                                  "which is not valid Unicode text")
        for x in items:
            if isinstance(x, (dict, list)):
                stack.append((x, depth + 1))
            elif isinstance(x, float):
                if not -_FLOAT_FROM_BIG_INT < x < _FLOAT_FROM_BIG_INT:
                    if not strict:
                        return False
                    if not math.isfinite(x):
                        raise ProxyError(400, "request body holds a non-finite number (NaN, Infinity, or a "
                                              "literal beyond the float range)")
            elif strict and isinstance(x, str) and _has_lone_surrogate(x):
                raise ProxyError(400, "request body holds a string with a lone surrogate (\\ud800-\\udfff), "
                                      "which is not valid Unicode text")
    return True


def check_body_counts(body: Any, limits: RequestLimits) -> None:
    """Refuse (400) a decoded body whose ``messages`` / ``input`` or ``tools`` arrays are longer
    than the message and tool limits, before normalisation spends time on them (normalised
    messages can outnumber the body's -- an Anthropic user turn of many tool results becomes
    one message each -- so :func:`check_request_counts` checks again after it)."""
    if not isinstance(body, dict):
        return
    for key, limit, name in (("messages", limits.max_messages, "max_messages"),
                             ("input", limits.max_messages, "max_messages"), ("tools", limits.max_tools, "max_tools")):
        v = body.get(key)
        if isinstance(v, list) and len(v) > limit:
            raise ProxyError(400, f"too many {key}: {len(v)} > {limit} ({name})", param=key)


def check_request_counts(req: ChatRequest, limits: RequestLimits) -> None:
    """Refuse (400) a normalised request with more messages, tools or tool results in one turn
    than ``limits`` allow (module docstring, step 4)."""
    if len(req.messages) > limits.max_messages:
        raise ProxyError(400, f"too many messages: {len(req.messages)} > {limits.max_messages} (max_messages)",
                         param="messages")
    if len(req.tools) > limits.max_tools:
        raise ProxyError(400, f"too many tools: {len(req.tools)} > {limits.max_tools} (max_tools)", param="tools")
    run = 0
    for m in req.messages:
        run = run + 1 if m.role == ROLE_TOOL else 0
        if run > limits.max_tool_results:
            raise ProxyError(400, f"too many tool results in one turn: more than {limits.max_tool_results} "
                                  f"(max_tool_results)", param="messages")
