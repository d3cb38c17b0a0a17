#!/usr/bin/env python
"""Serve Gyre's recording proxy without training, to point any harness at Gyre.

Usage::

    python tools/serve_rollout.py [--engine-url URL ... | --num-engines N] [--model-dir DIR] [--port P]
        [--save-dir DIR] [--config FILE] [any Gyre flag]

With ``--engine-url`` (repeatable) the proxy routes to engines you run (SGLang's native HTTP
API; each must answer ``GET /health`` at start-up) and starts none; otherwise it starts
``--num-engines`` embedded engines, or SGLang servers with ``--rollout-engine sglang --backend
gpu``. Once ready it prints one JSON line ``{"base_url": "http://127.0.0.1:P", "save_dir": ...,
"engines": [...]}``; executions are registered with ``POST /gyre/executions`` and closed with
``POST /gyre/executions/{id}/close`` (``docs/serving.md``). SIGINT/SIGTERM stop it (exit 0); bad
flags, combinations this machine cannot serve and engines that do not answer exit 2 with one line
on stderr. Details: ``gyre/proxy/serve.py``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.proxy.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
