"""The ``proxy`` flag group: where rank 0's proxy (or ``serve_rollout``'s) listens, how many
processes it runs, the bearer token of its admin routes and the per-request limits of a
model-call body.  :meth:`gyre.proxy.config.ProxyConfig.from_args` turns them, with the rollout
group's sampling and limit flags, into the proxy's settings.  The per-request limits' defaults
are :class:`gyre.proxy.request_body.RequestLimits`'s (``tests/test_arguments.py`` holds them
equal; this layer does not import the proxy).
"""

from __future__ import annotations

import argparse

from gyre.arguments.values import positive_int, size
from gyre.sandbox.spec import parse_size


def add_proxy_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="proxy")
    group.add_argument("--proxy-host", type=str, default="127.0.0.1", help="Address the proxy binds.")
    group.add_argument("--proxy-port", type=int, default=0,
                       help="Proxy port (0: pick a free one); with --proxy-workers K, worker i serves on port + i.")
    group.add_argument("--proxy-workers", type=int, default=1,
                       help="Proxy processes on rank 0 (1: the proxy runs in rank 0's process; K > 1: K worker "
                            "processes, each owning the executions whose id hashes to it).")
    group.add_argument("--proxy-max-body-bytes", type=size, default=parse_size("32m"),
                       help="Largest model-call body (e.g. 32m), as declared, as received and after gzip/deflate "
                            "decoding; larger ones get 413.")
    group.add_argument("--proxy-max-json-depth", type=positive_int, default=128,
                       help="Deepest nesting of arrays and objects in a model-call body (400 beyond).")
    group.add_argument("--proxy-max-messages", type=positive_int, default=20_000,
                       help="Messages (Responses: input items) per model call (400 beyond).")
    group.add_argument("--proxy-max-tools", type=positive_int, default=1_024,
                       help="Tool definitions per model call (400 beyond).")
    group.add_argument("--proxy-max-tool-results", type=positive_int, default=2_048,
                       help="Tool results in one turn of a model call (400 beyond).")
    group.add_argument("--admin-token", type=str, default=None,
                       help="Bearer token required on the proxy's /gyre/* admin routes (default: none, open).")
    return parser
