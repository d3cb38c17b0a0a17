"""Command line and process wrapper of the embedded engine (light: torch is imported only to serve).

``python -m gyre.rollout.embedded.serve`` (or ``tools/serve_engine.py``) parses and checks its flags
first -- bad input exits 2 with one line on stderr before any heavy import -- then builds an
:class:`gyre.rollout.embedded.server.EngineServer`, prints ``{"url": "http://HOST:PORT"}`` once the
engine accepts requests and serves until SIGTERM/SIGINT (in-flight requests are aborted, exit
status 0).  :class:`EmbeddedEngineProcess` runs that command as a child process (one engine per
cell process, or tests).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path


def build_arg_parser():
    """Flags of ``python -m gyre.rollout.embedded.serve`` / ``tools/serve_engine.py``."""
    import argparse
    import sys

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # one line, exit 2
            sys.stderr.write(f"{self.prog}: error: {message}\n")
            sys.exit(2)

    from gyre.rollout.embedded.config import EngineConfig

    d = EngineConfig()
    p = _Parser(prog="serve_engine", description="Serve one embedded Gyre rollout engine "
                                "(SGLang-native HTTP API) and print {\"url\": ...} once ready.")
    p.add_argument("--model-dir", "--model-path", dest="model_dir", default=None,
                   help="HF model directory (default: the embedded tiny Qwen3); --model-path is SGLang's name, so "
                        "the engine starts where sglang.launch_server would.")
    p.add_argument("--tokenizer-dir", default=None, help="Tokenizer directory (default: --model-dir).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port.")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument("--prefill-chunk-tokens", type=int, default=d.prefill_chunk_tokens)
    p.add_argument("--prefix-cache-tokens", type=int, default=d.prefix_cache_tokens,
                   help="Prefix cache capacity in tokens (0: off; default: 1 GiB of KV).")
    p.add_argument("--weight-version", default=d.weight_version)
    p.add_argument("--random-seed", type=int, default=d.random_seed)
    p.add_argument("--incremental-streaming-output", action=argparse.BooleanOptionalAction,
                   default=d.incremental_streaming_output,
                   help="Stream deltas (default) or, with --no-..., cumulative chunks like SGLang's default.")
    p.add_argument("--num-threads", type=int, default=None, help="torch.set_num_threads (default: torch's).")
    p.add_argument("--device", default="cpu", help="Where the model and KV live (cpu, cuda, cuda:1).")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; print one JSON line ``{"url": ...}`` once accepting requests.

    Exit status 0 after a clean stop, 2 on bad arguments or an unusable model directory.
    """
    import signal
    import sys

    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bounds = {"port": (0, 65535), "max_running_requests": (1, None), "max_prefill_tokens": (1, None),
              "prefill_chunk_tokens": (1, None), "prefix_cache_tokens": (0, None), "context_length": (2, None),
              "num_threads": (1, None)}
    for name, (lo, hi) in bounds.items():
        v = getattr(args, name)
        if v is not None and (v < lo or (hi is not None and v > hi)):
            print(f"serve_engine: error: --{name.replace('_', '-')} out of range: {v}", file=sys.stderr)
            return 2
    if args.model_dir is not None and not (Path(args.model_dir) / "config.json").exists():
        print(f"serve_engine: error: --model-dir {args.model_dir}: no config.json", file=sys.stderr)
        return 2
    stop_early = threading.Event()
    holder: dict[str, object] = {}

    def on_signal(signum, frame):
        server = holder.get("server")
        if server is None:
            stop_early.set()
        else:
            server.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from transformers.utils import logging as hf_logging

    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer

    hf_logging.disable_progress_bar()

    config = EngineConfig(
        model_dir=args.model_dir, tokenizer_dir=args.tokenizer_dir, served_model_name=args.served_model_name,
        context_length=args.context_length, max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens, prefill_chunk_tokens=args.prefill_chunk_tokens,
        prefix_cache_tokens=args.prefix_cache_tokens,
        weight_version=args.weight_version, random_seed=args.random_seed,
        incremental_streaming_output=args.incremental_streaming_output, num_threads=args.num_threads,
        device=args.device)
    try:
        server = EngineServer(config, host=args.host, port=args.port, log_level=args.log_level)
    except OSError as exc:
        print(f"serve_engine: error: cannot bind {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    holder["server"] = server
    if stop_early.is_set():
        server.engine.shutdown()
        server.sock.close()
        return 0

    def ready():
        print(json.dumps({"url": server.url}), flush=True)

    server.serve_forever(on_ready=ready)
    return 0


class EmbeddedEngineProcess:
    """An embedded engine in its own process (``python -m gyre.rollout.embedded.serve``).

    Args:
        model_dir: HF model directory (``None``: the embedded default).
        extra_args: more CLI flags (see :func:`build_arg_parser`).
        env: environment (default: inherit; ``OMP_NUM_THREADS`` etc. go here).
    """

    def __init__(self, model_dir: str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None):
        import sys

        self.cmd = [sys.executable, "-m", "gyre.rollout.embedded.serve", "--host", host, "--port", str(port)]
        if model_dir is not None:
            self.cmd += ["--model-dir", str(model_dir)]
        self.cmd += list(extra_args or [])
        self.env = env
        self.proc = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("engine process not started")
        return self._url

    def start(self, timeout: float = 300.0) -> "EmbeddedEngineProcess":
        """Launch and wait for the ``{"url": ...}`` line.

        Raises:
            RuntimeError: the process exited or printed no URL within ``timeout`` seconds.
        """
        import subprocess

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True, env=self.env,
                                     start_new_session=True)
        box: dict[str, str] = {}

        def read():
            line = self.proc.stdout.readline()
            box["line"] = line

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        line = box.get("line", "")
        try:
            self._url = json.loads(line)["url"]
        except (ValueError, KeyError, TypeError):
            self.stop()
            raise RuntimeError(f"embedded engine did not start (exit {self.proc.poll()}): {line!r}") from None
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; return the exit status."""
        import subprocess

        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def client(self, timeout: float | None = 600.0):
        """An :class:`~gyre.rollout.client.engine_client.EngineClient` for this engine, pushing tensor
        weights by shared memory (the engine runs on this host)."""
        from gyre.rollout.client.engine_client import EngineClient

        return EngineClient(self.url, timeout=timeout, shared_memory_weights=True)

    def __enter__(self) -> "EmbeddedEngineProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    raise SystemExit(main())
