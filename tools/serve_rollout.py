#!/usr/bin/env python
"""Start rollout engines + the Gyre proxy without training, to point any harness at Gyre.

Usage::

    python tools/serve_rollout.py --config FILE [--port P] [--save-dir DIR] [--num-engines N] [any Gyre flag]

Once ready it prints one JSON line ``{"base_url": "http://127.0.0.1:P", "save_dir": ...}``
(OpenAI clients use ``base_url + "/v1"``, Anthropic clients ``base_url``). Register an execution
with ``POST /gyre/executions`` ``{"task_id": ..., "harness": ...}`` -> ``{"execution_id": ...,
"api_key": ...}`` and give the key to the harness as its API key; close it with ``POST
/gyre/executions/{id}/close``. Records and trees are stored under ``--save-dir`` (one file per
execution; ``tools/inspect_tree.py`` renders it). SIGINT/SIGTERM stop it (exit 0); bad flags exit
2 with one line on stderr. Details: ``gyre/proxy/serve.py``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.proxy.serve import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
