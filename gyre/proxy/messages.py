"""The proxy's internal message form: one shape for Anthropic, Chat Completions and Responses.

Every API module (:mod:`gyre.proxy.api`) turns its request into a :class:`ChatRequest`:
a list of :class:`Message` in *chat-template order* (the order the model's chat template
renders them), the offered tools as OpenAI-style function schemas, and sampling parameters.
The form is exactly what a Hugging Face chat template consumes
(:meth:`Message.template_dict`): roles ``system``/``user``/``assistant``/``tool``;
``reasoning_content`` for thinking; ``tool_calls`` whose ``arguments`` is the JSON *text* the
model emitted (or the harness sent), never a re-serialised dict.

:meth:`Message.key` is the identity used by the TITO matcher (:mod:`gyre.proxy.tito`): two
messages with equal keys render to the same tokens in the same context. It covers exactly what
the template renders (role, content, reasoning, tool-call names and argument text) and
nothing it ignores (tool-call ids, ``is_error`` flags, API item ids, ``cache_control``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ToolCall",
    "Message",
    "SamplingOptions",
    "ChatRequest",
    "ParsedOutput",
    "OutputPart",
    "ROLE_SYSTEM",
    "ROLE_USER",
    "ROLE_ASSISTANT",
    "ROLE_TOOL",
]

ROLE_SYSTEM = "system"
ROLE_USER = "user"
ROLE_ASSISTANT = "assistant"
ROLE_TOOL = "tool"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of an assistant message.

    * ``id`` -- the API's call id (Anthropic ``tool_use.id``, OpenAI ``tool_calls[].id``,
      Responses ``call_id``); not rendered.
    * ``name`` -- the tool name as the model sees it (Responses namespaced tools are
      ``"<namespace>.<name>"``).
    * ``arguments`` -- JSON text of the arguments exactly as rendered into the model's
      ``<tool_call>`` block: the model's own bytes for calls the proxy returned (restored from
      the cache), the harness's string for Chat/Responses, ``json.dumps(input)`` for a foreign
      Anthropic ``tool_use``.
    * ``kind`` -- ``"function"`` or ``"custom"`` (Responses free-form tools; ``arguments`` is
      then a JSON string literal holding the free-form input).
    * ``item_id`` -- Responses ``function_call.id`` (``fc_...``), if any; not rendered.
    """

    id: str
    name: str
    arguments: str
    kind: str = "function"
    item_id: str | None = None

    def key(self) -> tuple[str, str]:
        """What the template renders of this call: ``(name, arguments text)``."""
        return (self.name, self.arguments)

    def openai_dict(self) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry (also the chat template's input form)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message in template order (see the module docstring).

    * ``role`` -- ``system`` | ``user`` | ``assistant`` | ``tool``.
    * ``content`` -- text (multi-part content is concatenated, as the template's ``text_of``
      does; non-text parts become ``[image]``/``[document]`` placeholders).
    * ``reasoning`` -- assistant thinking text, or ``None``.
    * ``tool_calls`` -- assistant tool calls, in order.
    * ``tool_call_id`` -- for ``tool`` messages, the call it answers (not rendered).
    * ``is_error`` -- Anthropic ``tool_result.is_error`` (kept, not rendered).
    * ``item_ids`` -- API ids of the items this message came from (Responses reasoning and
      message item ids, Anthropic thinking signatures); used only to recognise the proxy's
      own earlier outputs.
    """

    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    is_error: bool = False
    item_ids: tuple[str, ...] = ()

    def key(self) -> tuple:
        """Hashable identity of what the chat template renders for this message."""
        if self.role == ROLE_ASSISTANT:
            return (
                self.role,
                self.content,
                self.reasoning or "",
                tuple(tc.key() for tc in self.tool_calls),
            )
        return (self.role, self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as a Hugging Face chat template consumes it."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls:
            d["tool_calls"] = [tc.openai_dict() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


@dataclass(slots=True)
class SamplingOptions:
    """Sampling parameters common to the three APIs (mapped to SGLang ``sampling_params``).

    ``max_tokens`` is ``None`` when the request gave none (the server default applies);
    ``stop`` holds stop strings.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None

    def to_sglang(
        self,
        default_max_tokens: int,
        max_tokens_cap: int,
        defaults: dict[str, Any] | None = None,
        forced: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """SGLang ``sampling_params`` for the native ``/generate`` API.

        ``defaults`` fill what the request left unset; ``forced`` override the request (e.g. an
        RL run that samples every rollout at temperature 1). ``max_new_tokens`` is the
        request's ``max_tokens`` (``default_max_tokens`` when it gave none), then cut to
        ``max_tokens_cap``; ``min_new_tokens`` is cut to the same value, so that a capped
        request stays one the engine accepts. :meth:`requested_max_tokens` is the value
        before the cut.
        """
        sp: dict[str, Any] = dict(defaults or {})
        sp["max_new_tokens"] = self.requested_max_tokens(default_max_tokens, forced)
        if self.temperature is not None:
            sp["temperature"] = float(self.temperature)
        if self.top_p is not None:
            sp["top_p"] = float(self.top_p)
        if self.top_k is not None:
            sp["top_k"] = int(self.top_k)
        if self.stop:
            sp["stop"] = list(self.stop)
        if self.seed is not None:
            sp["sampling_seed"] = int(self.seed)
        if self.min_tokens is not None:
            sp["min_new_tokens"] = int(self.min_tokens)
        if self.ignore_eos is not None:
            sp["ignore_eos"] = bool(self.ignore_eos)
        for k, v in (forced or {}).items():
            sp[k] = v
        cap = max(1, int(max_tokens_cap))
        sp["max_new_tokens"] = max(1, min(int(sp["max_new_tokens"]), cap))
        if isinstance(sp.get("min_new_tokens"), int) and sp["min_new_tokens"] > sp["max_new_tokens"]:
            sp["min_new_tokens"] = sp["max_new_tokens"]
        return sp

    def requested_max_tokens(self, default_max_tokens: int, forced: dict[str, Any] | None = None) -> int:
        """The output limit the call asked for before any cap: ``forced["max_new_tokens"]``,
        else the request's ``max_tokens``, else ``default_max_tokens``."""
        if forced and forced.get("max_new_tokens") is not None:
            return int(forced["max_new_tokens"])
        return int(default_max_tokens if self.max_tokens is None else self.max_tokens)


@dataclass(slots=True)
class ChatRequest:
    """A normalised model call (any of the three APIs).

    * ``api`` -- ``"anthropic"`` | ``"chat"`` | ``"responses"``.
    * ``messages`` -- :class:`Message` list in template order.
    * ``tools`` -- OpenAI-style ``{"type": "function", "function": {...}}`` dicts (others
      passed through), in request order; ``[]`` when none.
    * ``tool_kinds`` -- model-visible tool name -> ``"function"``/``"custom"``;
      ``namespaces`` -- model-visible name -> ``(namespace, name)`` for Responses namespaces.
    * ``template_kwargs`` -- extra chat-template variables (e.g. ``enable_thinking``).
    * ``stream`` -- SSE response requested; ``include_usage`` -- Chat ``stream_options``.
    * ``model`` -- the requested model name (echoed back).
    * ``extra`` -- API-specific echo data (Responses ``include``/``reasoning`` settings, ...).
    """

    api: str
    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_kinds: dict[str, str] = field(default_factory=dict)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OutputPart:
    """One piece of a parsed model output, in emission order.

    ``kind`` is ``"reasoning"`` (``text``), ``"text"`` (``text``) or ``"tool_call"``
    (``tool_call``; its ``id`` is empty until the front end assigns one).
    """

    kind: str
    text: str = ""
    tool_call: ToolCall | None = None


@dataclass(slots=True)
class ParsedOutput:
    """Engine output tokens parsed into reasoning, text and tool calls (:mod:`gyre.proxy.parse`).

    ``parts`` keeps emission order (for Anthropic content blocks / Responses items);
    ``finish_reason`` is the engine's (``stop``/``length``/``abort``); ``malformed`` counts
    ``<tool_call>`` blocks whose JSON did not parse (returned as text).
    """

    parts: list[OutputPart]
    finish_reason: str = "stop"
    malformed: int = 0

    @property
    def reasoning(self) -> str | None:
        r = [p.text for p in self.parts if p.kind == "reasoning"]
        return "".join(r) if r else None

    @property
    def content(self) -> str:
        return "".join(p.text for p in self.parts if p.kind == "text")

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(p.tool_call for p in self.parts if p.kind == "tool_call" and p.tool_call is not None)

    def message(self) -> Message:
        """The output as an assistant :class:`Message` (what the harness will echo back)."""
        return Message("assistant", self.content, self.reasoning or None, self.tool_calls)
