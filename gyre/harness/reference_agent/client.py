"""A minimal OpenAI Chat Completions client (httpx) with retries.

Transient failures -- connection errors, timeouts, HTTP 408/409/425/429/5xx -- are retried
with exponential backoff (``backoff_s * 2**k``, capped at 30 s; ``retry-after`` honoured up to
the cap) and an identical body, up to ``max_retries`` times. Other HTTP errors raise
:class:`ModelAPIError`; a 400 that says the context is too long raises :class:`ContextTooLong`
(the agent compacts and tries again; Gyre's proxy answers "prompt is too long").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

__all__ = ["ChatClient", "ModelAPIError", "ContextTooLong"]

logger = logging.getLogger(__name__)

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504, 529}


class ModelAPIError(RuntimeError):
    """The model API failed for good (status and body in the message)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ContextTooLong(ModelAPIError):
    """HTTP 400 whose error says the prompt exceeds the model's context."""


def _is_context_error(text: str) -> bool:
    """Gyre's proxy says "prompt is too long"; OpenAI-style servers mention the context length."""
    t = text.lower()
    return "prompt is too long" in t or ("context" in t and any(w in t for w in ("length", "too long", "maximum",
                                                                                "exceed")))


class ChatClient:
    """POST ``{base_url}/chat/completions`` with ``Authorization: Bearer <api_key>``.

    Args:
        base_url: OpenAI-style base URL ending in ``/v1``.
        timeout_s: per-request timeout (seconds).
        sleep / transport: injectable for tests (``httpx.MockTransport``).
    """

    def __init__(self, base_url: str, api_key: str, *, timeout_s: float = 600.0, max_retries: int = 6,
                 backoff_s: float = 0.5, headers: Mapping[str, str] | None = None,
                 sleep: Callable[[float], None] = time.sleep, transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries, self.backoff_s, self.sleep = max_retries, backoff_s, sleep
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0), transport=transport, headers={
            "Authorization": f"Bearer {api_key}", **(headers or {})})
        self.requests = 0

    def close(self) -> None:
        self.http.close()

    def chat(self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One chat completion (non-streaming); returns the response JSON.

        Raises:
            ContextTooLong: the request does not fit the model's context.
            ModelAPIError: a non-retryable error, a malformed response, or retries exhausted.
        """
        payload = json.dumps(body)
        attempt = 0
        while True:
            self.requests += 1
            wait = None
            try:
                r = self.http.post(f"{self.base_url}/chat/completions", content=payload,
                                   headers={"Content-Type": "application/json", **(headers or {})})
            except httpx.TransportError as exc:
                err: str = f"{type(exc).__name__}: {exc}"
                status = None
            else:
                if r.status_code == 200:
                    try:
                        data = r.json()
                        data["choices"][0]["message"]
                    except (ValueError, KeyError, IndexError, TypeError):
                        raise ModelAPIError(f"malformed response: {r.text[:300]}", 200) from None
                    return data
                status, err = r.status_code, r.text[:500]
                if status == 400 and _is_context_error(err):
                    raise ContextTooLong(f"HTTP 400: {err}", 400)
                if status not in _RETRY_STATUS:
                    raise ModelAPIError(f"HTTP {status}: {err}", status)
                try:
                    wait = float(r.headers.get("retry-after", ""))
                except ValueError:
                    wait = None
            if attempt >= self.max_retries:
                raise ModelAPIError(f"giving up after {attempt + 1} attempts: {err}", status)
            delay = min(30.0, wait if wait is not None else self.backoff_s * 2 ** attempt)
            logger.warning("model call failed (%s); retry %d in %.1f s", err[:200], attempt + 1, delay)
            self.sleep(delay)
            attempt += 1
