"""SGLang's native HTTP API over the embedded engine: the FastAPI app and its uvicorn server.

:func:`build_app` serves an :class:`~gyre.rollout.embedded.engine.EmbeddedEngine` through
SGLang's native routes (generation, abort, pause/continue, memory release/resume, cache flush,
weight updates and versions, health and info; bodies parsed and built by
:mod:`gyre.rollout.api.sglang_api`), whose handlers live in :mod:`gyre.rollout.embedded.routes`.
:class:`EngineServer` runs it with uvicorn on a socket, from a background thread
(:meth:`~EngineServer.start`) or the calling thread (:meth:`~EngineServer.serve_forever`, used by
:mod:`gyre.rollout.embedded.serve`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

from fastapi import FastAPI

from gyre.rollout.api.sglang_api import ProtocolError
from gyre.rollout.embedded.config import EngineConfig
from gyre.rollout.embedded.engine import EmbeddedEngine
from gyre.rollout.embedded.kv_transfer import MooncakeKVStage
from gyre.rollout.embedded.model_runner import WeightError
from gyre.rollout.embedded.routes.common import error
from gyre.rollout.embedded.routes.control import ControlRoutes
from gyre.rollout.embedded.routes.generate import GenerateRoutes
from gyre.rollout.embedded.routes.kv import KVRoutes
from gyre.rollout.embedded.routes.weights import WeightRoutes
from gyre.rollout.ports import bind_socket

_GET, _POST, _GET_POST = ["GET"], ["POST"], ["GET", "POST"]


async def _protocol_error(request, exc: ProtocolError):
    return error(str(exc))


async def _weight_error(request, exc: WeightError):
    return error(str(exc), success=False)


def build_app(engine: EmbeddedEngine, kv_stage: MooncakeKVStage | None = None):
    """FastAPI app exposing ``engine`` through SGLang's native endpoints.

    Routes (the table below): ``POST /generate`` (:mod:`~gyre.rollout.embedded.routes.generate`),
    ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
    ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/flush_cache``; ``GET
    /health``, ``/health_generate``, ``/model_info`` (also ``/get_model_info``), ``/server_info``
    (also ``/get_server_info``), ``/get_weight_version``
    (:mod:`~gyre.rollout.embedded.routes.control`); ``/update_weights_from_disk``,
    ``/update_weights_from_tensor``, ``/update_weight_version`` and the weight-update group routes
    (:mod:`~gyre.rollout.embedded.routes.weights`); Gyre's own ``/gyre/export_kv``,
    ``/gyre/import_kv`` and ``/gyre/release_kv`` (:mod:`~gyre.rollout.embedded.routes.kv`; staged
    payloads in ``kv_stage``, by default a Mooncake stage on 127.0.0.1).

    Bad input answers 400 ``{"error": {"message", "code"}}``
    (:class:`~gyre.rollout.api.sglang_api.ProtocolError`); a refused weight change 400 with
    ``"success": false`` (:class:`~gyre.rollout.embedded.model_runner.WeightError`).
    """
    app = FastAPI(title="Gyre embedded engine", openapi_url=None)
    kv_stage = kv_stage if kv_stage is not None else MooncakeKVStage()
    app.state.engine = engine
    app.add_exception_handler(ProtocolError, _protocol_error)
    app.add_exception_handler(WeightError, _weight_error)
    gen, ctl, wts, kv = GenerateRoutes(engine), ControlRoutes(engine), WeightRoutes(engine), KVRoutes(engine, kv_stage)
    routes = [
        ("/generate", gen.generate, ["POST", "PUT"]),
        ("/abort_request", ctl.abort_request, _POST),
        ("/pause_generation", ctl.pause_generation, _POST),
        ("/continue_generation", ctl.continue_generation, _POST),
        ("/release_memory_occupation", ctl.release_memory, _GET_POST),
        ("/resume_memory_occupation", ctl.resume_memory, _GET_POST),
        ("/flush_cache", ctl.flush_cache, _GET_POST),
        ("/update_weights_from_disk", wts.update_weights_from_disk, _POST),
        ("/update_weights_from_tensor", wts.update_weights_from_tensor, _POST),
        ("/update_weight_version", wts.update_weight_version, _POST),
        ("/gyre/export_kv", kv.export_kv, _POST),
        ("/gyre/import_kv", kv.import_kv, _POST),
        ("/gyre/release_kv", kv.release_kv, _POST),
        ("/init_weights_update_group", wts.init_weights_update_group, _POST),
        ("/update_weights_from_distributed", wts.update_weights_from_distributed, _POST),
        ("/destroy_weights_update_group", wts.destroy_weights_update_group, _POST),
        ("/update_weights_from_ipc", wts.update_weights_from_ipc, _POST),
        ("/health", ctl.health, _GET),
        ("/health_generate", ctl.health_generate, _GET),
        ("/get_model_info", ctl.get_model_info, _GET),
        ("/model_info", ctl.get_model_info, _GET),
        ("/get_weight_version", ctl.get_weight_version, _GET),
        ("/get_server_info", ctl.get_server_info, _GET),
        ("/server_info", ctl.get_server_info, _GET),
    ]
    for path, handler, methods in routes:
        app.add_api_route(path, handler, methods=methods)
    return app


# ---------------------------------------------------------------------------- uvicorn shell


class EngineServer:
    """An :class:`EmbeddedEngine` behind uvicorn on ``host:port``.

    ``start()`` serves from a background thread (tests, benchmarks, a cell process);
    ``serve_forever()`` serves in the calling (main) thread until :meth:`request_stop`, e.g.
    from a signal handler.  ``url`` is ``http://host:port`` once bound.
    """

    def __init__(self, config: EngineConfig | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        import uvicorn

        self.engine = EmbeddedEngine(config)
        self.sock = bind_socket(host, port)
        self.app = build_app(self.engine, MooncakeKVStage(host))
        self.host, self.port = host, self.sock.getsockname()[1]
        ucfg = uvicorn.Config(self.app, log_level=log_level, access_log=False, lifespan="off",
                              timeout_graceful_shutdown=5, timeout_keep_alive=30)

        class _Server(uvicorn.Server):
            def capture_signals(self):  # the owner handles signals
                return contextlib.nullcontext()

        self.server = _Server(ucfg)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "EngineServer":
        """Serve in a background thread; return once requests are accepted."""
        self.engine.start()
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="gyre-engine-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("embedded engine HTTP server failed to start")
            time.sleep(0.01)
        return self

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in this thread until :meth:`request_stop`; ``on_ready`` runs once accepting."""
        self.engine.start()
        if on_ready is not None:
            def watch():
                while not self.server.started and not self.server.should_exit:
                    time.sleep(0.01)
                if self.server.started:
                    on_ready()

            threading.Thread(target=watch, daemon=True).start()
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.engine.shutdown()
            self.sock.close()

    def request_stop(self) -> None:
        """Abort in-flight requests and make the server exit (safe from signal handlers)."""
        if self.engine.alive:
            self.engine.call(lambda core: (core.continue_generation(),
                                           core.abort(abort_all=True, message="engine shutting down")))
        self.server.should_exit = True

    def stop(self, timeout: float = 15.0) -> None:
        """Stop a server started with :meth:`start`."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()
        self.sock.close()

    def client(self, timeout: float | None = 600.0):
        """An :class:`~gyre.rollout.client.engine_client.EngineClient` for this server, pushing tensor
        weights by shared memory (the server is in this process)."""
        from gyre.rollout.client.engine_client import EngineClient

        return EngineClient(self.url, timeout=timeout, shared_memory_weights=True)

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
