"""The three model APIs the proxy serves, one module each, and dispatch by API name.

* :mod:`~gyre.proxy.api.anthropic` -- Anthropic Messages (``"anthropic"``);
* :mod:`~gyre.proxy.api.openai_chat` -- OpenAI Chat Completions (``"chat"``);
* :mod:`~gyre.proxy.api.openai_responses` -- OpenAI Responses (``"responses"``);
* :mod:`~gyre.proxy.api.common` -- validators, content/tool helpers and the response-builder
  base they share.

Each API module turns a request body into a :class:`~gyre.proxy.messages.ChatRequest` (pure
functions; a malformed body raises :class:`~gyre.proxy.errors.ProxyError` 400 naming the field,
never anything else), reads the assistant message of a complete response object
(``reply_message``), and shapes the proxy's output as that API's body or SSE events (a
:class:`~gyre.proxy.api.common.ResponseBuilder`). The functions below pick the module by the
API name that :data:`MODEL_PATHS` gives each endpoint.
"""

from __future__ import annotations

from typing import Any, Callable

from gyre.proxy.api import anthropic, openai_chat, openai_responses
from gyre.proxy.api.common import IdFactory, ResponseBuilder
from gyre.proxy.messages import ChatRequest, Message

__all__ = ["MODEL_PATHS", "normalize", "reply_message", "make_builder"]

#: Request paths of model calls, by API.
MODEL_PATHS = {"/v1/messages": "anthropic", "/v1/chat/completions": "chat", "/v1/responses": "responses"}

_NORMALIZERS: dict[str, Callable[[Any], ChatRequest]] = {
    "anthropic": anthropic.normalize_anthropic,
    "chat": openai_chat.normalize_chat,
    "responses": openai_responses.normalize_responses,
}
_REPLIES: dict[str, Callable[[dict[str, Any]], Message]] = {
    "anthropic": anthropic.reply_message,
    "chat": openai_chat.reply_message,
    "responses": openai_responses.reply_message,
}
_BUILDERS: dict[str, type[ResponseBuilder]] = {
    "anthropic": anthropic.AnthropicBuilder,
    "chat": openai_chat.ChatBuilder,
    "responses": openai_responses.ResponsesBuilder,
}


def normalize(api: str, body: Any) -> ChatRequest:
    """Normalise a request body of ``api`` (``anthropic`` | ``chat`` | ``responses``).

    Raises:
        ProxyError: 400 for a malformed body.
        KeyError: unknown ``api``.
    """
    return _NORMALIZERS[api](body)


def reply_message(api: str, reply: dict[str, Any]) -> Message:
    """The assistant :class:`~gyre.proxy.messages.Message` of a complete response object of
    ``api`` (as logged in a trace)."""
    return _REPLIES[api](reply)


def make_builder(request: ChatRequest, input_tokens: int, ids: IdFactory | None = None) -> ResponseBuilder:
    """The response builder of ``request.api``."""
    return _BUILDERS[request.api](request, input_tokens, ids)
