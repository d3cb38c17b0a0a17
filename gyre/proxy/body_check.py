"""Checking a very large request body in a helper process, off the proxy's event loop.

Decoding a request body holds the interpreter lock for as long as it takes: a 33 MB body costs
0.1-0.5 s of JSON parsing, during which no other execution's call makes progress, and several
such bodies at once queue every small call behind them. So the proxy sends a body of at least
``ProxyConfig.body_check_bytes`` to :class:`BodyChecker` first: one long-lived helper process
(``python -m gyre.proxy.body_check``) decodes it under the request limits of
:mod:`gyre.proxy.request_body`, normalises it and runs the prompt-size bound of
:mod:`gyre.proxy.prompt_size`, and answers with the proxy error the body earns (invalid JSON,
nesting too deep, invalid fields, too many messages, a prompt too long by its size alone) or
with "go ahead". A refused body is never
parsed in the proxy's process; an accepted one is then parsed there as usual (a legitimate
conversation of 700k tokens is about 3 MB, under the default threshold of 8 MB).

Protocol on the helper's pipes: per body, one JSON header line ``{"api", "encoding",
"max_context_tokens", "token_bytes", "size", "limits", "kept"}`` (``kept``: the renderer's probed
``kept_parts``, so that the helper counts what the proxy would) and ``size`` raw bytes on stdin; one JSON line
back, ``{"ok": true}`` or ``{"status", "message", "param"}``. The helper starts on the first
large body; if it dies or answers nonsense, the body is checked in the proxy as before and the
next large body starts a new helper.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import threading
from typing import Any, Collection

from gyre.proxy.errors import ProxyError
from gyre.proxy.request_body import RequestLimits

logger = logging.getLogger(__name__)

__all__ = ["BodyChecker", "check_body"]


def check_body(api: str, raw: bytes, encoding: str, max_context_tokens: int, token_bytes: int,
               kept: Collection[str], limits: RequestLimits | None = None) -> dict[str, Any]:
    """The helper's verdict on one body: ``{"ok": True}`` or the :class:`ProxyError` it earns
    (under ``limits``, :mod:`gyre.proxy.request_body`; the size bound counts the parts in ``kept``,
    :func:`gyre.proxy.prompt_size.check_prompt_size`)."""
    from gyre.proxy.api import normalize
    from gyre.proxy.prompt_size import check_prompt_size
    from gyre.proxy.request_body import check_body_counts, check_request_counts, decode_json

    limits = limits or RequestLimits()
    try:
        body = decode_json(raw, encoding, limits)
        check_body_counts(body, limits)
        req = normalize(api, body)
        check_request_counts(req, limits)
        check_prompt_size(req, max_context_tokens, token_bytes=token_bytes, kept=kept)
    except ProxyError as exc:
        return {"status": exc.status, "message": exc.message, "param": exc.param}
    except Exception:  # anything else is the proxy's to find and report, in its own process
        return {"ok": True}
    return {"ok": True}


class BodyChecker:
    """A helper process that checks large bodies (module docstring); thread-safe, blocking calls
    (the proxy runs :meth:`check` in a worker thread)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", "gyre.proxy.body_check"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self._proc

    def check(self, api: str, raw: bytes, encoding: str, max_context_tokens: int, token_bytes: int,
              kept: Collection[str], limits: RequestLimits | None = None) -> None:
        """Raise the :class:`ProxyError` the body earns; return when it may go ahead (or when the
        helper failed: the proxy then checks it itself)."""
        with self._lock:
            try:
                proc = self._start()
                head = {"api": api, "encoding": encoding, "max_context_tokens": max_context_tokens,
                        "token_bytes": token_bytes, "size": len(raw),
                        "limits": dataclasses.asdict(limits or RequestLimits()), "kept": sorted(kept)}
                proc.stdin.write(json.dumps(head).encode() + b"\n")
                proc.stdin.write(raw)
                proc.stdin.flush()
                verdict = json.loads(proc.stdout.readline())
            except (OSError, ValueError) as exc:
                logger.warning("body check helper failed (%s: %s); checking in the proxy", type(exc).__name__, exc)
                self._kill()
                return
        if not verdict.get("ok"):
            raise ProxyError(int(verdict["status"]), str(verdict["message"]), param=verdict.get("param"))

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the helper (closing its stdin ends it; killed if it does not end within 5 s)."""
        with self._lock:
            if self._proc is None:
                return
            try:
                self._proc.stdin.close()
                self._proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._kill()


def main() -> int:
    """The helper: answer bodies from stdin until it closes."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        line = stdin.readline()
        if not line:
            return 0
        head = json.loads(line)
        raw = stdin.read(head["size"])
        verdict = check_body(head["api"], raw, head["encoding"], head["max_context_tokens"], head["token_bytes"],
                             frozenset(head["kept"]), RequestLimits(**head.get("limits", {})))
        stdout.write(json.dumps(verdict).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
