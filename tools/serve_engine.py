#!/usr/bin/env python
"""Serve one embedded Gyre rollout engine (SGLang's native HTTP API on a CPU torch model).

Usage::

    python tools/serve_engine.py [--model-dir DIR] [--host 127.0.0.1] [--port P]
        [--max-running-requests 64] [--prefix-cache-tokens 131072]
        [--weight-version default] [--no-incremental-streaming-output] [--num-threads N]

Without ``--model-dir`` the embedded tiny Qwen3 is used (built on first use, no network).
``--port 0`` (default) picks a free port.  Once the engine accepts requests, one JSON line
``{"url": "http://127.0.0.1:P"}`` is printed to stdout; SIGTERM or SIGINT aborts in-flight
requests (they answer with ``finish_reason.type == "abort"``), stops the server and exits 0.
Bad arguments exit 2 with one line on stderr.  Endpoints and contract: ``gyre/rollout/embedded/server.py``
and ``gyre/rollout/embedded/routes/``; client: ``gyre/rollout/client/engine_client.py``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.rollout.embedded.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
