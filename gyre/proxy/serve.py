"""Engines + proxy without training: point any harness at Gyre (``tools/serve_rollout.py``).

``main`` puts a :class:`~gyre.proxy.server.ProxyServer` in front of token-level engines that
speak SGLang's native HTTP API and records every call into a
:class:`~gyre.trajectory.store.TrajectoryStore` under ``--save-dir`` (one record file per
execution = its trajectory tree; ``tools/inspect_tree.py`` renders it). The engines are either

* the user's own (``--engine-url URL``, repeatable): nothing is started; each URL must answer
  ``GET /health`` at start-up, and the tokenizer comes from ``--model-dir`` or, when that is
  not given, from the ``tokenizer_path`` / ``model_path`` of the first engine's
  ``GET /model_info`` if it is a local directory; or
* started here: ``--num-engines`` (default ``--num-cells + --standalone-engines``) embedded CPU
  engines (``gyre.rollout.embedded.server``, in this process on their own threads), or with
  ``--rollout-engine sglang --backend gpu`` SGLang servers
  (:class:`gyre.rollout.sglang_driver.engine.SGLangEngine`, ``--sglang-tp-size`` GPUs each).

Combinations that cannot run exit 2 with one line before anything starts: ``--rollout-engine
sglang`` without ``--backend gpu`` or without an importable SGLang, ``--backend gpu`` with the
embedded engine or without CUDA, ``--num-engines`` with ``--engine-url``, an engine URL that does
not answer. Executions are registered over HTTP (``docs/serving.md``). Once ready it prints one
JSON line ``{"base_url": "http://127.0.0.1:P", "save_dir": ..., "engines": [...]}`` and serves
until SIGINT/SIGTERM (exit 0).

The proxy's settings are the main job's for the same flags
(:meth:`gyre.proxy.config.ProxyConfig.from_args`: sampling, output cap, context limit, KV
migration, ``--admin-token``, request limits).  ``--help`` lists serve_rollout's own groups first,
then Gyre's groups; the flags it uses from those are listed in its ``--help`` description
(``--model-dir``, ``--seq-length``, the rollout group's sampling, limit and KV flags,
``--proxy-host``, ``--proxy-port``, ``--proxy-max-*``, ``--admin-token``, ``--run-dir``,
``--log-level``, ...); the rest are accepted so that a training ``--config`` loads, and not used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

__all__ = ["build_arg_parser", "parse_args", "check_engine_urls", "RolloutService", "main"]


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(title="serve_rollout: proxy")
    g.add_argument("--config", type=str, default=None, help="YAML file of flag defaults; flags override it.")
    g.add_argument("--port", type=int, default=None, help="Proxy port (default: --proxy-port; 0 picks a free one).")
    g.add_argument("--host", type=str, default=None, help="Proxy address (default: --proxy-host).")
    g.add_argument("--save-dir", type=str, default=None,
                   help="Where records/trees are stored (default: <run-dir>/records).")
    e = parser.add_argument_group(title="serve_rollout: engines")
    e.add_argument("--engine-url", action="append", default=None, metavar="URL",
                   help="An engine you run (SGLang's native HTTP API, e.g. http://gpu-node:30000); repeat for "
                        "several. Nothing is started; the tokenizer comes from --model-dir, else from the "
                        "engine's /model_info path when it is a local directory.")
    e.add_argument("--engine-check-timeout-s", type=float, default=10.0,
                   help="How long each --engine-url may take to answer GET /health at start-up.")
    e.add_argument("--num-engines", type=int, default=None,
                   help="Engines to start (default: --num-cells + --standalone-engines); not with --engine-url. "
                        "Which engine: --rollout-engine (embedded on --backend cpu, sglang on --backend gpu).")


def build_arg_parser() -> argparse.ArgumentParser:
    """serve_rollout's groups first, then Gyre's flags (the Megatron training subset is accepted,
    so a training config loads, but not checked)."""
    from gyre.arguments import GyreArgumentParser, add_gyre_args, add_megatron_core_args

    p = GyreArgumentParser(
        prog="serve_rollout", allow_abbrev=False,
        usage="serve_rollout [--engine-url URL ... | --num-engines N] [--model-dir DIR] [--port P] "
              "[--save-dir DIR] [--config FILE] [any Gyre flag]",
        description="Serve Gyre's proxy (no training) in front of engines it starts or, with --engine-url, "
                    "engines you run. Used from the groups after serve_rollout's: --model-dir, --tokenizer-kind, "
                    "--seq-length, --backend, --rollout-engine, --rollout-temperature, --rollout-top-p, "
                    "--rollout-max-new-tokens, --rollout-max-context-tokens, --rollout-kv-migration, "
                    "--rollout-kv-transport, --rollout-concurrency-per-cell, --num-cells, --standalone-engines, "
                    "--proxy-host, --proxy-port, --proxy-max-*, --admin-token, --run-dir, --log-level, --sglang-*. "
                    "The other flags are accepted (so a training --config loads) and not used.")
    _add_serve_args(p)
    add_gyre_args(p)
    add_megatron_core_args(p)
    return p


def _megatron_dests() -> set[str]:
    from gyre.arguments import add_megatron_core_args

    q = argparse.ArgumentParser(add_help=False)
    add_megatron_core_args(q)
    return {a.dest for a in q._actions}


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError("expected http://HOST:PORT")
    try:
        parts.port
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return url.rstrip("/")


def _check_engine_choice(args: argparse.Namespace) -> None:
    """Refuse the --rollout-engine / --backend combinations this machine cannot serve."""
    from gyre.arguments import ArgumentError

    if args.rollout_engine == "sglang":
        if args.backend != "gpu":
            raise ArgumentError("argument --rollout-engine: sglang needs --backend gpu "
                                "(--backend cpu serves from the embedded engine)")
        if importlib.util.find_spec("sglang") is None:
            raise ArgumentError("argument --rollout-engine: sglang is not importable here (install "
                                "requirements-gpu.txt, or run SGLang yourself and pass --engine-url)")
    elif args.backend == "gpu":
        raise ArgumentError("argument --backend: gpu serves from SGLang (--rollout-engine sglang); "
                            "the embedded engine runs on CPU")
    if args.backend == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise ArgumentError("argument --backend: gpu, but CUDA is not available on this machine")
        tp = getattr(args, "sglang_tp_size", None) or 1
        n = args.num_engines or (args.num_cells + args.standalone_engines)
        have = torch.cuda.device_count()
        if n * tp > have:
            raise ArgumentError(f"argument --num-engines: {n} SGLang engines of {tp} GPU(s) need {n * tp} GPUs, "
                                f"this machine has {have}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` with ``--config`` defaults and Gyre's checks; exit 2 with one line on error.

    Also refused here: an ``--engine-url`` that is not ``http(s)://HOST[:PORT]``, ``--num-engines``
    with ``--engine-url``, and (without ``--engine-url``) the engine/backend combinations of the
    module docstring.  Whether the engines answer is checked by :func:`check_engine_urls`.
    """
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
        if not args.engine_check_timeout_s > 0:
            raise ArgumentError("argument --engine-check-timeout-s: must be > 0")
        if args.engine_url:
            if args.num_engines is not None:
                raise ArgumentError("argument --num-engines: not allowed with --engine-url (nothing is started)")
            urls = []
            for u in args.engine_url:
                try:
                    urls.append(_check_url(u))
                except ValueError as exc:
                    raise ArgumentError(f"argument --engine-url: {u!r}: {exc}") from None
            if len(set(urls)) != len(urls):
                raise ArgumentError("argument --engine-url: the same URL is given twice")
            args.engine_url = urls
        else:
            _check_engine_choice(args)
        return args

    return parse_with_config(build_arg_parser(), argv, validate)


def check_engine_urls(urls: Sequence[str], timeout: float = 10.0) -> dict[str, Any]:
    """``GET /health`` on every URL, then ``GET /model_info`` (or ``/get_model_info``) on the first;
    return that info.

    Raises:
        RuntimeError: one line naming the URL and what went wrong (no answer, a non-200 status,
            or model info that is not a JSON object).
    """
    import httpx

    info: dict[str, Any] = {}
    with httpx.Client(timeout=timeout, trust_env=False) as c:
        for i, url in enumerate(urls):
            try:
                r = c.get(url + "/health")
            except httpx.HTTPError as exc:
                reason = " ".join(str(exc).split()) or type(exc).__name__
                raise RuntimeError(f"engine {url} does not answer GET /health: {reason}") from None
            if r.status_code != 200:
                raise RuntimeError(f"engine {url} answered GET /health with status {r.status_code}")
            if i == 0:
                body = None
                for path in ("/model_info", "/get_model_info"):  # the second on SGLang before /model_info
                    try:
                        r = c.get(url + path)
                        body = r.json() if r.status_code == 200 else None
                    except (httpx.HTTPError, ValueError):
                        body = None
                    if isinstance(body, dict):
                        break
                if not isinstance(body, dict):
                    raise RuntimeError(f"engine {url}: neither GET /model_info nor /get_model_info gave a JSON object")
                info = body
    return info


def _tokenizer_dir_from_engine(info: dict[str, Any]) -> str | None:
    for key in ("tokenizer_path", "model_path"):
        p = info.get(key)
        if isinstance(p, str) and p and (Path(p) / "tokenizer_config.json").is_file():
            return p
    return None


class RolloutService:
    """Engines (started here or given as URLs) + proxy + store (see the module docstring).

    Args:
        args: parsed flags (:func:`parse_args`).
        model_dir: the directory whose tokenizer (and ``config.json``, when present) the proxy
            uses; default ``args.model_dir``, else the embedded tiny model.
    """

    def __init__(self, args: argparse.Namespace, model_dir: str | None = None) -> None:
        self.args = args
        self.model_dir = model_dir
        self.engines: list[Any] = []
        self.engine_urls: list[str] = []
        self.proxy = None

    def _start_engines(self, model_dir: str) -> None:
        a = self.args
        n = a.num_engines or (a.num_cells + a.standalone_engines)
        if a.rollout_engine == "sglang":
            from gyre.rollout.sglang_driver.engine import SGLangEngine

            tp = getattr(a, "sglang_tp_size", None) or 1
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = visible.split(",") if visible else [str(i) for i in range(n * tp)]
            for i in range(n):
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus[i * tp:(i + 1) * tp]))
                self.engines.append(SGLangEngine.from_args(a, env=env).start())
        else:
            from gyre.rollout.embedded.config import EngineConfig
            from gyre.rollout.embedded.server import EngineServer

            for _ in range(n):
                cfg = EngineConfig(model_dir=model_dir, max_running_requests=max(a.rollout_concurrency_per_cell, 1))
                self.engines.append(EngineServer(cfg).start())
        self.engine_urls = [e.url for e in self.engines]

    def start(self):
        """Start engines (unless ``--engine-url``) and proxy; return the :class:`~gyre.proxy.server.ProxyServer`."""
        from gyre.embedded_model import ensure_tiny_model, load_tokenizer
        from gyre.proxy.engines import ClientEngine
        from gyre.proxy.render import ChatRenderer
        from gyre.proxy.config import ProxyConfig
        from gyre.proxy.server import ProxyServer
        from gyre.rollout.client.async_client import AsyncEngineClient
        from gyre.trajectory.store import TrajectoryStore

        a = self.args
        model_dir = self.model_dir or a.model_dir or str(ensure_tiny_model(a.tokenizer_kind, a.model_cache_dir))
        if a.engine_url:
            self.engine_urls = list(a.engine_url)
        else:
            self._start_engines(model_dir)
        renderer = ChatRenderer(load_tokenizer(model_dir))
        save = Path(a.save_dir or Path(a.run_dir) / "records")
        store = TrajectoryStore(save, fsync_every=0, max_open=1024)  # the proxy fsyncs in batches
        config = ProxyConfig.from_args(a, model_dir)
        self.proxy = ProxyServer(renderer, store=store, config=config)
        for i, url in enumerate(self.engine_urls):
            self.proxy.add_engine(ClientEngine(AsyncEngineClient(url), f"engine-{i}"))
        host = a.host or a.proxy_host
        port = a.port if a.port is not None else a.proxy_port
        self.proxy.start(host, port)
        self.save_dir = save
        return self.proxy

    def stop(self) -> None:
        """Stop the proxy (closing the record files), then the engines it started."""
        if self.proxy is not None:
            self.proxy.stop()
        for eng in self.engines:
            eng.stop()


def _fail(message: str) -> int:
    sys.stderr.write(f"serve_rollout: error: {message}\n")
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (see the module docstring); returns the exit status."""
    import signal

    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per engine request
    if args.model_dir is not None and not os.path.isdir(args.model_dir):
        return _fail(f"model directory not found: {args.model_dir}")
    model_dir = args.model_dir
    if args.engine_url:
        try:
            info = check_engine_urls(args.engine_url, args.engine_check_timeout_s)
        except RuntimeError as exc:
            return _fail(f"argument --engine-url: {exc}")
        if model_dir is None:
            model_dir = _tokenizer_dir_from_engine(info)
            if model_dir is None:
                where = info.get("tokenizer_path") or info.get("model_path")
                return _fail(f"argument --model-dir: needed with --engine-url {args.engine_url[0]}: its model "
                             f"{where!r} is not a local directory with a tokenizer")
    svc = RolloutService(args, model_dir)
    stop = threading.Event()

    def _handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    try:
        proxy = svc.start()
        print(json.dumps({"base_url": proxy.url, "save_dir": str(svc.save_dir), "engines": svc.engine_urls}),
              flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        svc.stop()
    return 0
