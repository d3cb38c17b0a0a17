"""Refusing a prompt whose size alone proves it too long, before any of it is tokenised.

Every token of a vocabulary stands for at most ``L`` bytes of text (:func:`max_token_bytes`: the
longest token, decoded), so a prompt whose rendered text holds ``c`` characters (at least ``c``
bytes) has at least ``c / L`` tokens, whatever the tokeniser does with it.
:func:`prompt_chars_lower_bound` counts the characters a request certainly brings into its
prompt -- every message's content and tool calls, and every tool definition (chat templates
render them; earlier reasoning is left out, since templates may drop it) -- in time linear in the
number of strings, without rendering or encoding anything.  :func:`check_prompt_size` raises the
proxy's 400 ``prompt is too long`` when that bound alone exceeds the context.  Tokenising a body
of tens of megabytes takes tens of seconds; this check takes well under one.
"""

from __future__ import annotations

from typing import Any

from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ChatRequest

__all__ = ["max_token_bytes", "prompt_chars_lower_bound", "check_prompt_size"]


def max_token_bytes(tokenizer: Any) -> int:
    """Bytes of text the longest token of ``tokenizer`` decodes to (at least 1).

    Decodes every id once (a fast tokenizer does all of them in one call); cached on the
    tokenizer object.
    """
    cached = getattr(tokenizer, "_gyre_max_token_bytes", None)
    if cached is not None:
        return cached
    n = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    longest = max(1, max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1))
    try:
        tokenizer._gyre_max_token_bytes = longest
    except AttributeError:  # a tokenizer that takes no attributes: compute again next time
        pass
    return longest


def _chars(value: Any) -> int:
    """Characters of every string (keys included) in a JSON-like value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _chars(v) for k, v in value.items() if isinstance(k, str))
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 0


def prompt_chars_lower_bound(req: ChatRequest) -> int:
    """Characters that certainly appear in ``req``'s rendered prompt (module doc)."""
    n = _chars(req.tools)
    for m in req.messages:
        n += len(m.content)
        for tc in m.tool_calls:
            n += len(tc.name) + len(tc.arguments)
    return n


def check_prompt_size(req: ChatRequest, max_context_tokens: int, tokenizer: Any = None, *,
                      token_bytes: int | None = None) -> None:
    """Raise 400 ``prompt is too long`` when ``req``'s size alone proves more than
    ``max_context_tokens - 1`` prompt tokens; return at once for any request shorter in
    characters than the context is in tokens.  ``token_bytes`` (the tokenizer's
    :func:`max_token_bytes`) may be given instead of ``tokenizer``."""
    chars = prompt_chars_lower_bound(req)
    if chars < max_context_tokens:  # cannot prove anything: every token covers at least one byte
        return
    at_least = chars // (token_bytes if token_bytes is not None else max_token_bytes(tokenizer))
    if at_least >= max_context_tokens:
        raise ProxyError(400, f"prompt is too long: at least {at_least} tokens (its {chars} characters) > "
                              f"{max_context_tokens - 1} maximum")
