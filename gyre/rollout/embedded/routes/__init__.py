"""The embedded engine's HTTP routes, one module per concern, each a class whose methods are the
handlers (:func:`gyre.rollout.embedded.server.build_app` binds them to their paths):
``generate.py`` (``/generate``, one answer or a stream), ``control.py`` (abort, pause, memory,
cache, health and info), ``weights.py`` (weight updates, versions and weight-update groups),
``kv.py`` (Gyre's KV export and import); ``common.py`` holds what they share."""
