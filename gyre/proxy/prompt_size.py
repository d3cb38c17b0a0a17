"""Refusing a prompt whose size alone proves it too long, before any of it is tokenised.

Every token of a vocabulary stands for at most ``L`` bytes of text (:func:`max_token_bytes`: the
longest token, decoded), so a prompt whose rendered text holds ``c`` characters (at least ``c``
bytes) has at least ``c / L`` tokens, whatever the tokeniser does with it.
:func:`prompt_chars_lower_bound` counts characters the chat template certainly writes into the
prompt, in time linear in the request's size, without rendering or encoding anything.
:func:`check_prompt_size` raises the proxy's 400 ``prompt is too long`` when that bound alone
exceeds the context.  Tokenising a body of tens of megabytes takes tens of seconds; this check
takes well under one.

What a template certainly writes differs between templates: Qwen3's own template drops the
``<think>`` blocks of assistant turns before the last user query (also ``<think>`` markup inside
their content), other templates drop system text, tool definitions or earlier turns, or trim
whitespace.  :func:`probe_kept_parts` renders a few probe conversations once (``ChatRenderer``
does it at construction) and names the parts whose marker text survived every rendering
(:data:`PARTS`); the bound counts only those parts, each with its surrounding whitespace left
out.  The probes use the template's default variables and ``enable_thinking`` true and false;
other template variables are assumed not to drop what the probes found kept.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable

from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER, ChatRequest

__all__ = ["PARTS", "max_token_bytes", "probe_kept_parts", "prompt_chars_lower_bound", "check_prompt_size"]

#: The parts of a request the bound may count, each only when the template keeps it:
#: ``system`` (a first system message), ``system_later`` (a system message after the first),
#: ``user``, ``tool_results``, ``assistant`` (assistant content in every position; of content
#: with ``<think>`` markup, the text after the last ``</think>``), ``think_markup`` (assistant
#: content with ``<think>`` markup kept whole), ``reasoning`` (``reasoning_content`` in every
#: position), ``tool_calls`` (call names and argument text, verbatim), ``tools`` (every string
#: value of a function tool's definition).
PARTS = ("system", "system_later", "user", "tool_results", "assistant", "think_markup", "reasoning",
         "tool_calls", "tools")


#: Ids :func:`max_token_bytes` decodes in one call (its working memory: ~330 bytes an id).
DECODE_IDS = 256


def max_token_bytes(tokenizer: Any) -> int:
    """Bytes of text the longest token of ``tokenizer`` decodes to (at least 1).

    Decodes every id once, :data:`DECODE_IDS` of them a call (the first request that needs it
    pays this, so its working memory is about 0.1 MB whatever the vocabulary; all ids in one call took
    ~1 MB for the 4,122 of the embedded tokenizer, ~40 MB for Qwen's 151,669); cached on the
    tokenizer object.
    """
    cached = getattr(tokenizer, "_gyre_max_token_bytes", None)
    if cached is not None:
        return cached
    n = len(tokenizer)
    longest = 1
    for at in range(0, n, DECODE_IDS):
        texts = tokenizer.batch_decode([[i] for i in range(at, min(n, at + DECODE_IDS))], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
        longest = max(longest, max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1))
    try:
        tokenizer._gyre_max_token_bytes = longest
    except AttributeError:  # a tokenizer that takes no attributes: compute again next time
        pass
    return longest


# ---------------------------------------------------------------------------------------- probing
def _m(name: str) -> str:
    """A probe marker: text no template writes by itself, none a substring of another."""
    return f"gyreprobe_{name}_q"


def _assistant(content: str, reasoning: str | None = None, call: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"role": ROLE_ASSISTANT, "content": content}
    if reasoning is not None:
        d["reasoning_content"] = reasoning
    if call is not None:
        d["tool_calls"] = [{"id": f"call_{call}", "type": "function",
                            "function": {"name": _m("N" + call), "arguments": _args(call)}}]
    return d


def _args(call: str) -> str:
    return '{"q":  "' + _m("G" + call) + '"}'  # two spaces: verbatim only if the template keeps the text


def _probe_tools() -> list[dict[str, Any]]:
    prop = {"type": _m("ktype"), "description": _m("kdesc"), "enum": [_m("kenum")]}
    params = {"type": _m("ptype"), "properties": {_m("pkey"): prop}, "required": [_m("req")], "x-gyre": _m("extra")}
    # keys a template cannot know of ("x-gyre-...") survive only where it renders the whole definition
    return [{"type": "function", "function": {"name": _m("fn"), "description": _m("fdesc"), "parameters": params,
                                              "x-gyre-probe": _m("fextra")}}]


_TOOL_MARKERS = ("fn", "fdesc", "ptype", "pkey", "ktype", "kdesc", "kenum", "req", "extra", "fextra")

#: (messages, with tools, add_generation_prompt) of each probe conversation.
_PROBES: list[tuple[list[dict[str, Any]], bool, bool]] = [
    ([{"role": ROLE_SYSTEM, "content": _m("S1")}, {"role": ROLE_USER, "content": _m("U1")},
      _assistant(_m("A1"), _m("R1"), "1"), {"role": ROLE_TOOL, "content": _m("T1"), "tool_call_id": "call_1"},
      {"role": ROLE_USER, "content": _m("U2")}, _assistant(f"<think>\n{_m('K1')}\n</think>\n\n{_m('W1')}"),
      {"role": ROLE_USER, "content": _m("U3")}, _assistant(_m("A2"), _m("R2"), "2"),
      {"role": ROLE_TOOL, "content": _m("T2"), "tool_call_id": "call_2"}], True, True),
    ([{"role": ROLE_USER, "content": _m("U4")}, _assistant(f"<think>\n{_m('K2')}\n</think>\n\n{_m('W2')}")],
     True, False),
    ([{"role": ROLE_SYSTEM, "content": _m("S3")}, {"role": ROLE_USER, "content": _m("U5")},
      {"role": ROLE_SYSTEM, "content": _m("S4")}, {"role": ROLE_USER, "content": _m("U6")}], False, True),
]

#: Part -> (probe index, markers) pairs that must all survive for the part to count.
_NEEDS: dict[str, list[tuple[int, tuple[str, ...]]]] = {
    "system": [(0, ("S1",)), (2, ("S3",))],
    "system_later": [(2, ("S4",))],
    "user": [(0, ("U1", "U2", "U3")), (1, ("U4",)), (2, ("U5", "U6"))],
    "tool_results": [(0, ("T1", "T2"))],
    "assistant": [(0, ("A1", "A2", "W1")), (1, ("W2",))],
    "think_markup": [(0, ("K1", "W1")), (1, ("K2", "W2"))],
    "reasoning": [(0, ("R1", "R2"))],
    "tool_calls": [(0, ("N1", "N2"))],
    "tools": [(0, _TOOL_MARKERS), (1, _TOOL_MARKERS)],
}

_VARIANTS: list[dict[str, Any]] = [{}, {"enable_thinking": True}, {"enable_thinking": False}]


def probe_kept_parts(render: Callable[..., str]) -> frozenset[str]:
    """The :data:`PARTS` that ``render`` (``ChatRenderer.render``'s signature) keeps in every probe.

    Each probe conversation is rendered with each template-variable variant; a rendering that
    raises keeps nothing.  ``tool_calls`` also needs the argument text verbatim.
    """
    texts: list[list[str]] = []
    for messages, with_tools, gen in _PROBES:
        out = []
        for kw in _VARIANTS:
            try:
                out.append(render(messages, _probe_tools() if with_tools else None, add_generation_prompt=gen,
                                  template_kwargs=kw))
            except Exception:  # a template that refuses the probe keeps nothing of it
                out.append("")
        texts.append(out)

    def kept(probe: int, marker_texts: Iterable[str]) -> bool:
        return all(m in t for m in marker_texts for t in texts[probe])

    parts = {part for part, needs in _NEEDS.items() if all(kept(p, map(_m, names)) for p, names in needs)}
    if "tool_calls" in parts and not kept(0, (_args("1"), _args("2"))):
        parts.discard("tool_calls")
    return frozenset(parts)


# ---------------------------------------------------------------------------------------- the bound
def _stripped(text: str) -> int:
    """Characters of ``text`` without leading and trailing whitespace (templates often trim)."""
    return len(text.strip())


def _values(value: Any) -> int:
    """Characters of every string value (not key) in a JSON-like value, each stripped."""
    if isinstance(value, str):
        return _stripped(value)
    if isinstance(value, dict):
        return sum(_values(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_values(v) for v in value)
    return 0


def _assistant_content(content: str, markup_kept: bool) -> int:
    if markup_kept or ("<think>" not in content and "</think>" not in content):
        return _stripped(content)
    head, sep, tail = content.rpartition("</think>")
    return _stripped(tail) if sep else 0


def prompt_chars_lower_bound(req: ChatRequest, kept: Collection[str]) -> int:
    """Characters of ``req`` that a template keeping the :data:`PARTS` in ``kept`` certainly writes
    into the prompt (module doc)."""
    n = 0
    if "tools" in kept:
        n += sum(_values(t["function"]) for t in req.tools
                 if isinstance(t, dict) and isinstance(t.get("function"), dict))
    role_part = {ROLE_USER: "user", ROLE_TOOL: "tool_results"}
    markup = "think_markup" in kept
    for i, m in enumerate(req.messages):
        if m.role == ROLE_ASSISTANT:
            if "assistant" in kept:
                n += _assistant_content(m.content, markup)
            if "reasoning" in kept and m.reasoning:
                n += _stripped(m.reasoning)
            if "tool_calls" in kept:
                n += sum(_stripped(tc.name) + _stripped(tc.arguments) for tc in m.tool_calls)
        elif m.role == ROLE_SYSTEM:
            if ("system" if i == 0 else "system_later") in kept:
                n += _stripped(m.content)
        elif role_part.get(m.role) in kept:
            n += _stripped(m.content)
    return n


def check_prompt_size(req: ChatRequest, max_context_tokens: int, tokenizer: Any = None, *,
                      kept: Collection[str], token_bytes: int | None = None) -> None:
    """Raise 400 ``prompt is too long`` when ``req``'s size alone proves more than
    ``max_context_tokens - 1`` prompt tokens for a template that keeps the :data:`PARTS` in
    ``kept`` (``ChatRenderer.kept_parts``); return at once for any request shorter in characters
    than the context is in tokens.  ``token_bytes`` (the tokenizer's :func:`max_token_bytes`) may
    be given instead of ``tokenizer``."""
    chars = prompt_chars_lower_bound(req, kept)
    if chars < max_context_tokens:  # cannot prove anything: every token covers at least one byte
        return
    at_least = chars // (token_bytes if token_bytes is not None else max_token_bytes(tokenizer))
    if at_least >= max_context_tokens:
        raise ProxyError(400, f"prompt is too long: at least {at_least} tokens (its {chars} characters) > "
                              f"{max_context_tokens - 1} maximum")
