"""The proxy's HTTP server: the three model APIs with token-in/token-out recording.

:class:`ProxyServer` (FastAPI/uvicorn, SSE through ``sse-starlette``) serves Anthropic
``/v1/messages`` (+ ``count_tokens``), ``/v1/chat/completions``, ``/v1/responses`` and
``/v1/models``, plus the admin routes (:mod:`gyre.proxy.admin`). Every ``/v1`` request carries
its execution's API key; an unknown or closed key gets 401 and touches no tree. Errors use the
API's own shape (:func:`gyre.proxy.errors.error_body`); a malformed body is a 4xx, never a 5xx.

The app runs on one event loop (:meth:`ProxyServer.start` serves from a background thread), and
every execution's state (TITO session, counters, recent calls) is read and written only on it; the
encoder pool renders new messages from what the loop read (:mod:`gyre.proxy.tito`). A call's
commit awaits the record store between building its record and inserting it into the tree, so an
execution's commits and delivery marks take its ``commit_lock`` in turn
(:class:`~gyre.proxy.commits.CallCommitter`): store order is tree order.

Around it: :mod:`gyre.proxy.config` (:class:`~gyre.proxy.config.ProxyConfig`),
:mod:`gyre.proxy.intake` (a body to a prepared call), :mod:`gyre.proxy.model_call` (one
generation and its consumers), :mod:`gyre.proxy.commits` (records) and :mod:`gyre.proxy.admin`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gyre.proxy.admin import Execution, ExecutionAdmin
from gyre.proxy.api import MODEL_PATHS, make_builder
from gyre.proxy.api.common import IdFactory
from gyre.proxy.body_check import BodyChecker
from gyre.proxy.commits import CallCommitter
from gyre.proxy.config import ProxyConfig
from gyre.proxy.errors import ProxyError, error_body
from gyre.proxy.gc_policy import CollectorPolicy, HeapTrimmer, install_arena_limit
from gyre.proxy.intake import RequestIntake
from gyre.proxy.model_call import ModelCall
from gyre.proxy.recorder import RecordSink
from gyre.proxy.render import ChatRenderer
from gyre.proxy.request_body import read_body
from gyre.proxy.retries import Preparing, RetryMemory, retry_count
from gyre.proxy.router import Attempt, Router
from gyre.rollout.client.token_json import prepare_table
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
    :meth:`mark_delivered`).

    Args:
        renderer: the model's :class:`~gyre.proxy.render.ChatRenderer`.
        router: engines and routes (a new empty :class:`~gyre.proxy.router.Router` if ``None``).
        store: durable record storage (``None``: records live only in the in-memory trees); build
            it with ``fsync_every=0``: the server decides when to fsync (``config.durability``).
        config: :class:`ProxyConfig`.
        ids: id factory for returned ids (tests).

    Public API for the main job: :meth:`register_execution`, :meth:`close_execution`,
    :meth:`set_route`, :meth:`reroute_engine`, :meth:`abort_engine`, :meth:`add_engine`,
    :meth:`counters`, :meth:`tree`, :meth:`start`/:meth:`stop`, :attr:`url`, :attr:`app`. What a
    :class:`~gyre.proxy.model_call.ModelCall` uses: :meth:`next_rid`, :meth:`commit`,
    :meth:`mark_delivered`, :meth:`release_if_finished`, :attr:`router`, :attr:`renderer`,
    :attr:`config`.
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
        super().__init__()
        self.renderer = renderer
        self.config = config or ProxyConfig()
        self.router = router or Router(retry_timeout_s=self.config.retry_timeout_s,
                                       kv_migration=self.config.kv_migration,
                                       kv_transport=self.config.kv_transport)
        self.router.on_retry = self._on_retry
        self.store = store
        self.ids = ids
        self.retry_memory = RetryMemory(self.config.retry_memory_bytes)
        self.stop_ids = renderer.stop_ids
        self._rid = 0
        # before the server's threads start: they share the C heap's arenas (gyre.proxy.gc_policy)
        install_arena_limit(self.config.malloc_arena_max)
        # the table that writes long prompts for the engine, built now rather than by the first long
        # prompt's call (it takes several MB for a moment; gyre.rollout.client.token_json)
        prepare_table(len(renderer.tokenizer))
        # tokenisation of new content runs off the event loop (the tokenizer releases the GIL)
        self._encoders = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gyre-encode")
        # very large bodies are checked by a helper process first; one thread waits on it
        self._body_checker = BodyChecker()
        self._body_checks = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-body-check")
        # one thread writes the record store in batches (group commit); fsyncs stay off the loop
        if self.config.durability not in ("flush", "fsync"):
            raise ValueError(f"durability must be 'flush' or 'fsync', got {self.config.durability!r}")
        #: builds, stores and inserts each call's record; keeps the per-call stage times
        self.committer = CallCommitter(
            RecordSink(store, fsync=self.config.durability == "fsync", fsync_interval_s=self.config.fsync_interval_s)
            if store is not None else None, self.config.policy_version)
        #: decodes, checks and prepares each request
        self.intake = RequestIntake(renderer, self.config, self._encoders, self._body_checker, self._body_checks)
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
            self.loop = loop
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
        self.committer.close()
        self._encoders.shutdown(wait=False)
        self._body_checks.shutdown(wait=False)
        self._body_checker.close()

    def __enter__(self) -> "ProxyServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ what a ModelCall uses
    def next_rid(self) -> int:
        """A new request number (the rid of a call is ``{execution_id}-{number}``)."""
        self._rid += 1
        return self._rid

    async def commit(self, call: ModelCall, delivered: bool) -> None:
        """Record a finished call (:meth:`CallCommitter.commit <gyre.proxy.commits.CallCommitter.commit>`);
        the last call of a closed execution then finalises it (route dropped, record file closed)."""
        if await self.committer.commit(call, delivered):
            self.finalise_if_idle(call.ex)

    async def mark_delivered(self, call: ModelCall) -> None:
        """A call committed undelivered reached a client whole
        (:meth:`CallCommitter.mark_delivered <gyre.proxy.commits.CallCommitter.mark_delivered>`)."""
        await self.committer.mark_delivered(call)

    # ------------------------------------------------------------------ internals
    def _on_retry(self, execution_id: str, attempt: Attempt, rerouted: bool) -> None:
        ex = self.executions.get(execution_id)
        if ex is not None:
            ex.counters.retries += 1
            if rerouted:
                ex.counters.reroutes += 1

    def _auth(self, request: Request) -> Execution:
        key = request.headers.get("x-api-key")
        if not key:
            auth = request.headers.get("authorization", "")
            if auth[:7].lower() == "bearer ":
                key = auth[7:].strip()
        ex = self.execution_for_key(key or "")
        if ex is None or ex.closed:
            raise ProxyError(401, "invalid or closed API key" if key else "missing API key")
        return ex

    async def _model_call(self, request: Request, api: str):
        ex = self._auth(request)
        slot: Preparing | None = None
        try:
            try:
                raw = await read_body(request, self.config.max_body_bytes)
            except ClientDisconnect:  # the client left while sending: nothing to answer or record
                return Response(status_code=499)
            encoding = request.headers.get("content-encoding", "")
            digest = await self.intake.digest(api, raw, encoding)
            prev = await self._retry_target(ex, digest, retry_count(request.headers))
            if prev is not None:  # a client retry: the same answer, not a second sample
                return await self._answer_retry(request, prev)
            slot = ex.recent_calls.reserve(digest)  # a retry arriving while this one is prepared waits
            body, req, parse_s, normalize_s = await self.intake.decode(api, raw, encoding)
            del raw
            headers = {k.lower(): v for k, v in request.headers.items()}
            role, meta = self.intake.classify(ex, req, headers, body)
            del body  # not held while the input is prepared and generated (req keeps what is needed)
            prep = await self.intake.prepare(ex, req)
            prep.timings["parse_s"] = parse_s
            prep.timings["normalize_s"] = normalize_s
            n_in = int(prep.input_ids.shape[0])
            sampling, capped = self.intake.sampling(req, n_in)
            meta.update(capped)
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

    async def _count_tokens(self, request: Request):
        ex = self._auth(request)
        try:
            raw = await read_body(request, self.config.max_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        _, req, _, _ = await self.intake.decode("anthropic", raw, request.headers.get("content-encoding", ""),
                                                count_tokens=True)
        prep = await self.intake.prepare(ex, req)
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
                if proxy.loop is None:
                    proxy.loop = asyncio.get_running_loop()
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

        self.add_admin_routes(app)
        return app
