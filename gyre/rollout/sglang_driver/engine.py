"""A real SGLang server for a rollout cell on GPUs, driven through the same engine client.

:class:`SGLangEngine` launches ``python -m sglang.launch_server --model-path M --host H
--port P <passthrough>`` in its own process group (the passthrough flags from
:mod:`gyre.rollout.sglang_driver.flags`, the shared KV store's from
:mod:`gyre.rollout.sglang_driver.launch`), waits until ``/health`` answers 200 and hands out
:class:`gyre.rollout.client.engine_client.EngineClient` objects; :meth:`SGLangEngine.stop` sends
SIGTERM to the group, then SIGKILL.  :class:`SGLangCellEngine` is a cell's server, whose clients
push the cell's weights in SGLang's own serialization (:mod:`gyre.rollout.sglang_driver.weights`).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from gyre.process_guard import popen_process_group, untrack_process_group
from gyre.rollout.ports import free_port
from gyre.rollout.sglang_driver.flags import sglang_server_argv
from gyre.rollout.sglang_driver.launch import merge_server_argv, server_environment, shared_kv_store_launch
from gyre.rollout.sglang_driver.weights import SGLangGroupClient, SGLangTensorClient


#: How many times :meth:`SGLangEngine.start` chooses another port when the one it chose was taken.
_PORT_RETRIES = 2


class SGLangEngine:
    """One SGLang server process (see module docstring), whose ``/health`` never generates
    (:data:`~gyre.rollout.sglang_driver.launch.HEALTH_GENERATION_ENV`).

    Args:
        model_path: HF model directory.
        host, port: where it listens (``port=None``: a free port).
        server_argv: SGLang flags (e.g. from :func:`~gyre.rollout.sglang_driver.flags.sglang_server_argv`).
        launcher: command prefix (default ``[python, "-m", "sglang.launch_server"]``).
        env: environment (e.g. ``CUDA_VISIBLE_DEVICES``); default inherits.  Either way torchrun's
            worker variables are left out (:func:`~gyre.rollout.sglang_driver.launch.server_environment`).
        log_path: file for the server's stdout/stderr (default: a temp file).
        startup_timeout: seconds to wait for ``/health``.
    """

    def __init__(self, model_path: str | os.PathLike, *, host: str = "127.0.0.1", port: int | None = None,
                 server_argv: Sequence[str] = (), launcher: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, log_path: str | os.PathLike | None = None,
                 startup_timeout: float = 900.0):
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.server_argv = list(server_argv)
        self.launcher = list(launcher) if launcher is not None else [sys.executable, "-m", "sglang.launch_server"]
        self.env = dict(env) if env is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, host: str = "127.0.0.1", port: int | None = None,
                  env: Mapping[str, str] | None = None, extra_argv: Sequence[str] = (),
                  model_path: str | None = None, **kwargs) -> "SGLangEngine":
        """Build from Gyre's parsed arguments (``--model-dir`` unless ``model_path`` is given, the
        ``--sglang-*`` flags and ``--rollout-shared-kv-*``); ``extra_argv`` (e.g. a cell's layout
        flags) comes after them."""
        model = model_path or args.model_dir
        if model is None:
            from gyre.embedded_model import ensure_tiny_model

            model = ensure_tiny_model(args.tokenizer_kind, args.model_cache_dir)
        argv = [*sglang_server_argv(args), *extra_argv]
        store = getattr(args, "rollout_shared_kv_store", None)
        if store:
            extra_argv, extra_env = shared_kv_store_launch(
                store, host, protocol=args.rollout_shared_kv_protocol, device=args.rollout_shared_kv_device,
                segment_bytes=args.rollout_shared_kv_segment_gb << 30,
                host_ratio=args.rollout_shared_kv_host_ratio)
            argv = merge_server_argv(argv, extra_argv)
            env = {**(env if env is not None else os.environ), **extra_env}
        return cls(model, host=host, port=port, server_argv=argv, env=env, **kwargs)

    def command(self) -> list[str]:
        """The full server command line (port chosen if still ``None``)."""
        if self.port is None:
            self.port = free_port(self.host)
        return [*self.launcher, "--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
                *self.server_argv]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, wait_healthy: bool = True) -> "SGLangEngine":
        """Launch and wait until ``/health`` answers 200 (``wait_healthy=False``: launch only, for
        a multi-node server's process on a node other than its first, which serves no HTTP). When
        the port was chosen here (``port=None``) and the server's log reports it already in use,
        the server is launched again on another port, up to :data:`_PORT_RETRIES` times.

        Raises:
            RuntimeError: the process exited, or was not healthy within ``startup_timeout`` s
                (it is stopped; the message ends with the log's last lines).
        """
        import tempfile

        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="sglang-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        chosen_port, launches = self.port is None, 0
        while True:
            launches += 1
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._log = open(self.log_path, "ab")
            self.proc = popen_process_group(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                            env=server_environment(self.env))
            if not wait_healthy:
                return self
            try:
                return self._wait_healthy()
            except RuntimeError:
                # a port chosen here that another socket took before the server bound it: choose again
                if not (chosen_port and launches <= _PORT_RETRIES and self._log_says_port_taken(log_start)):
                    raise
                self.port = None

    def _wait_healthy(self) -> "SGLangEngine":
        from gyre.rollout.client.engine_client import EngineClient

        deadline = time.monotonic() + self.startup_timeout
        with EngineClient(self.url, timeout=10.0) as c:
            while True:
                if self.proc.poll() is not None:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"SGLang server exited with status {self.proc.returncode}: {tail}")
                if c.health():
                    return self
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"SGLang server not healthy after {self.startup_timeout:.0f} s: {tail}")
                time.sleep(0.5)

    def _log_says_port_taken(self, since: int) -> bool:
        """The server's log since byte ``since`` reports its HTTP port already in use."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return b"address already in use" in f.read().lower()
        except OSError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of the server log."""
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except (OSError, TypeError):
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """Abort every request (best effort), SIGTERM the server's main process (which shuts its
        scheduler and detokenizer down), SIGKILL the whole process group after ``timeout`` seconds
        or once the main process is gone; return the exit status.  The abort comes first because
        SGLang's SIGTERM handler waits for running requests, and after a generate with ``n`` > 1
        one of them never finishes."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._abort_all_quietly()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever of the group is left (a child the main process did not reap)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        untrack_process_group(self.proc.pid)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def _abort_all_quietly(self) -> None:
        if self.port is None:
            return
        from gyre.rollout.client.engine_client import EngineClient

        try:
            with EngineClient(self.url, timeout=2.0) as c:
                c.abort_all()
        except Exception:  # a server that cannot answer is killed all the same
            pass

    def client(self, timeout: float | None = 600.0):
        """An :class:`~gyre.rollout.client.engine_client.EngineClient` for this server."""
        from gyre.rollout.client.engine_client import EngineClient

        return EngineClient(self.url, timeout=timeout)

    def __enter__(self) -> "SGLangEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SGLangCellEngine(SGLangEngine):
    """The SGLang server of one cell (``tp_size`` = the cell's GPUs).  Inside one node its clients
    push weights from the cell's GPU (:class:`SGLangTensorClient`, one CUDA IPC payload per engine
    TP rank); over ``nnodes`` > 1 nodes they broadcast them to every engine rank
    (:class:`SGLangGroupClient`, with this host as the group's rank 0)."""

    def __init__(self, model_path, *, device: str, tp_size: int, nnodes: int = 1, **kwargs):
        super().__init__(model_path, **kwargs)
        self.device, self.tp_size, self.nnodes = device, tp_size, nnodes

    def client(self, timeout: float | None = 600.0):
        if self.nnodes > 1:
            c = SGLangGroupClient(super().client(timeout), self.tp_size, self.host)
        else:
            c = SGLangTensorClient(super().client(timeout), self.device, self.tp_size)
        c.clear_shared_store = "--hicache-storage-backend" in self.server_argv
        return c
