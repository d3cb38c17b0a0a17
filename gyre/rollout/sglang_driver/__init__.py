"""The driver of a real SGLang server, which Gyre launches and reaches over HTTP (SGLang runs in
its own processes; only ``flags.py`` and ``weights.py`` import it, where it is installed).

``engine.py`` launches, watches and stops the server; ``flags.py`` is the ``--sglang-*`` flag
registry and argv building; ``launch.py`` the shared KV store's flags and the server's environment;
``weights.py`` pushes a cell's weights in SGLang's serialization and call order.
"""
