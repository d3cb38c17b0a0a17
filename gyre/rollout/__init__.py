"""Rollout engines: SGLang's native HTTP API, two backends, and weight publication.

* ``engine_client.py`` -- :class:`~gyre.rollout.client.engine_client.EngineClient` and
  :class:`~gyre.rollout.client.async_client.AsyncEngineClient`, which the proxy, cells and tools use;
  ``engine_messages.py`` -- what they send and get back (typed results, errors; no I/O).
* The embedded CPU engine: ``embedded_server.py`` (HTTP app and uvicorn server,
  :class:`~gyre.rollout.embedded.server.EngineServer`) over ``embedded_engine.py`` (engine
  thread); its pure parts are ``core.py`` (continuous batching), ``prefix_cache.py``,
  ``sampling.py``, ``sglang_api.py`` and ``sglang_control_api.py`` (request parsing, response building); the model sits
  behind ``model_runner.py``; ``serve.py`` is its command line (``tools/serve_engine.py``).
* ``sglang_engine.py`` -- launches a real SGLang server with ``--sglang-*`` passthrough;
  ``sglang_weights.py`` pushes a cell's weights to it in the order SGLang needs, and
  ``sglang_protocol.py`` asks the server whether it has weight-update sessions.
* ``weights.py`` -- weight payloads and :func:`~gyre.rollout.weights.publish_weights`.

Importing this package is cheap (no torch); :func:`create_rollout_engine` picks the backend.
"""

from __future__ import annotations

import argparse


def create_rollout_engine(args: argparse.Namespace, *, host: str = "127.0.0.1", port: int | None = None):
    """The engine a cell runs, from Gyre's parsed arguments (not started; call ``.start()``).

    ``--rollout-engine embedded`` -> :class:`gyre.rollout.embedded.server.EngineServer` on ``--model-dir``
    (default: the embedded tiny model of ``--tokenizer-kind``); ``sglang`` ->
    :class:`gyre.rollout.sglang_driver.engine.SGLangEngine` with the ``--sglang-*`` flags.  Both expose
    ``start()``, ``stop()``, ``url`` and ``client()``.

    Raises:
        ValueError: unknown ``rollout_engine``.
    """
    kind = args.rollout_engine
    if kind == "sglang":
        from gyre.rollout.sglang_driver.engine import SGLangEngine

        return SGLangEngine.from_args(args, host=host, port=port)
    if kind != "embedded":
        raise ValueError(f"unknown rollout engine {kind!r} (expected embedded or sglang)")
    from gyre.embedded_model import ensure_tiny_model
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer

    model_dir = args.model_dir or str(ensure_tiny_model(args.tokenizer_kind, args.model_cache_dir))
    return EngineServer(EngineConfig(model_dir=model_dir), host=host, port=port or 0)
