"""Engines + proxy without training: point any harness at Gyre (``tools/serve_rollout.py``).

Flags are Gyre's own (``gyre/arguments.py``: ``--config FILE``
supplies defaults) plus ``--port`` and ``--save-dir``; the Megatron (training) flags are not
needed here.

``main`` starts ``--num-cells + --standalone-engines`` embedded engines (the SGLang-native HTTP
API of ``gyre.rollout.embedded_server``, each in this process on its own threads), a
:class:`~gyre.proxy.server.ProxyServer` routing to them through
``gyre.rollout.engine_client.AsyncEngineClient``, and a :class:`~gyre.trajectory.store.TrajectoryStore`
under ``--save-dir`` (one record file per execution = its trajectory tree;
``tools/inspect_tree.py`` renders it). Executions are registered over HTTP (``POST
/gyre/executions`` with ``{"task_id": ..., "harness": ...}`` -> ``{"execution_id", "api_key"}``;
``POST /gyre/executions/{id}/close``). Once ready it prints one JSON line
``{"base_url": "http://127.0.0.1:P"}`` (OpenAI clients: ``base_url + "/v1"``; Anthropic
clients: ``base_url``) and serves until SIGINT/SIGTERM (exit 0). Bad flags exit 2 with one line
on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

__all__ = ["build_arg_parser", "parse_args", "RolloutService", "main"]


def _extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="serve_rollout")
    g.add_argument("--port", type=int, default=None, help="Proxy port (default: --proxy-port; 0 picks a free one).")
    g.add_argument("--host", type=str, default=None, help="Proxy address (default: --proxy-host).")
    g.add_argument("--save-dir", type=str, default=None,
                   help="Where records/trees are stored (default: <run-dir>/records).")
    g.add_argument("--num-engines", type=int, default=None,
                   help="Engines to start (default: --num-cells + --standalone-engines).")
    g.add_argument("--max-context-tokens", type=int, default=None,
                   help="Prompt + output limit (default: the model's max_position_embeddings).")
    g.add_argument("--admin-token", type=str, default=None, help="Bearer token required on /gyre/* (default: none).")
    return parser


def build_arg_parser() -> argparse.ArgumentParser:
    """Gyre's flags (the Megatron training subset is accepted, so a training config loads,
    but not checked) + the serve_rollout extras."""
    from gyre.arguments import GyreArgumentParser, add_gyre_args, add_megatron_core_args

    p = GyreArgumentParser(prog="serve_rollout", description="Serve Gyre's rollout engines and proxy (no training).",
                           allow_abbrev=False)
    p.add_argument("--config", type=str, default=None, help="YAML file of flag defaults; flags override it.")
    add_megatron_core_args(p)
    add_gyre_args(p)
    return _extra_args(p)


def _megatron_dests() -> set[str]:
    from gyre.arguments import add_megatron_core_args

    q = argparse.ArgumentParser(add_help=False)
    add_megatron_core_args(q)
    return {a.dest for a in q._actions}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` with ``--config`` defaults and Gyre's checks; exit 2 with one line on error."""
    from gyre.arguments import ArgumentError, parse_with_config, validate_args

    def validate(args: argparse.Namespace) -> argparse.Namespace:
        skip = _megatron_dests()  # no training here: the world-size/cell-layout checks do not apply
        checked = validate_args(argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in skip}))
        for k, v in vars(checked).items():
            setattr(args, k, v)
        if args.port is not None and not 0 <= args.port <= 65535:
            raise ArgumentError("argument --port: must be in [0, 65535]")
        if args.num_engines is not None and args.num_engines < 1:
            raise ArgumentError("argument --num-engines: must be >= 1")
        return args

    return parse_with_config(build_arg_parser(), argv, validate)


class RolloutService:
    """Embedded engines + proxy + store (see the module docstring).

    Args:
        args: parsed flags (:func:`parse_args`).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engines: list[Any] = []
        self.proxy = None

    def start(self):
        """Start engines and proxy; return the :class:`~gyre.proxy.server.ProxyServer`."""
        from gyre.embedded_model import ensure_tiny_model, load_tokenizer
        from gyre.proxy.engines import ClientEngine
        from gyre.proxy.render import ChatRenderer
        from gyre.proxy.server import ProxyConfig, ProxyServer
        from gyre.rollout.config import EngineConfig
        from gyre.rollout.embedded_server import EngineServer
        from gyre.rollout.engine_client import AsyncEngineClient
        from gyre.trajectory.store import TrajectoryStore

        a = self.args
        model_dir = a.model_dir or str(ensure_tiny_model(a.tokenizer_kind, a.model_cache_dir))
        n = a.num_engines or (a.num_cells + a.standalone_engines)
        for i in range(n):
            cfg = EngineConfig(model_dir=model_dir, max_running_requests=max(a.rollout_concurrency_per_cell, 1))
            self.engines.append(EngineServer(cfg).start())
        renderer = ChatRenderer(load_tokenizer(model_dir))
        max_ctx = a.max_context_tokens or _max_positions(model_dir) or a.seq_length
        save = Path(a.save_dir or Path(a.run_dir) / "records")
        store = TrajectoryStore(save, fsync_every=0, max_open=1024)  # the proxy fsyncs in batches
        config = ProxyConfig(
            model_name=Path(model_dir).name,
            default_max_tokens=a.rollout_max_new_tokens,
            max_context_tokens=max_ctx,
            admin_token=a.admin_token,
            default_sampling={"temperature": a.rollout_temperature, "top_p": a.rollout_top_p},
        )
        self.proxy = ProxyServer(renderer, store=store, config=config)
        for i, eng in enumerate(self.engines):
            self.proxy.add_engine(ClientEngine(AsyncEngineClient(eng.url), f"engine-{i}"))
        host = a.host or a.proxy_host
        port = a.port if a.port is not None else a.proxy_port
        self.proxy.start(host, port)
        self.save_dir = save
        return self.proxy

    def stop(self) -> None:
        """Stop the proxy (closing the record files), then the engines."""
        if self.proxy is not None:
            self.proxy.stop()
        for eng in self.engines:
            eng.stop()


def _max_positions(model_dir: str) -> int | None:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("max_position_embeddings")
    return int(v) if isinstance(v, int) and v > 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (see the module docstring); returns the exit status."""
    import signal

    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_dir is not None and not os.path.isdir(args.model_dir):
        sys.stderr.write(f"serve_rollout: error: model directory not found: {args.model_dir}\n")
        return 2
    svc = RolloutService(args)
    stop = threading.Event()

    def _handler(signum, frame):  # noqa: ARG001
        stop.set()

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    try:
        proxy = svc.start()
        print(json.dumps({"base_url": proxy.url, "save_dir": str(svc.save_dir)}), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        svc.stop()
    return 0
