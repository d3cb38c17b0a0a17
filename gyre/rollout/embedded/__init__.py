"""The embedded CPU engine: a torch causal LM behind SGLang's native HTTP API.

``engine.py`` runs ``core.py`` (continuous batching, with ``prefix_cache.py`` and ``sampling.py``)
over ``model_runner.py`` on one engine thread; ``server.py`` serves it over HTTP with the handlers
of :mod:`gyre.rollout.embedded.routes`, which parse and build bodies with :mod:`gyre.rollout.api`;
``kv_transfer.py`` moves KV between engines; ``config.py`` holds the settings and ``serve.py`` is
the command line.
"""
