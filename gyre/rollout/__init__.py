"""Rollout engines: one SGLang-native HTTP protocol, two backends, and weight publication.

* ``engine.py`` -- the client protocol the proxy, scheduler and cells use:
  :class:`~gyre.rollout.engine.EngineClient` / :class:`~gyre.rollout.engine.AsyncEngineClient`,
  typed :class:`~gyre.rollout.engine.GenerateResult` / :class:`~gyre.rollout.engine.StreamChunk`.
* ``embedded.py`` -- the CPU engine serving SGLang's native API from a torch model
  (:class:`~gyre.rollout.embedded.EngineServer`); its pure parts are ``core.py`` (continuous
  batching), ``prefix_cache.py``, ``sampling.py``, ``protocol.py``; the model sits behind
  ``model_runner.py``; ``serve.py`` is its command line (``tools/serve_engine.py``).
* ``sglang_engine.py`` -- launches a real SGLang server with ``--sglang-*`` passthrough.
* ``weights.py`` -- payloads and :func:`~gyre.rollout.weights.publish_weights`.

Importing this package is cheap (no torch); :func:`create_rollout_engine` picks the backend.
"""

from __future__ import annotations

import argparse


def create_rollout_engine(args: argparse.Namespace, *, host: str = "127.0.0.1", port: int | None = None):
    """The engine a cell runs, from Gyre's parsed arguments (not started; call ``.start()``).

    ``--rollout-engine embedded`` -> :class:`gyre.rollout.embedded.EngineServer` on ``--model-dir``
    (default: the embedded tiny model of ``--tokenizer-kind``); ``sglang`` ->
    :class:`gyre.rollout.sglang_engine.SGLangEngine` with the ``--sglang-*`` flags.  Both expose
    ``start()``, ``stop()``, ``url`` and ``client()``.

    Raises:
        ValueError: unknown ``rollout_engine``.
    """
    kind = getattr(args, "rollout_engine", "embedded")
    if kind == "sglang":
        from gyre.rollout.sglang_engine import SGLangEngine

        return SGLangEngine.from_args(args, host=host, port=port)
    if kind != "embedded":
        raise ValueError(f"unknown rollout engine {kind!r} (expected embedded or sglang)")
    from gyre.embedded_model import ensure_tiny_model
    from gyre.rollout.config import EngineConfig
    from gyre.rollout.embedded import EngineServer

    model_dir = args.model_dir or str(ensure_tiny_model(getattr(args, "tokenizer_kind", "local"),
                                                       getattr(args, "model_cache_dir", None)))
    return EngineServer(EngineConfig(model_dir=model_dir), host=host, port=port or 0)
