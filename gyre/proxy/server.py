"""The proxy's HTTP server: the three model APIs with token-in/token-out recording.

:class:`ProxyServer` (FastAPI/uvicorn, SSE through ``sse-starlette``) serves Anthropic
``/v1/messages`` (+ ``count_tokens``), ``/v1/chat/completions``, ``/v1/responses`` and
``/v1/models``, plus the admin routes (:mod:`gyre.proxy.admin`). Every ``/v1`` request carries
its execution's API key; an unknown or closed key gets 401 and touches no tree. Errors use the
API's own shape (:func:`gyre.proxy.errors.error_body`); a malformed body is a 4xx, never a 5xx.

The app runs on one event loop (:meth:`ProxyServer.start` serves from a background thread);
TITO state is read and written only on it (many new messages are rendered in the encoder pool from
what the loop read, see :mod:`gyre.proxy.tito`), so per-execution state needs no lock.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gyre.proxy.admin import Execution, ExecutionAdmin
from gyre.proxy.api import MODEL_PATHS, make_builder, normalize
from gyre.proxy.api.common import IdFactory, check_engine_sampling
from gyre.proxy.body_check import BodyChecker
from gyre.proxy.errors import ProxyError, error_body
from gyre.proxy.gc_policy import CollectorPolicy, HeapTrimmer
from gyre.proxy.messages import ChatRequest
from gyre.proxy.model_call import ModelCall
from gyre.proxy.prompt_size import check_prompt_size, max_token_bytes
from gyre.proxy.recorder import RecordSink
from gyre.proxy.render import ChatRenderer
from gyre.proxy.request_body import (RequestLimits, check_body_counts, check_request_counts, decode_json, inflate,
                                     read_body)
from gyre.proxy.retries import Preparing, RetryMemory, request_digest, retry_count
from gyre.proxy.roles import classify_role, harness_metadata
from gyre.proxy.router import Attempt, Router
from gyre.trajectory.store import TrajectoryStore

__all__ = ["ProxyConfig", "ProxyServer"]

logger = logging.getLogger(__name__)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (its transports and scheduling cost less CPU
    per request), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@dataclass(slots=True)
class ProxyConfig:
    """Proxy settings.

    * ``model_name`` -- name listed by ``/v1/models``.
    * ``default_max_tokens`` -- ``max_new_tokens`` when a request gives none (tokens).
    * ``max_tokens_cap`` -- upper bound on every call's ``max_new_tokens`` (tokens): a request
      asking for more gets the cap, and its record's metadata says so (``max_tokens_capped``:
      ``{"requested", "applied", "by"}``). The main job and ``serve_rollout`` set it (and
      ``default_max_tokens``) from ``--rollout-max-new-tokens``.
    * ``max_context_tokens`` -- prompt + output limit (tokens); longer prompts get 400
      ``"prompt is too long"`` (the phrase harnesses react to by compacting), and a call's
      output is cut to the room the prompt leaves (``by: "context"``). The main job and
      ``serve_rollout`` set it from ``--rollout-max-context-tokens``.
    * ``restore_reasoning`` -- see :class:`~gyre.proxy.tito.TitoSession`.
    * ``retry_timeout_s`` -- give up a generation after this long (seconds) -> 503/529.
    * ``kv_migration`` -- a request retried on another engine first copies its input's KV there,
      and an execution's context follows every route change (:class:`~gyre.proxy.router.Router`;
      engines that move KV payloads only); ``kv_transport`` -- ``"mooncake"`` (engine to engine,
      HTTP as the fallback) or ``"http"`` (through the proxy).
    * ``delivery_timeout_s`` -- how long a finished stream may take to be sent (seconds).
    * ``retry_memory_bytes`` -- the answers of committed calls kept for client retries (the last
      4 calls of each execution, :mod:`gyre.proxy.retries`), all executions together, at most
      (bytes); beyond it the oldest are forgotten. The default holds 1,152 executions x 4 calls
      of 2,000-token answers in the costliest mode (Responses, streamed) twice over (what
      ``bench/retry_memory.py`` measured is in docs/proxy.md).
    * ``sse_ping_s`` -- SSE keep-alive comment interval (seconds).
    * ``stream_hold_s`` -- how long a streamed call waits for the engine's first output before
      the response starts (seconds): an engine refusal or a failure within that time is
      answered with its HTTP status instead of a 200 stream that ends in an error event.
    * ``admin_token`` -- bearer token required on ``/gyre/*`` (``None``: open, for 127.0.0.1).
    * ``policy_version`` -- fallback version when engines report none.
    * ``default_sampling`` -- SGLang sampling params used when a request leaves them unset
      (e.g. ``{"temperature": 1.0}``); ``forced_sampling`` -- params that override the request.
    * ``durability`` -- when a call's record counts as stored (it always is before the response
      completes): ``"flush"`` (default) once written to the OS -- it survives a crash of the
      process; files are fsynced every ``fsync_interval_s`` seconds in the background -- or
      ``"fsync"``: fsynced too (group commit, :class:`~gyre.proxy.recorder.RecordSink`), which
      adds a disk sync to every call's latency. Give the server a store with ``fsync_every=0``.
    * ``max_body_bytes`` -- the largest model-call body (bytes), as declared, as received and after
      gzip/deflate decoding (413); ``max_json_depth`` -- nesting of its arrays and objects;
      ``max_messages``, ``max_tools``, ``max_tool_results`` (in one turn) -- per request (400).
      Sized from the paper's workload: a 1M-token conversation is 4-6 MB of JSON, a harness
      session of hundreds of calls a few thousand messages (:mod:`gyre.proxy.request_body`).
    * ``body_check_bytes`` -- a model-call body at least this large (after decoding) is checked in a
      helper process before the proxy parses it (:mod:`gyre.proxy.body_check`); 0 turns that off.
    * ``gc_freeze_after_ms`` -- after a full garbage collection at least this long (ms), the
      objects that survived it are frozen (:mod:`gyre.proxy.gc_policy`; ``None``: never);
      ``gc_unfreeze_interval_s`` -- how often they are handed back to the collector;
      ``heap_trim_interval_s`` -- how often the C heap's free pages go back to the operating
      system (:class:`~gyre.proxy.gc_policy.HeapTrimmer`; ``None``: never). The first server of
      a process sets them for the whole process.
    """

    model_name: str = "gyre"
    default_max_tokens: int = 1024
    max_tokens_cap: int = 32768
    max_context_tokens: int = 131072
    restore_reasoning: bool = True
    retry_timeout_s: float = 600.0
    kv_migration: bool = False
    kv_transport: str = "mooncake"
    delivery_timeout_s: float = 300.0
    retry_memory_bytes: int = 512 << 20
    sse_ping_s: float = 15.0
    stream_hold_s: float = 30.0
    admin_token: str | None = None
    policy_version: int = 0
    default_sampling: dict[str, Any] = field(default_factory=dict)
    forced_sampling: dict[str, Any] = field(default_factory=dict)
    durability: str = "flush"
    fsync_interval_s: float = 1.0
    max_body_bytes: int = 32 << 20
    max_json_depth: int = 128
    max_messages: int = 20_000
    max_tools: int = 1_024
    max_tool_results: int = 2_048
    body_check_bytes: int = 8 << 20
    gc_freeze_after_ms: float | None = 20.0
    gc_unfreeze_interval_s: float = 1800.0
    heap_trim_interval_s: float | None = 60.0

    def request_limits(self) -> RequestLimits:
        """The per-request limits of these settings."""
        return RequestLimits(self.max_body_bytes, self.max_json_depth, self.max_messages, self.max_tools,
                             self.max_tool_results)

    def with_limits(self, limits: RequestLimits) -> "ProxyConfig":
        """These settings with the per-request limits of ``limits``."""
        return dataclasses.replace(self, **dataclasses.asdict(limits))


class ProxyServer(ExecutionAdmin):
    """The proxy.

    Endpoints: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic),
    ``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET /v1/models[/{id}]`` (both SDKs'
    list shapes in one body). The key comes as ``x-api-key`` or ``Authorization: Bearer``.

    One model call: normalise (:mod:`gyre.proxy.api`) -> classify its role -> TITO prepare
    (restore, match, assemble ``input_ids``) -> :meth:`Router.generate` (engine, transparent
    retry) -> parse output tokens as they arrive -> the API's response (SSE events as tokens
    arrive). The record is committed (store, then tree) *before* the closing events or the plain
    body go out, so the harness's next request always finds it. It is ``delivered`` when the
    client is still connected at that point; a client that left earlier leaves a
    ``delivered=false`` record (the generation runs in its own task). A client retry of the
    same bytes joins the call or gets its answer instead of a new sample, and a record stored
    undelivered whose answer a retry then receives is marked delivered (:mod:`gyre.proxy.retries`,
    :meth:`_mark_delivered`).

    Args:
        renderer: the model's :class:`~gyre.proxy.render.ChatRenderer`.
        router: engines and routes (a new empty :class:`~gyre.proxy.router.Router` if ``None``).
        store: durable record storage (``None``: records live only in the in-memory trees); build
            it with ``fsync_every=0``: the server decides when to fsync (``config.durability``).
        config: :class:`ProxyConfig`.
        ids: id factory for returned ids (tests).

    Public API for the main job: :meth:`register_execution`, :meth:`close_execution`,
    :meth:`set_route`, :meth:`reroute_engine`, :meth:`abort_engine`, :meth:`add_engine`,
    :meth:`counters`, :meth:`tree`, :meth:`start`/:meth:`stop`, :attr:`url`, :attr:`app`.
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        router: Router | None = None,
        *,
        store: TrajectoryStore | None = None,
        config: ProxyConfig | None = None,
        ids: IdFactory | None = None,
    ) -> None:
        self.renderer = renderer
        self.config = config or ProxyConfig()
        self.limits = self.config.request_limits()
        self.router = router or Router(retry_timeout_s=self.config.retry_timeout_s,
                                       kv_migration=self.config.kv_migration,
                                       kv_transport=self.config.kv_transport)
        self.router.on_retry = self._on_retry
        self.store = store
        self.ids = ids
        self.executions: dict[str, Execution] = {}
        self.retry_memory = RetryMemory(self.config.retry_memory_bytes)
        self._by_key: dict[str, Execution] = {}
        self.stop_ids = renderer.stop_ids
        self._rid = 0
        self._rr = 0
        #: per-call CPU stage times (seconds): parse_s, normalize_s, match_s, render_s, record_s,
        #: with input_tokens and rendered_tokens (bounded; ``GET /gyre/stats``)
        self.stage_times: collections.deque[dict[str, float]] = collections.deque(maxlen=100_000)
        self.stages_recorded = 0  #: stage-time entries ever appended (the last 100k are kept)
        self._loop: asyncio.AbstractEventLoop | None = None
        # tokenisation of new content runs off the event loop (the tokenizer releases the GIL)
        self._encoders = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gyre-encode")
        # very large bodies are checked by a helper process first; one thread waits on it
        self._body_checker = BodyChecker()
        self._body_checks = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-body-check")
        # one thread writes the record store in batches (group commit); fsyncs stay off the loop
        if self.config.durability not in ("flush", "fsync"):
            raise ValueError(f"durability must be 'flush' or 'fsync', got {self.config.durability!r}")
        self._sink = (RecordSink(store, fsync=self.config.durability == "fsync",
                                 fsync_interval_s=self.config.fsync_interval_s) if store is not None else None)
        self._thread: threading.Thread | None = None
        self._server = None
        self.host, self.port = "127.0.0.1", 0
        self.app = self._build_app()
        # the process's collector: pauses reported by GET /gyre/stats, old objects frozen
        self._gc = CollectorPolicy.install(self.config.gc_freeze_after_ms, self.config.gc_unfreeze_interval_s)
        self._heap = HeapTrimmer.install(self.config.heap_trim_interval_s)

    # ------------------------------------------------------------------ serving
    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        return f"http://{self.host}:{self.port}"

    def start(self, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
              timeout: float = 30.0) -> "ProxyServer":
        """Serve in a background thread (uvicorn); return once requests are accepted.

        Raises:
            RuntimeError: the server did not start within ``timeout`` seconds.
        """
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit TCP_NODELAY: without it a response written in two parts
        # (headers, body) waits for the client's delayed ACK (Nagle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
        self.host, self.port = host, sock.getsockname()[1]
        cfg = uvicorn.Config(self.app, log_level=log_level, access_log=False, lifespan="off",
                             timeout_keep_alive=75, timeout_graceful_shutdown=5)

        class _Server(uvicorn.Server):
            def capture_signals(self):  # the owner handles signals
                import contextlib

                return contextlib.nullcontext()

        self._server = _Server(cfg)
        self._sock = sock

        def run() -> None:
            loop = _new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(sock))
            finally:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name="gyre-proxy-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("proxy HTTP server failed to start")
            time.sleep(0.01)
        return self

    async def _serve(self, sock) -> None:
        async def gc_ticks() -> None:
            while True:
                await asyncio.sleep(0.5)
                self._gc.tick()
                if self._heap.due():
                    await asyncio.get_running_loop().run_in_executor(None, self._heap.trim)

        if self.config.gc_freeze_after_ms is not None:
            self._gc.freeze_now()
        ticks = asyncio.ensure_future(gc_ticks())
        try:
            await self._server.serve(sockets=[sock])
        finally:
            ticks.cancel()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop a server started with :meth:`start`; closes the store's open files."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if getattr(self, "_sock", None) is not None:
            self._sock.close()
        if self._sink is not None:
            self._sink.close()
        self._encoders.shutdown(wait=False)
        self._body_checks.shutdown(wait=False)
        self._body_checker.close()

    def __enter__(self) -> "ProxyServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def _on_retry(self, execution_id: str, attempt: Attempt, rerouted: bool) -> None:
        ex = self.executions.get(execution_id)
        if ex is not None:
            ex.counters.retries += 1
            if rerouted:
                ex.counters.reroutes += 1

    async def _commit(self, call: ModelCall, delivered: bool) -> None:
        """Build the record, append it to the store on the writer thread (fsync off the event
        loop), then insert it into the tree; serialised per execution so that store order =
        tree order."""
        ex = call.ex
        segs = [{"engine_id": a.engine_id, "rid": a.rid, "tokens": a.tokens, "outcome": a.outcome,
                 "weight_version": a.weight_version, **({"migrated_tokens": a.migrated_tokens}
                                                        if a.migrated_tokens else {})} for a in call.attempts]
        versions = [a.weight_version for a in call.attempts if a.weight_version is not None and a.tokens > 0]
        version = min(versions) if versions else (
            next((a.weight_version for a in reversed(call.attempts) if a.weight_version is not None), None))
        meta = dict(call.meta)
        meta.update({"rid": call.rid, "model": call.req.model, "attempts": segs,
                     "retries": max(0, len(call.attempts) - 1), "reused_tokens": call.prep.reused_tokens,
                     "malformed_tool_calls": call.parser.result().malformed, "stream": call.req.stream})
        t_end = time.perf_counter()
        timings = {"total_s": t_end - call.t0, **call.prep.timings}
        if call.t_first is not None:
            timings["first_token_s"] = call.t_first - call.t0
        out_msg = call.builder.output_message() if delivered else None
        async with ex.commit_lock:
            t_rec = time.perf_counter()
            session = ex.session
            try:
                rec = session.build_record(
                    call.prep, output_ids=call.out_ids, output_logprobs=call.logprobs, finish_reason=call.finish,
                    role=call.role, delivered=delivered,
                    policy_version=version if version is not None else self.config.policy_version,
                    engine_id=call.attempts[-1].engine_id if call.attempts else "", timings=timings, metadata=meta)
                if self._sink is not None:
                    await asyncio.wrap_future(self._sink.submit(rec))
                session.insert(call.prep, rec, out_msg)
            except Exception:
                logger.exception("could not record call %s of %s", call.rid, ex.execution_id)
                return
            call.recorded, call.call_index = delivered, rec.call_index
        st = dict(call.prep.timings)
        st["record_s"] = time.perf_counter() - t_rec
        st["input_tokens"] = int(call.prep.input_ids.shape[0])
        st["rendered_tokens"] = call.prep.rendered_tokens
        self.stage_times.append(st)
        self.stages_recorded += 1
        c = ex.counters
        c.calls += 1
        c.delivered += int(delivered)
        c.undelivered += int(not delivered)
        c.input_tokens += int(call.prep.input_ids.shape[0])
        c.output_tokens += len(call.out_ids)
        c.reused_tokens += call.prep.reused_tokens
        c.rendered_tokens += call.prep.rendered_tokens
        c.restored_tool_calls += call.prep.restored_calls
        c.malformed_tool_calls += call.parser.result().malformed
        if ex.closed and c.inflight == 0:
            self._finalise(ex)

    async def _mark_delivered(self, call: ModelCall) -> None:
        """The answer of ``call``, committed undelivered, reached a client whole (a retry got
        it): the delivery mark is stored, then applied to the tree and the restoration cache
        (:meth:`~gyre.proxy.tito.TitoSession.mark_delivered`); serialised with the execution's
        commits, so that store order = tree order."""
        ex = call.ex
        async with ex.commit_lock:
            if call.recorded is not False or ex.session.tree is None:
                return
            try:
                if self._sink is not None:
                    await asyncio.wrap_future(self._sink.mark_delivered(ex.execution_id, call.call_index))
                ex.session.mark_delivered(call.call_index, call.output_message)
            except Exception:
                logger.exception("could not mark call %s of %s delivered", call.rid, ex.execution_id)
                return
            call.recorded, call.output_message = True, None
            ex.counters.delivered += 1
            ex.counters.undelivered -= 1

    def _auth(self, request: Request) -> Execution:
        key = request.headers.get("x-api-key")
        if not key:
            auth = request.headers.get("authorization", "")
            if auth[:7].lower() == "bearer ":
                key = auth[7:].strip()
        ex = self._by_key.get(key or "")
        if ex is None or ex.closed:
            raise ProxyError(401, "invalid or closed API key" if key else "missing API key")
        return ex

    async def _prepare(self, ex: Execution, req: ChatRequest, headers: dict[str, str], body: Any = None):
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
        if role not in ("main", "subagent", "compaction", "auxiliary", "evaluator"):
            role = classify_role(req, headers, harness)
        meta = harness_metadata(headers, harness)
        meta["api"] = req.api
        if ex.task_id is not None:
            meta["task_id"] = ex.task_id
        try:
            prep = await ex.session.prepare_async(req, self._encoders)
        except Exception as exc:  # RenderError, or jinja errors (e.g. raise_exception in the template)
            raise ProxyError(400, f"cannot render the conversation with the model's chat template: {exc}") from None
        return role, meta, prep

    async def _check_large_body(self, api: str, raw: bytes | bytearray) -> None:
        """Raise the error a very large body earns, found by the helper process, so that the
        event loop never parses a body it would refuse."""
        loop = asyncio.get_running_loop()
        token_bytes = await loop.run_in_executor(self._encoders, max_token_bytes, self.renderer.tokenizer)
        await loop.run_in_executor(self._body_checks, self._body_checker.check, api, raw, "",
                                   self.config.max_context_tokens, token_bytes, self.renderer.kept_parts, self.limits)

    async def _decode(self, api: str, raw: bytes | bytearray, encoding: str, *,
                      count_tokens: bool = False) -> tuple[Any, ChatRequest, float, float]:
        """``(body, request, parse_s, normalize_s)`` of a received body, under the request limits
        (:mod:`gyre.proxy.request_body`): a compressed body is inflated off the event loop with
        an output limit, a very large one is checked by the helper process first, then it is
        parsed, normalised and its counts and size bounded. Raises :class:`ProxyError`."""
        limits = self.limits
        if encoding.strip().lower() not in ("", "identity"):
            raw = await asyncio.get_running_loop().run_in_executor(None, inflate, raw, encoding,
                                                                   limits.max_body_bytes)
        if 0 < self.config.body_check_bytes <= len(raw):
            await self._check_large_body(api, raw)
        t0 = time.perf_counter()
        body = decode_json(raw, "", limits)
        t1 = time.perf_counter()
        check_body_counts(body, limits)
        if count_tokens and isinstance(body, dict) and "max_tokens" not in body:
            body = dict(body, max_tokens=1)
        req = normalize(api, body)
        check_request_counts(req, limits)
        check_prompt_size(req, self.config.max_context_tokens, self.renderer.tokenizer, kept=self.renderer.kept_parts)
        return body, req, t1 - t0, time.perf_counter() - t1

    async def _model_call(self, request: Request, api: str):
        ex = self._auth(request)
        slot: Preparing | None = None
        try:
            try:
                raw = await read_body(request, self.config.max_body_bytes)
            except ClientDisconnect:  # the client left while sending: nothing to answer or record
                return Response(status_code=499)
            encoding = request.headers.get("content-encoding", "")
            # hashing tens of MB off the loop (xxhash releases the GIL)
            if 0 < self.config.body_check_bytes <= len(raw):
                digest = await asyncio.get_running_loop().run_in_executor(self._body_checks, request_digest, api,
                                                                          raw, encoding)
            else:
                digest = request_digest(api, raw, encoding)
            prev = await self._retry_target(ex, digest, retry_count(request.headers))
            if prev is not None:  # a client retry: the same answer, not a second sample
                return await self._answer_retry(request, prev)
            slot = ex.recent_calls.reserve(digest)  # a retry arriving while this one is prepared waits
            body, req, parse_s, normalize_s = await self._decode(api, raw, encoding)
            del raw
            headers = {k.lower(): v for k, v in request.headers.items()}
            role, meta, prep = await self._prepare(ex, req, headers, body)
            prep.timings["parse_s"] = parse_s
            prep.timings["normalize_s"] = normalize_s
            n_in = int(prep.input_ids.shape[0])
            room = self.config.max_context_tokens - n_in
            if room <= 0:
                limit = self.config.max_context_tokens - 1
                raise ProxyError(400, f"prompt is too long: {n_in} tokens > {limit} maximum")
            cfg = self.config
            sampling = req.sampling.to_sglang(cfg.default_max_tokens, min(cfg.max_tokens_cap, room),
                                              cfg.default_sampling, cfg.forced_sampling)
            check_engine_sampling(sampling)
            meta.update(self._capped(req, sampling, room))
            if not req.model:
                req.model = self.config.model_name
            builder = make_builder(req, n_in, self.ids)
            call = ModelCall(self, ex, req, prep, role, meta, sampling, builder)
        except BaseException as exc:
            if slot is not None:
                ex.recent_calls.abandon(digest, slot, exc)
            if isinstance(exc, ProxyError):
                ex.counters.rejected += 1
            raise
        ex.recent_calls.add(digest, call, slot)
        task = asyncio.create_task(call.run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if req.stream:
            return await self._stream(call, joined=False)
        await call.done.wait()
        return await self._body(request, call)

    @staticmethod
    async def _retry_target(ex: Execution, digest: bytes, retries: int) -> ModelCall | None:
        """The call a request repeats (:meth:`~gyre.proxy.retries.RecentCalls.retry_target`); a
        repeat of a request still being prepared waits for the call it becomes.

        Raises:
            ProxyError: the first copy's preparation refused it (the same error).
        """
        while True:
            prev = ex.recent_calls.retry_target(digest, retries)
            if not isinstance(prev, Preparing):
                return prev
            call = await prev.wait()
            if call is not None:
                return call

    async def _stream(self, call: ModelCall, joined: bool):
        # hold the response until the engine answers, so that a refusal is a status, not a 200
        try:
            await asyncio.wait_for(call.engine_answered.wait(), self.config.stream_hold_s)
        except asyncio.TimeoutError:
            pass
        if call.error is not None:
            call.detach()
            raise call.error
        return EventSourceResponse(call.sse(joined=joined), ping=self.config.sse_ping_s, sep="\n",
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _body(self, request: Request, call: ModelCall):
        """A finished call's non-streamed answer; the record is stored (or marked delivered,
        :meth:`ModelCall.deliver`) before it goes out."""
        if call.error is not None:
            call.detach()
            raise call.error
        if await request.is_disconnected():
            call.detach()  # undelivered unless a joined retry receives it
            return Response(status_code=499)
        body = call.body()
        await call.deliver()
        return Response(body, media_type="application/json")

    async def _answer_retry(self, request: Request, call: ModelCall):
        """A client retry of ``call``: it joins the generation (or gets its finished answer)."""
        call.join()
        call.ex.counters.joined_retries += 1
        if call.stream:
            return await self._stream(call, joined=True)
        await call.done.wait()
        return await self._body(request, call)

    def _capped(self, req: ChatRequest, sampling: dict[str, Any], room: int) -> dict[str, Any]:
        """Record metadata for limits the operator's caps applied to this call: the requested
        and applied ``max_tokens`` (``by`` ``"max_tokens_cap"`` or ``"context"``), and
        ``min_tokens`` when it was cut to the applied limit."""
        out: dict[str, Any] = {}
        cfg = self.config
        requested = req.sampling.requested_max_tokens(cfg.default_max_tokens, cfg.forced_sampling)
        applied = int(sampling["max_new_tokens"])
        if requested > applied:
            by = "max_tokens_cap" if applied == cfg.max_tokens_cap and cfg.max_tokens_cap <= room else "context"
            out["max_tokens_capped"] = {"requested": requested, "applied": applied, "by": by}
        want_min = cfg.forced_sampling.get("min_new_tokens", req.sampling.min_tokens)
        if isinstance(want_min, int) and want_min > int(sampling.get("min_new_tokens") or 0):
            out["min_tokens_capped"] = {"requested": want_min, "applied": int(sampling.get("min_new_tokens") or 0)}
        return out

    async def _count_tokens(self, request: Request):
        ex = self._auth(request)
        try:
            raw = await read_body(request, self.config.max_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        _, req, _, _ = await self._decode("anthropic", raw, request.headers.get("content-encoding", ""),
                                          count_tokens=True)
        _, _, prep = await self._prepare(ex, req, {k.lower(): v for k, v in request.headers.items()})
        return JSONResponse({"input_tokens": int(prep.input_ids.shape[0])})

    def _models_body(self) -> dict[str, Any]:
        name = self.config.model_name
        model = {"id": name, "object": "model", "created": 0, "owned_by": "gyre",
                 "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        return {"object": "list", "data": [model],
                "has_more": False, "first_id": name, "last_id": name}

    @staticmethod
    def _api_of(request: Request) -> str:
        path = request.url.path
        if path.startswith("/v1/messages"):
            return "anthropic"
        if path.startswith("/v1/responses"):
            return "responses"
        if path.startswith("/v1/chat"):
            return "chat"
        if request.headers.get("anthropic-version") or request.headers.get("x-api-key"):
            return "anthropic"
        return "chat"

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Gyre proxy", docs_url=None, redoc_url=None, openapi_url=None)
        self._tasks: set[asyncio.Task] = set()

        @app.exception_handler(ProxyError)
        async def _proxy_error(request: Request, exc: ProxyError):
            return JSONResponse(error_body(self._api_of(request), exc.status, exc.message, exc.param),
                                status_code=exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException):
            return JSONResponse(error_body(self._api_of(request), exc.status_code, str(exc.detail)),
                                status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def _internal(request: Request, exc: Exception):
            logger.exception("unhandled error on %s", request.url.path)
            return JSONResponse(error_body(self._api_of(request), 500, f"internal error: {type(exc).__name__}"),
                                status_code=500)

        proxy = self

        class _RememberLoop:  # plain ASGI (Starlette's http middleware hides client disconnects)
            def __init__(self, inner):
                self.inner = inner

            async def __call__(self, scope, receive, send):
                if proxy._loop is None:
                    proxy._loop = asyncio.get_running_loop()
                await self.inner(scope, receive, send)

        app.add_middleware(_RememberLoop)

        def model_route(api: str):
            async def route(request: Request):
                return await self._model_call(request, api)

            return route

        for path, api in MODEL_PATHS.items():
            app.post(path)(model_route(api))

        @app.post("/v1/messages/count_tokens")
        async def count_tokens(request: Request):
            return await self._count_tokens(request)

        @app.get("/v1/models")
        async def models(request: Request):
            self._auth(request)
            return JSONResponse(self._models_body())

        @app.get("/v1/models/{model_id:path}")
        async def model(request: Request, model_id: str):
            self._auth(request)
            body = self._models_body()["data"][0]
            if model_id != body["id"]:
                raise ProxyError(404, f"model {model_id!r} not found")
            return JSONResponse(body)

        self._add_admin_routes(app)
        return app
