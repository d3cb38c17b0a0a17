"""Errors in each API's own shape: an HTTP status with the JSON error body that API's clients
expect.

Shapes (upstream docs):

* Anthropic (https://docs.anthropic.com/en/api/errors): ``{"type": "error", "error":
  {"type": "invalid_request_error", "message": "..."}}``; types
  ``invalid_request_error`` (400), ``authentication_error`` (401), ``permission_error`` (403),
  ``not_found_error`` (404), ``request_too_large`` (413), ``rate_limit_error`` (429),
  ``api_error`` (500), ``overloaded_error`` (529).
* OpenAI Chat Completions and Responses (https://platform.openai.com/docs/guides/error-codes):
  ``{"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ProxyError", "error_body", "ANTHROPIC_ERROR_TYPES"]

#: Error types both APIs give a status.
_CLIENT_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    422: "invalid_request_error",
}

ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    **_CLIENT_TYPES,
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}

_OPENAI_TYPES: dict[int, str] = {
    **_CLIENT_TYPES,
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class ProxyError(Exception):
    """A request the proxy answers with an HTTP error.

    Args:
        status: HTTP status code (4xx for bad input, 401 for unknown/closed keys, 5xx only
            for engine failures that retries could not hide).
        message: human-readable message.
        param: the offending request field (OpenAI ``param``), if known.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param


def error_body(api: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON error body of ``api`` (``"anthropic"``, ``"chat"``, ``"responses"``, ``"gyre"``)."""
    if api == "anthropic":
        etype = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": etype, "message": message}}
    etype = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": None}}
