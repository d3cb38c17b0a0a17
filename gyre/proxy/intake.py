"""A model-call request from its received bytes to a prepared call: the proxy's intake.

:class:`RequestIntake` does, for :class:`~gyre.proxy.server.ProxyServer`, everything between
reading a body and starting its generation: the digest a client retry is recognised by
(:func:`~gyre.proxy.retries.request_digest`), decoding under the request limits
(:mod:`gyre.proxy.request_body`; a very large body checked by the helper process of
:mod:`gyre.proxy.body_check` first), the call's role (:func:`choose_role`), TITO preparation
(:meth:`~gyre.proxy.tito.TitoSession.prepare_async`) and the sampling parameters with the
operator's caps (:func:`capped_metadata`). Every refusal is a :class:`~gyre.proxy.errors.ProxyError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any

from gyre.proxy.api import normalize
from gyre.proxy.api.common import check_engine_sampling
from gyre.proxy.body_check import BodyChecker
from gyre.proxy.config import ProxyConfig
from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ChatRequest
from gyre.proxy.prompt_size import check_prompt_size, max_token_bytes
from gyre.proxy.render import ChatRenderer
from gyre.proxy.request_body import check_body_counts, check_request_counts, decode_json, inflate
from gyre.proxy.retries import request_digest
from gyre.proxy.roles import classify_role, harness_metadata

if TYPE_CHECKING:  # pragma: no cover
    from gyre.proxy.admin import Execution
    from gyre.proxy.tito_input import PreparedInput

__all__ = ["RequestIntake", "choose_role", "capped_metadata", "ROLES"]

logger = logging.getLogger(__name__)

#: The roles a call may have.
ROLES = ("main", "subagent", "compaction", "auxiliary", "evaluator")


def choose_role(ex: "Execution", req: ChatRequest, headers: dict[str, str], body: Any = None) -> str:
    """A call's role: ``evaluator`` when ``x-gyre-role`` says so (Gyre's judge, never trained),
    else what the execution's role rules say, else the built-in rules
    (:func:`~gyre.proxy.roles.classify_role`); a role rule set that fails is logged and skipped."""
    harness = ex.harness if ex.harness in ("claude-code", "codex") else None
    role = None
    explicit = next((str(v).strip().lower() for k, v in headers.items() if k.lower() == "x-gyre-role"), None)
    if explicit == "evaluator":  # Gyre's judge: never trained, whatever the harness's role rules say
        role = explicit
    elif ex.role_rules is not None:
        try:
            role = ex.role_rules.classify(headers, body)
        except Exception:  # a bad rule set must not fail the call
            logger.exception("role rules of %s failed; using the built-in rules", ex.execution_id)
    if role not in ROLES:
        role = classify_role(req, headers, harness)
    return role


def capped_metadata(req: ChatRequest, sampling: dict[str, Any], room: int, cfg: ProxyConfig) -> dict[str, Any]:
    """Record metadata for limits the operator's caps applied to this call: the requested
    and applied ``max_tokens`` (``by`` ``"max_tokens_cap"`` or ``"context"``), and
    ``min_tokens`` when it was cut to the applied limit."""
    out: dict[str, Any] = {}
    requested = req.sampling.requested_max_tokens(cfg.default_max_tokens, cfg.forced_sampling)
    applied = int(sampling["max_new_tokens"])
    if requested > applied:
        by = "max_tokens_cap" if applied == cfg.max_tokens_cap and cfg.max_tokens_cap <= room else "context"
        out["max_tokens_capped"] = {"requested": requested, "applied": applied, "by": by}
    want_min = cfg.forced_sampling.get("min_new_tokens", req.sampling.min_tokens)
    if isinstance(want_min, int) and want_min > int(sampling.get("min_new_tokens") or 0):
        out["min_tokens_capped"] = {"requested": want_min, "applied": int(sampling.get("min_new_tokens") or 0)}
    return out


class RequestIntake:
    """Decodes, checks and prepares model-call requests for one proxy.

    Args:
        renderer: the model's renderer (its tokenizer sizes prompts).
        config: the proxy's settings (limits, caps, sampling defaults).
        encoders: the thread pool that tokenises new content and inflates bodies off the loop.
        body_checker: the helper process that checks very large bodies.
        body_checks: the one thread that waits on it (and hashes very large bodies).
    """

    def __init__(self, renderer: ChatRenderer, config: ProxyConfig, encoders: concurrent.futures.Executor,
                 body_checker: BodyChecker, body_checks: concurrent.futures.Executor) -> None:
        self.renderer = renderer
        self.config = config
        self.limits = config.request_limits()
        self.encoders = encoders
        self.body_checker = body_checker
        self.body_checks = body_checks

    async def digest(self, api: str, raw: bytes | bytearray, encoding: str) -> bytes:
        """The request's digest (:func:`~gyre.proxy.retries.request_digest`); a very large body is
        hashed off the event loop (xxhash releases the GIL)."""
        if 0 < self.config.body_check_bytes <= len(raw):
            return await asyncio.get_running_loop().run_in_executor(self.body_checks, request_digest, api, raw,
                                                                    encoding)
        return request_digest(api, raw, encoding)

    async def check_large_body(self, api: str, raw: bytes | bytearray) -> None:
        """Raise the error a very large body earns, found by the helper process, so that the
        event loop never parses a body it would refuse."""
        loop = asyncio.get_running_loop()
        token_bytes = await loop.run_in_executor(self.encoders, max_token_bytes, self.renderer.tokenizer)
        await loop.run_in_executor(self.body_checks, self.body_checker.check, api, raw, "",
                                   self.config.max_context_tokens, token_bytes, self.renderer.kept_parts, self.limits)

    async def decode(self, api: str, raw: bytes | bytearray, encoding: str, *,
                     count_tokens: bool = False) -> tuple[Any, ChatRequest, float, float]:
        """``(body, request, parse_s, normalize_s)`` of a received body, under the request limits
        (:mod:`gyre.proxy.request_body`): a compressed body is inflated off the event loop with
        an output limit, a very large one is checked by the helper process first, then it is
        parsed, normalised and its counts and size bounded; a ``bytearray`` body is emptied once
        its text is decoded (the caller gives ``raw`` up). Raises :class:`ProxyError`."""
        limits = self.limits
        if encoding.strip().lower() not in ("", "identity"):
            raw = await asyncio.get_running_loop().run_in_executor(None, inflate, raw, encoding,
                                                                   limits.max_body_bytes)
        if 0 < self.config.body_check_bytes <= len(raw):
            await self.check_large_body(api, raw)
        t0 = time.perf_counter()
        body = decode_json(raw, "", limits, consume=True)
        t1 = time.perf_counter()
        check_body_counts(body, limits)
        if count_tokens and isinstance(body, dict) and "max_tokens" not in body:
            body = dict(body, max_tokens=1)
        req = normalize(api, body)
        check_request_counts(req, limits)
        check_prompt_size(req, self.config.max_context_tokens, self.renderer.tokenizer, kept=self.renderer.kept_parts)
        return body, req, t1 - t0, time.perf_counter() - t1

    def classify(self, ex: "Execution", req: ChatRequest, headers: dict[str, str],
                 body: Any = None) -> tuple[str, dict[str, Any]]:
        """``(role, metadata)`` of a decoded request (headers lower-cased): the only step that reads
        the parsed body, so the caller can let it go before :meth:`prepare`."""
        harness = ex.harness if ex.harness in ("claude-code", "codex") else None
        role = choose_role(ex, req, headers, body)
        meta = harness_metadata(headers, harness)
        meta["api"] = req.api
        if ex.task_id is not None:
            meta["task_id"] = ex.task_id
        return role, meta

    async def prepare(self, ex: "Execution", req: ChatRequest) -> PreparedInput:
        """The prepared input of a decoded request; a conversation the chat template cannot render
        is a 400, and so is a prompt longer than the context, found while its new text is encoded
        (which then stops)."""
        try:
            return await ex.session.prepare_async(req, self.encoders, self.config.max_context_tokens - 1)
        except ProxyError:  # the prompt is too long
            raise
        except Exception as exc:  # RenderError, or jinja errors (e.g. raise_exception in the template)
            raise ProxyError(400, f"cannot render the conversation with the model's chat template: {exc}") from None

    def sampling(self, req: ChatRequest, n_in: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(engine sampling parameters, cap metadata)`` for a request whose input is ``n_in``
        tokens: the output is cut to the cap and to the room the context leaves. Raises
        :class:`ProxyError` (400) when no room is left or a parameter is out of the engine's range."""
        cfg = self.config
        room = cfg.max_context_tokens - n_in
        if room <= 0:
            raise ProxyError(400, f"prompt is too long: {n_in} tokens > {cfg.max_context_tokens - 1} maximum")
        sampling = req.sampling.to_sglang(cfg.default_max_tokens, min(cfg.max_tokens_cap, room),
                                          cfg.default_sampling, cfg.forced_sampling)
        check_engine_sampling(sampling)
        return sampling, capped_metadata(req, sampling, room, cfg)
