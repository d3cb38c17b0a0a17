"""Gyre's model proxy: the Anthropic / OpenAI Chat / OpenAI Responses APIs in front of
token-level engines, recording every call token-in/token-out into trajectory trees
(docs/proxy.md).

Layout (pure cores first, HTTP and threads at the edges):

* the model APIs and messages: :mod:`~gyre.proxy.messages` (the internal message form),
  :mod:`~gyre.proxy.api` (the three APIs), :mod:`~gyre.proxy.errors` (each API's error shape);
* tokens: :mod:`~gyre.proxy.render` (chat-template rendering), :mod:`~gyre.proxy.piece_encode`
  (encoding text in bounded pieces, stopping at the context), :mod:`~gyre.proxy.parse` (output
  tokens into reasoning/text/tool calls), :mod:`~gyre.proxy.tito`, :mod:`~gyre.proxy.tito_input`
  and :mod:`~gyre.proxy.tito_outputs` (token assembly and restoration),
  :mod:`~gyre.proxy.context_buffer` (a thread's context as growable token arrays),
  :mod:`~gyre.proxy.roles` (role classification), :mod:`~gyre.proxy.replay` (trace replay);
* a request's intake: :mod:`~gyre.proxy.request_body` (reading and parsing a body under limits),
  :mod:`~gyre.proxy.body_check` (very large bodies checked in a helper process),
  :mod:`~gyre.proxy.prompt_size` (a prompt too long by its size alone),
  :mod:`~gyre.proxy.intake` (a body to a prepared call);
* one call: :mod:`~gyre.proxy.engines` (engine adapters), :mod:`~gyre.proxy.router` (routes,
  transparent retry), :mod:`~gyre.proxy.model_call` (one generation and its consumers),
  :mod:`~gyre.proxy.retries` (client retries and the memory kept for them),
  :mod:`~gyre.proxy.commits` (each call's record, stored then inserted),
  :mod:`~gyre.proxy.recorder` (group-committed record writes);
* the server: :mod:`~gyre.proxy.config` (settings), :mod:`~gyre.proxy.server` (the FastAPI
  server), :mod:`~gyre.proxy.admin` (executions, admin routes), :mod:`~gyre.proxy.gc_policy`
  (garbage collector and heap policy), :mod:`~gyre.proxy.workers` (rank 0's proxy as K
  processes) and :mod:`~gyre.proxy.serve` (``tools/serve_rollout.py``).

The names below are imported lazily (the server pulls in FastAPI).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProxyServer": "gyre.proxy.server",
    "ProxyConfig": "gyre.proxy.config",
    "Execution": "gyre.proxy.admin",
    "ExecutionCounters": "gyre.proxy.admin",
    "Router": "gyre.proxy.router",
    "Attempt": "gyre.proxy.router",
    "GenerationFailed": "gyre.proxy.router",
    "Engine": "gyre.proxy.engines",
    "EngineChunk": "gyre.proxy.engines",
    "EngineUnavailable": "gyre.proxy.engines",
    "ClientEngine": "gyre.proxy.engines",
    "ScriptedEngine": "gyre.proxy.engines",
    "ChatRenderer": "gyre.proxy.render",
    "TitoSession": "gyre.proxy.tito",
    "PreparedInput": "gyre.proxy.tito_input",
    "Message": "gyre.proxy.messages",
    "ToolCall": "gyre.proxy.messages",
    "ChatRequest": "gyre.proxy.messages",
    "normalize": "gyre.proxy.api",
    "OutputParser": "gyre.proxy.parse",
    "parse_output": "gyre.proxy.parse",
    "classify_role": "gyre.proxy.roles",
    "ProxyError": "gyre.proxy.errors",
    "RecordSink": "gyre.proxy.recorder",
    "replay_trace": "gyre.proxy.replay",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'gyre.proxy' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
