r"""Output parsing: engine token ids -> reasoning, text and tool calls, incrementally.

The model format is Qwen/Hermes (``<think>\n...\n</think>\n\n`` then text, then
``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` blocks separated by ``\n``),
the inverse of ``gyre/chat_template.jinja``'s assistant turn, so that
``parse(render(message)) == message`` for every message the template can render.

:class:`OutputParser` parses one generation as its tokens arrive; :func:`parse_output` parses a
whole output at once. Tool-call ``arguments`` are kept byte for byte as the model wrote them; a
block that does not parse is returned as text, never an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from gyre.proxy.messages import OutputPart, ParsedOutput, ToolCall

__all__ = ["OutputEvent", "OutputParser", "parse_tool_call_body", "parse_output"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

_NAME_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*')
_ARGS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_OBJ_END = re.compile(r"\s*\}\s*$")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class OutputEvent:
    """A streaming delta: ``kind`` is ``"reasoning"``/``"text"`` (``text``) or ``"tool_call"``."""

    kind: str
    text: str = ""
    tool_call: ToolCall | None = None


def parse_tool_call_body(body: str, kind: str = "function") -> tuple[str, str] | None:
    """``(name, raw arguments JSON text)`` of a ``<tool_call>`` body, or ``None`` if malformed.

    ``kind`` ``"function"`` requires object arguments; ``"custom"`` a JSON string; ``"any"``
    accepts any JSON value.
    """
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if kind == "function" and not isinstance(args, dict):
        return None
    if kind == "custom" and not isinstance(args, str):
        return None
    raw: str | None = None
    m = _NAME_PREFIX.match(body)
    if m is not None and "arguments" in obj:
        try:
            _, end = _DECODER.raw_decode(body, m.end())
            m2 = _ARGS_KEY.match(body, end)
            if m2 is not None:
                _, end2 = _DECODER.raw_decode(body, m2.end())
                if _OBJ_END.match(body, end2):
                    raw = body[m2.end():end2]
        except (ValueError, RecursionError):
            raw = None
    if raw is None:
        raw = json.dumps(args, ensure_ascii=False)
    return obj["name"], raw


def _held_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    n = min(len(buf), len(tag) - 1)
    for k in range(n, 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


class OutputParser:
    """Incremental parser of one generation's output token ids.

    Rules:

    * A leading ``<think>`` opens reasoning (or the generation prompt already opened it:
      ``starts_in_reasoning``); it closes at ``</think>``. The template's ``\\n`` after
      ``<think>`` and before ``</think>`` and the ``\\n\\n`` after it are not part of the
      reasoning/text. An unclosed think block (length cut) is all reasoning.
    * ``<tool_call>...</tool_call>`` blocks become tool calls when their body is a JSON object
      with a string ``name`` (and, for function tools, an object ``arguments``; for custom
      tools a string). The ``arguments`` text is kept *byte for byte* (the raw JSON value after
      ``"arguments":``), so the harness receives -- and later echoes -- the model's own bytes.
      A block that does not parse (or is cut off) is returned as text, with its separator.
    * The ``\\n`` the template puts between text and the first tool call, and between calls, is
      not text. EOS/stop token ids are not text.

    :meth:`feed` returns :class:`OutputEvent` deltas as soon as they are certain (text that
    could still be the start of a tag is held back); the concatenation of all deltas equals
    the final :meth:`result`.

    Args:
        decode: ``ids -> str`` (the tokenizer's decode, special tokens kept).
        stop_ids: token ids that end generation and are not text (EOS, ``<|endoftext|>``).
        tool_kinds: tool name -> ``"function"``/``"custom"`` (unknown names: ``"function"``).
        starts_in_reasoning: the generation prompt ended inside an open ``<think>``.
    """

    _SEG_TOKENS = 32

    def __init__(
        self,
        decode,
        stop_ids: Iterable[int] = (),
        tool_kinds: dict[str, str] | None = None,
        *,
        starts_in_reasoning: bool = False,
    ) -> None:
        self._decode = decode
        self._stop = frozenset(int(i) for i in stop_ids)
        self._kinds = tool_kinds or {}
        self._ids: list[int] = []
        self._seg = 0  # first id of the undecoded segment
        self._seg_emitted = 0  # chars of the segment's text already passed on
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._reasoning_started = starts_in_reasoning
        self._buf = ""
        self._after_think = 0  # newlines still to strip after </think>
        self._pending_sep = ""  # "\n" held before a possible <tool_call>
        self._parts: list[OutputPart] = []
        self._malformed = 0
        self._finished = False

    # ------------------------------------------------------------------ text decoding
    def _new_text(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids if int(i) not in self._stop)
        seg = self._ids[self._seg:]
        if not seg:
            return ""
        text = self._decode(seg)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return ""
        out = text[self._seg_emitted:]
        if len(seg) >= self._SEG_TOKENS:
            self._seg = len(self._ids)
            self._seg_emitted = 0
        else:
            self._seg_emitted = len(text)
        return out

    def _flush_text(self) -> str:
        seg = self._ids[self._seg:]
        if not seg:
            return ""
        text = self._decode(seg)
        out = text[self._seg_emitted:]
        self._seg = len(self._ids)
        self._seg_emitted = 0
        return out

    # ------------------------------------------------------------------ events
    def _emit(self, events: list[OutputEvent], kind: str, text: str = "", call: ToolCall | None = None) -> None:
        if kind in ("text", "reasoning"):
            if not text:
                return
            if self._parts and self._parts[-1].kind == kind:
                last = self._parts[-1]
                self._parts[-1] = OutputPart(kind, last.text + text)
            else:
                self._parts.append(OutputPart(kind, text))
        else:
            self._parts.append(OutputPart(kind, tool_call=call))
        events.append(OutputEvent(kind, text, call))

    def feed(self, ids: Sequence[int]) -> list[OutputEvent]:
        """Consume newly generated token ids; return the deltas that are now certain."""
        if self._finished:
            raise RuntimeError("parser already finished")
        events: list[OutputEvent] = []
        self._buf += self._new_text(ids)
        self._step(events, final=False)
        return events

    def finish(self, finish_reason: str = "stop") -> list[OutputEvent]:
        """End of generation: flush held text; return the last deltas."""
        if self._finished:
            return []
        events: list[OutputEvent] = []
        self._buf += self._flush_text()
        self._step(events, final=True)
        self._finished = True
        self._finish_reason = finish_reason
        return events

    def result(self) -> ParsedOutput:
        """The parsed output (call after :meth:`finish`)."""
        return ParsedOutput(list(self._parts), getattr(self, "_finish_reason", "stop"), self._malformed)

    def _emit_until_tag(self, events: list[OutputEvent], kind: str, buf: str, tag: str, final: bool) -> None:
        """``buf`` holds no ``tag`` yet: emit it, except (unless ``final``) a suffix that could
        still become ``"\n" + tag``, which stays buffered."""
        hold = 0 if final else _held_suffix(buf, "\n" + tag)
        self._emit(events, kind, buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold:]

    def _step(self, events: list[OutputEvent], final: bool) -> None:
        while True:
            st = self._state
            buf = self._buf
            if st == "start":
                if buf.startswith(THINK_OPEN):
                    self._buf = buf[len(THINK_OPEN):]
                    self._state = "reasoning_open"
                    continue
                if not final and THINK_OPEN.startswith(buf):
                    return  # could still become <think>
                self._state = "text"
                continue
            if st == "reasoning_open":  # strip the template's "\n" after <think>
                if not buf:
                    if final:
                        self._state = "reasoning"
                        continue
                    return
                if buf[0] == "\n":
                    self._buf = buf[1:]
                self._state = "reasoning"
                continue
            if st == "reasoning":
                i = buf.find(THINK_CLOSE)
                if i >= 0:
                    body = buf[:i]
                    if body.endswith("\n"):
                        body = body[:-1]
                    self._emit(events, "reasoning", body)
                    self._buf = buf[i + len(THINK_CLOSE):]
                    self._state = "after_think"
                    self._after_think = 2
                    continue
                self._emit_until_tag(events, "reasoning", buf, THINK_CLOSE, final)
                return
            if st == "after_think":  # strip the template's "\n\n" after </think>
                while self._after_think and self._buf.startswith("\n"):
                    self._buf = self._buf[1:]
                    self._after_think -= 1
                if self._after_think and not self._buf and not final:
                    return
                self._after_think = 0
                self._state = "text"
                continue
            if st == "text":
                i = buf.find(CALL_OPEN)
                if i >= 0:
                    text = buf[:i]
                    sep = ""
                    if text.endswith("\n"):
                        text, sep = text[:-1], "\n"
                    self._emit(events, "text", text)
                    self._pending_sep = sep
                    self._buf = buf[i + len(CALL_OPEN):]
                    self._state = "call"
                    continue
                self._emit_until_tag(events, "text", buf, CALL_OPEN, final)
                return
            if st == "call":
                i = buf.find(CALL_CLOSE)
                if i < 0:
                    if final:  # cut off inside a tool call: text
                        self._malformed += 1
                        self._emit(events, "text", self._pending_sep + CALL_OPEN + buf)
                        self._pending_sep = ""
                        self._buf = ""
                    return
                body = buf[:i]
                self._buf = buf[i + len(CALL_CLOSE):]
                parsed = self._parse_call(body)
                if parsed is None:
                    self._malformed += 1
                    self._emit(events, "text", self._pending_sep + CALL_OPEN + body + CALL_CLOSE)
                else:
                    self._emit(events, "tool_call", call=parsed)
                self._pending_sep = ""
                self._state = "text"
                continue
            raise AssertionError(st)

    def _parse_call(self, body: str) -> ToolCall | None:
        try:
            obj_name = json.loads(body).get("name") if body.strip().startswith("{") else None
        except (ValueError, AttributeError, RecursionError):
            obj_name = None
        kind = self._kinds.get(obj_name, "function") if isinstance(obj_name, str) else "function"
        res = parse_tool_call_body(body.strip(), kind)
        if res is None:
            return None
        name, raw = res
        return ToolCall("", name, raw, kind)


def parse_output(
    decode,
    ids: Sequence[int],
    stop_ids: Iterable[int] = (),
    tool_kinds: dict[str, str] | None = None,
    *,
    finish_reason: str = "stop",
    starts_in_reasoning: bool = False,
) -> ParsedOutput:
    """Non-streaming :class:`OutputParser`: parse a whole output at once."""
    p = OutputParser(decode, stop_ids, tool_kinds, starts_in_reasoning=starts_in_reasoning)
    p.feed(ids)
    p.finish(finish_reason)
    return p.result()
