"""What the three API modules share: validators, content and tool helpers,
and the base of the response builders.

Bodies are read and decoded by :mod:`gyre.proxy.request_body`. The validators
(:func:`obj`, :func:`array`, :func:`string`, the ``opt_*`` readers, :func:`stops`) raise
:class:`~gyre.proxy.errors.ProxyError` (400) naming the offending field, whatever JSON value
they get. :func:`sampling_options` reads the sampling fields the APIs share;
:func:`function_tool` turns a function declaration into the OpenAI-style schema every
:class:`~gyre.proxy.messages.ChatRequest` carries. Multi-part content is concatenated without
a separator; a non-text part becomes a placeholder such as ``[image]``.

:class:`ResponseBuilder` turns the output parser's deltas into SSE events and bodies; ids
come from an :class:`IdFactory`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

import orjson

from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ROLE_ASSISTANT, ChatRequest, Message, SamplingOptions, ToolCall
from gyre.proxy.parse import OutputEvent

__all__ = [
    "MAX_TOKENS_LIMIT", "obj", "array", "string", "opt_bool", "opt_num", "opt_int", "stops", "model_name",
    "stream_flag", "sampling_options", "opt_top_p", "opt_top_k", "check_engine_sampling", "dump_arguments",
    "arguments_text", "placeholder", "content_text",
    "function_tool", "Sse", "IdFactory", "ResponseBuilder",
]

#: Upper bound accepted for any ``max_tokens``-like field (tokens).
MAX_TOKENS_LIMIT = 1 << 30


# ----------------------------------------------------------------------------- validators
def obj(v: Any, where: str) -> dict[str, Any]:
    """``v`` if it is a JSON object."""
    if not isinstance(v, dict):
        raise ProxyError(400, f"{where} must be an object", param=where)
    return v


def array(v: Any, where: str) -> list[Any]:
    """``v`` if it is a JSON array."""
    if not isinstance(v, list):
        raise ProxyError(400, f"{where} must be an array", param=where)
    return v


def string(v: Any, where: str) -> str:
    """``v`` if it is a string."""
    if not isinstance(v, str):
        raise ProxyError(400, f"{where} must be a string", param=where)
    return v


def opt_bool(d: dict[str, Any], key: str, where: str) -> bool | None:
    """``d[key]`` if it is a boolean, ``None`` if absent or null."""
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise ProxyError(400, f"{where}.{key} must be a boolean", param=key)
    return v


def opt_num(d: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    """``d[key]`` as a float if it is a finite number in ``[lo, hi]``, ``None`` if absent."""
    v = d.get(key)
    if v is None:
        return None
    # the range first: an integer too large for a float compares exactly, but has no float value
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or not math.isfinite(v):
        raise ProxyError(400, f"{key} must be a number in [{lo}, {hi}]", param=key)
    return float(v)


def opt_int(d: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    """``d[key]`` if it is an integer in ``[lo, hi]``, ``None`` if absent."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProxyError(400, f"{key} must be an integer in [{lo}, {hi}]", param=key)
    return int(v)


def stops(v: Any, key: str) -> tuple[str, ...]:
    """Stop strings from a string or an array of strings; empty strings are dropped."""
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    out = [string(s, f"{key}[{i}]") for i, s in enumerate(array(v, key))]
    return tuple(s for s in out if s)


def model_name(body: dict[str, Any]) -> str:
    """The requested model name (``""`` when absent)."""
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ProxyError(400, "model must be a string", param="model")
    return model


def stream_flag(body: dict[str, Any]) -> bool:
    """Whether the body asks for an SSE response."""
    return opt_bool(body, "stream", "body") or False


def sampling_options(
    body: dict[str, Any], max_tokens_key: str, *, max_tokens: int | None = None, top_k: bool = False,
    stop_key: str | None = None, extended: bool = False,
) -> SamplingOptions:
    """Sampling fields of a body, validated with the engine's limits in this order:
    ``max_tokens_key`` (skipped when ``max_tokens`` is given; an integer >= 1),
    ``temperature`` in [0, 2], ``top_p`` in (0, 1], then optionally ``top_k`` (-1 = off, or
    >= 1), stop strings under ``stop_key`` and (``extended``) ``seed``, ``min_tokens`` (an
    integer >= 0, at most ``max_tokens`` when both are given), ``ignore_eos`` (SGLang's
    extensions of Chat Completions)."""
    if max_tokens is None:
        max_tokens = opt_int(body, max_tokens_key, 1, MAX_TOKENS_LIMIT)
    s = SamplingOptions(
        max_tokens=max_tokens,
        temperature=opt_num(body, "temperature", 0.0, 2.0),
        top_p=opt_top_p(body),
        top_k=opt_top_k(body) if top_k else None,
        stop=stops(body.get(stop_key), stop_key) if stop_key else (),
    )
    if extended:
        s.seed = opt_int(body, "seed", -(1 << 63), (1 << 63) - 1)
        s.min_tokens = opt_int(body, "min_tokens", 0, MAX_TOKENS_LIMIT)
        s.ignore_eos = opt_bool(body, "ignore_eos", "body")
        if s.min_tokens is not None and s.max_tokens is not None and s.min_tokens > s.max_tokens:
            raise ProxyError(400, f"min_tokens ({s.min_tokens}) must not exceed {max_tokens_key} ({s.max_tokens})",
                             param="min_tokens")
    return s


def opt_top_p(d: dict[str, Any]) -> float | None:
    """``d["top_p"]`` if it is a number in (0, 1] (0 would keep no token), ``None`` if absent."""
    v = d.get("top_p")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0 or not math.isfinite(v):
        raise ProxyError(400, "top_p must be a number in (0, 1]", param="top_p")
    return float(v)


def opt_top_k(d: dict[str, Any]) -> int | None:
    """``d["top_k"]`` if it is -1 (off) or an integer >= 1, ``None`` if absent."""
    v = d.get("top_k")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not (v == -1 or 1 <= v <= 1 << 30):
        raise ProxyError(400, "top_k must be -1 (off) or an integer >= 1", param="top_k")
    return int(v)


_INT_PARAMS = {"max_new_tokens": 1, "min_new_tokens": 0, "n": 1}


def check_engine_sampling(sp: dict[str, Any]) -> None:
    """Check the SGLang ``sampling_params`` the proxy is about to send (request values merged
    with the operator's defaults and forced values) against the engine's limits: integer
    ``max_new_tokens`` >= 1, ``min_new_tokens`` >= 0 and <= ``max_new_tokens``,
    ``temperature`` >= 0, ``top_p`` in (0, 1], ``top_k`` -1 or >= 1, ``min_p`` in [0, 1].
    Raises :class:`ProxyError` 400 naming the parameter, so that the engine never sees a
    request it would refuse, and 400 for parameters that cannot be written as JSON (e.g. a stop
    string holding a lone surrogate), which no engine could be sent."""
    try:
        orjson.dumps(sp)
    except orjson.JSONEncodeError as exc:
        raise ProxyError(400, f"sampling parameters cannot be encoded as JSON for the engine: {exc}") from None
    for key, lo in _INT_PARAMS.items():
        v = sp.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise ProxyError(400, f"sampling parameter {key} must be an integer >= {lo}, got {v!r}", param=key)

    def num(key: str) -> float | None:
        v = sp.get(key)
        if v is None:
            return None
        try:
            f = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        except OverflowError:  # an integer beyond the float range
            f = math.inf
        if not math.isfinite(f):
            raise ProxyError(400, f"sampling parameter {key} must be a finite number, got {str(v)[:40]}", param=key)
        return f

    t, p, mp = num("temperature"), num("top_p"), num("min_p")
    if t is not None and t < 0:
        raise ProxyError(400, f"temperature must be >= 0, got {t}", param="temperature")
    if p is not None and not 0.0 < p <= 1.0:
        raise ProxyError(400, f"top_p must be in (0, 1], got {p}", param="top_p")
    if mp is not None and not 0.0 <= mp <= 1.0:
        raise ProxyError(400, f"min_p must be in [0, 1], got {mp}", param="min_p")
    k = sp.get("top_k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1)):
        raise ProxyError(400, f"top_k must be -1 (off) or an integer >= 1, got {k!r}", param="top_k")
    lo_n, hi_n = sp.get("min_new_tokens") or 0, sp.get("max_new_tokens")
    if hi_n is not None and lo_n > hi_n:
        raise ProxyError(400, f"min_tokens ({lo_n}) must not exceed max_tokens ({hi_n})", param="min_tokens")


# ----------------------------------------------------------------------------- content and tools
def dump_arguments(value: Any) -> str:
    """JSON text of a tool-call argument value, as the chat template's ``tojson`` writes it."""
    return json.dumps(value, ensure_ascii=False)


def arguments_text(v: Any, where: str) -> str:
    """Argument text of an OpenAI tool call: a string is kept byte for byte, a (lenient) object or
    array is dumped, a missing value is ``"{}"``."""
    if v is None:
        return "{}"
    if isinstance(v, str):
        return v
    if isinstance(v, (dict, list)):
        return dump_arguments(v)
    raise ProxyError(400, f"{where} must be a string", param=where)


def placeholder(kind: str) -> str:
    """Text standing for a non-text content part (``[image]``, ``[document]``, ...)."""
    return f"[{kind}]"


def content_text(content: Any, where: str) -> str:
    """Text of an OpenAI message ``content``: a string, or parts of type ``text``/``input_text``/
    ``output_text``/``refusal`` (others become placeholders; any ``*image*`` type is ``[image]``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for i, p in enumerate(array(content, where)):
        if isinstance(p, str):
            parts.append(p)
            continue
        p = obj(p, f"{where}[{i}]")
        t = p.get("type", "text")
        if t in ("text", "input_text", "output_text"):
            parts.append(string(p.get("text", ""), f"{where}[{i}].text"))
        elif t == "refusal":
            parts.append(string(p.get("refusal", ""), f"{where}[{i}].refusal"))
        elif isinstance(t, str):
            parts.append(placeholder("image" if "image" in t else t))
        else:
            raise ProxyError(400, f"{where}[{i}].type must be a string")
    return "".join(parts)


def function_tool(
    name: str, src: dict[str, Any], where: str, *, parameters_key: str = "parameters",
    default_parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``{"type": "function", "function": {name, description?, parameters?}}`` from a declaration
    ``src``. Without ``default_parameters`` a missing or null ``parameters_key`` is left out; with
    it, a missing one takes the default and a null one is refused."""
    fn: dict[str, Any] = {"name": name}
    desc = src.get("description")
    if desc is not None:
        fn["description"] = string(desc, f"{where}.description")
    params = src.get(parameters_key, default_parameters)
    if params is not None or default_parameters is not None:
        fn["parameters"] = obj(params, f"{where}.{parameters_key}")
    return {"type": "function", "function": fn}


# ----------------------------------------------------------------------------- response builders
#: One SSE event: ``(event name or None, JSON-serialisable data or a pre-serialised string)``.
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
    """Base of the per-API builders.

    It consumes the output parser's :class:`~gyre.proxy.parse.OutputEvent` deltas and yields SSE
    events as they come; :meth:`body` is the equivalent non-streaming body and
    :meth:`output_message` the output as the harness will echo it (ids assigned). Ids come
    from an :class:`IdFactory` (random by default; :class:`gyre.proxy.replay.ReplayIds` hands
    out logged ones).

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
        return self._start_events()

    def _start_events(self) -> list[Sse]:
        return []

    def on_event(self, ev: OutputEvent) -> list[Sse]:
        """SSE events for one parser delta."""
        raise NotImplementedError

    def finish(self, finish_reason: str, output_tokens: int) -> list[Sse]:
        """Closing events; records the finish reason and usage."""
        self.finish_reason = finish_reason
        self.output_tokens = int(output_tokens)
        return self._finish_events()

    def _finish_events(self) -> list[Sse]:
        raise NotImplementedError

    def body(self) -> dict[str, Any]:
        """The complete non-streaming response body."""
        raise NotImplementedError

    def error_event(self, err: ProxyError) -> Sse:
        """The SSE event that ends a stream whose generation failed."""
        raise NotImplementedError

    def outcome(self) -> str:
        """How the output ended, API-neutral: ``"tool_calls"`` (it made tool calls), ``"length"``
        (cut at the token limit) or ``"stop"``."""
        if self.calls:
            return "tool_calls"
        return "length" if self.finish_reason == "length" else "stop"

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
