"""Rollout engines: SGLang's native HTTP API, two backends, their clients and weight publication.

Package map (paths under ``gyre/rollout/``; each subpackage's own docstring says more):

* :mod:`gyre.rollout.api` -- SGLang's native API as data, no I/O: ``api/sglang_api.py`` (sampling
  parameters, ``/generate`` bodies, finish reasons, ``meta_info``), ``api/sglang_control_api.py``
  (control bodies) and ``api/request_validators.py`` (the checks both use; bad input raises
  ``ProtocolError``, HTTP 400).
* :mod:`gyre.rollout.client` -- the engine clients, which the proxy, cells and tools use:
  ``client/engine_client.py`` (:class:`~gyre.rollout.client.engine_client.EngineClient`, blocking,
  with ``flush_when_idle`` and the ``RolloutEngine`` protocol a cell's engine follows),
  ``client/async_client.py`` (:class:`~gyre.rollout.client.async_client.AsyncEngineClient`,
  aiohttp), ``client/base.py`` (what both share), ``client/messages.py`` (what they send and get
  back: typed results, errors, each call as data; no I/O), ``client/token_json.py`` (long token-id
  lists written as JSON by table lookup) and ``client/sglang_protocol.py`` (whether a server is
  SGLang, and whether it has weight-update sessions).
* :mod:`gyre.rollout.embedded` -- the embedded CPU engine: ``embedded/server.py`` (the FastAPI app
  and uvicorn server, :class:`~gyre.rollout.embedded.server.EngineServer`) binds the handlers of
  :mod:`gyre.rollout.embedded.routes` (``embedded/routes/generate.py``, ``embedded/routes/control.py``,
  ``embedded/routes/weights.py``, ``embedded/routes/kv.py``, ``embedded/routes/common.py``) over
  ``embedded/engine.py`` (the engine thread); its pure parts are ``embedded/core.py`` (continuous
  batching), ``embedded/prefix_cache.py`` and ``embedded/sampling.py``; the model sits behind
  ``embedded/model_runner.py``; ``embedded/kv_transfer.py`` is its KV payload format and Mooncake
  stage, ``embedded/config.py`` its settings and ``embedded/serve.py`` its command line
  (``tools/serve_engine.py``).
* :mod:`gyre.rollout.sglang_driver` -- a real SGLang server: ``sglang_driver/engine.py`` launches
  and stops it (and a cell's server), ``sglang_driver/flags.py`` maps ``--sglang-*`` onto SGLang's
  own flags, ``sglang_driver/launch.py`` adds the shared KV store's flags and the server's
  environment, ``sglang_driver/weights.py`` pushes a cell's weights in the order SGLang needs.
* Shared by both engines and their callers: ``weights.py`` (weight payloads and
  :func:`~gyre.rollout.weights.publish_weights`), ``weight_group.py`` (weights broadcast over a
  process group), ``tensor_bucket.py`` (weight buckets shared by memory handle) and ``ports.py``
  (free ports, listening sockets).

The subpackages import in one direction only (``sglang_driver`` and ``embedded`` use ``client``,
which uses ``api``; none uses a package above it).  Importing this package is cheap (no torch);
:func:`create_rollout_engine` picks the backend.
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
