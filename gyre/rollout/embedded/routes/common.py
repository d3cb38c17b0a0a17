"""What the embedded engine's route handlers share: JSON answers, SGLang's error body, reading a
JSON request body, and :class:`EngineRoutes` (the engine, and running a function on its thread)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi.responses import JSONResponse

from gyre.rollout.api.sglang_api import ProtocolError, error_body
from gyre.rollout.embedded.core import EngineCore
from gyre.rollout.embedded.engine import EmbeddedEngine


def json_response(content: Any, status_code: int = 200):
    return JSONResponse(content, status_code=status_code)


def error(msg: str, code: int = 400, **extra):
    """SGLang's ``{"error": {"message", "code"}}`` with status ``code``, plus ``extra`` keys."""
    body = error_body(msg, code)
    body.update(extra)
    return json_response(body, code)


async def read_json(request) -> Any:
    """The request's JSON body (``None`` when empty).

    Raises:
        ProtocolError: the body is not JSON.
    """
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("body is not valid JSON") from None


class EngineRoutes:
    """Handlers over one :class:`~gyre.rollout.embedded.engine.EmbeddedEngine`."""

    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine
        self.cfg = engine.config

    async def run(self, fn: Callable[[EngineCore], Any]) -> Any:
        """``fn(core)`` on the engine thread, between two steps; its result."""
        return await asyncio.wrap_future(self.engine.call(fn))
