"""HTTP front ends (Anthropic / OpenAI Chat / OpenAI Responses), chat-template rendering, TITO
recording, routing (DESIGN.md §3.1).

Layout (pure cores first, HTTP and threads at the edges):

* :mod:`~gyre.proxy.messages` -- the internal message form; :mod:`~gyre.proxy.normalize` -- the
  three APIs into it; :mod:`~gyre.proxy.render` -- delta rendering at message boundaries;
  :mod:`~gyre.proxy.parse` -- output tokens into reasoning/text/tool calls;
  :mod:`~gyre.proxy.tito` -- restoration + token assembly on the trajectory tree;
  :mod:`~gyre.proxy.roles` -- role classification; :mod:`~gyre.proxy.frontends` -- response
  shapes and SSE events; :mod:`~gyre.proxy.replay` -- trace replay.
* :mod:`~gyre.proxy.engines` -- engine protocol and adapters; :mod:`~gyre.proxy.router` -- routes
  and transparent retry; :mod:`~gyre.proxy.recorder` -- group-committed record writes;
  :mod:`~gyre.proxy.server` -- the FastAPI server; :mod:`~gyre.proxy.serve` --
  ``tools/serve_rollout.py``.

The names below are imported lazily (the server pulls in FastAPI).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProxyServer": "gyre.proxy.server",
    "ProxyConfig": "gyre.proxy.server",
    "Execution": "gyre.proxy.server",
    "ExecutionCounters": "gyre.proxy.server",
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
    "PreparedInput": "gyre.proxy.tito",
    "Message": "gyre.proxy.messages",
    "ToolCall": "gyre.proxy.messages",
    "ChatRequest": "gyre.proxy.messages",
    "normalize": "gyre.proxy.normalize",
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
