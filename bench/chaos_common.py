"""What every section of ``bench/chaos.py`` shares: the model paths, the environment of the
processes it starts, request bodies and headers, logging."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}
MAX_KEY = {"chat": "max_tokens", "responses": "max_output_tokens", "anthropic": "max_tokens"}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error")
CLIENT_TIMEOUT_S = 35.0


def _log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _headers(api: str, key: str) -> dict[str, str]:
    h = {"content-type": "application/json"}
    if api == "anthropic":
        h["x-api-key"] = key
    else:
        h["authorization"] = f"Bearer {key}"
    return h


def _valid(api: str, text: str = "hi", max_tokens: int = 8) -> dict:
    if api == "responses":
        return {"model": "m", "input": [{"type": "message", "role": "user", "content": text}],
                MAX_KEY[api]: max_tokens}
    return {"model": "m", "messages": [{"role": "user", "content": text}], MAX_KEY[api]: max_tokens}


def _engine_process(model: str | None = None):
    """An embedded engine (the tiny model) in a process of its own on 127.0.0.1, started."""
    from gyre.embedded_model import ensure_tiny_model
    from gyre.rollout.embedded.serve import EmbeddedEngineProcess

    return EmbeddedEngineProcess(model or str(ensure_tiny_model("local")), port=0, env=ENV, extra_args=[
        "--num-threads", "1", "--max-running-requests", "8"]).start(timeout=300)


def _in_process_proxy(tmp: Path, *, cap: int, retry_timeout_s: float = 30.0, max_context: int = 4096,
                      engine_process: bool = False, **config):
    """An embedded engine and a ProxyServer in this process, both on 127.0.0.1; with
    ``engine_process`` the engine runs in a process of its own (``python -m gyre.rollout.embedded.serve``),
    so that this process's memory is the proxy's alone. ``config``: more
    :class:`~gyre.proxy.server.ProxyConfig` fields; those this version of ProxyConfig lacks are left
    out."""
    import dataclasses

    from gyre.embedded_model import ensure_tiny_model, load_tokenizer
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer
    from gyre.trajectory.store import TrajectoryStore

    model = ensure_tiny_model("local")
    if engine_process:
        engine = _engine_process(str(model))
    else:
        engine = EngineServer(EngineConfig(model_dir=str(model), max_running_requests=8)).start()
    store = TrajectoryStore(tmp, fsync_every=0)
    have = {f.name for f in dataclasses.fields(ProxyConfig)}
    srv = ProxyServer(ChatRenderer(load_tokenizer(model)), store=store,
                      config=ProxyConfig(max_context_tokens=max_context, max_tokens_cap=cap, default_max_tokens=cap,
                                         retry_timeout_s=retry_timeout_s,
                                         **{k: v for k, v in config.items() if k in have}))
    srv.add_engine(ClientEngine(AsyncEngineClient(engine.url), "engine-0"))
    srv.start()
    return engine, srv, store
