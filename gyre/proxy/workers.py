"""Rank 0's proxy as ``K`` worker processes (``--proxy-workers K``).

One Python process serves every model call of rank 0's executions when ``K = 1`` (the
:class:`~gyre.proxy.server.ProxyServer` runs in rank 0's own process). With ``K > 1``,
:class:`ProxyWorkers` starts ``K`` processes (``python -m gyre.proxy.workers``), each a whole
:class:`~gyre.proxy.server.ProxyServer` on its own port with the same engines, tokenizer, record
directory and configuration. An execution belongs to the worker its id hashes to
(:func:`worker_index`, CRC-32 mod ``K``): that worker holds its TITO session, message tries,
trajectory tree and record file, and its harness is given that worker's URL. Rank 0 (the
controller) talks to the workers over their ``/gyre/*`` admin routes and receives only what it
needs: the API key at registration, counters, the closing counters, and the finished trajectory
tree, which it rebuilds from the execution's record file and checks against the worker's digest.

:class:`ProxyWorkers` has the methods of the proxy the main job uses
(:meth:`register_execution`, :meth:`url_for`, :meth:`counters`, :meth:`tree`,
:meth:`close_execution`, :meth:`set_route`, :meth:`abort_engine`, :meth:`start` / :meth:`stop`).
Engines are fixed at start (``engines``: id, URL and whether each request carries a seed).

A worker exits when its standard input closes (rank 0 ended, however it ended) or on SIGTERM.
A worker that dies is not restarted: rank 0's next call to it raises ``RuntimeError``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import signal
import subprocess
import sys
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gyre.proxy.admin import ExecutionCounters
from gyre.proxy.server import ProxyConfig

__all__ = ["WorkerSpec", "RemoteExecution", "ProxyWorkers", "worker_index"]


def worker_index(execution_id: str, workers: int) -> int:
    """The worker that owns ``execution_id`` (stable across processes and runs)."""
    return zlib.crc32(execution_id.encode()) % workers


@dataclass
class WorkerSpec:
    """What every worker is built from (pickled to a file in the run directory)."""

    model_dir: str
    records_dir: str
    config: ProxyConfig
    engines: list[tuple[str, str, bool | None]] = field(default_factory=list)  # (engine id, URL, seed_each_request)
    role_rules: Any = None  # rules of the run's harness (``classify(headers, body)``), for every registration


@dataclass(frozen=True)
class RemoteExecution:
    """A registered execution as rank 0 sees it: give ``api_key`` and ``base_url`` to its harness."""

    execution_id: str
    api_key: str
    base_url: str
    worker: int


class ProxyWorkers:
    """``K`` proxy worker processes behind the proxy's Python API (module docstring)."""

    def __init__(self, spec: WorkerSpec, workers: int, *, spec_path: str | Path, log_dir: str | Path | None = None,
                 request_timeout_s: float = 60.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.spec, self.workers = spec, int(workers)
        self.spec_path, self.log_dir = Path(spec_path), Path(log_dir) if log_dir else None
        self.urls: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._owner: dict[str, int] = {}
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=request_timeout_s, limits=httpx.Limits(max_connections=64))
        self._admin = ({"authorization": f"Bearer {spec.config.admin_token}"} if spec.config.admin_token else {})

    # ------------------------------------------------------------------ processes
    def start(self, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 120.0) -> "ProxyWorkers":
        """Start the workers (worker ``i`` on ``port + i``, or free ports when ``port`` is 0) and
        return once every one answers. Raises ``RuntimeError`` when one does not start."""
        self.spec_path.parent.mkdir(parents=True, exist_ok=True)
        self.spec_path.write_bytes(pickle.dumps(self.spec))
        self.spec_path.chmod(0o600)
        for i in range(self.workers):
            log = open(self.log_dir / f"proxy_worker_{i}.log", "ab") if self.log_dir else subprocess.DEVNULL
            argv = [sys.executable, "-m", "gyre.proxy.workers", str(self.spec_path), "--index", str(i),
                    "--host", host, "--port", str(port + i if port else 0)]
            self._procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
        done = threading.Event()
        timer = threading.Timer(timeout, lambda: done.is_set() or [p.kill() for p in self._procs])
        timer.start()
        try:
            for i, p in enumerate(self._procs):
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"proxy worker {i} did not start (exit {p.poll()}; see its log)")
                self.urls.append(json.loads(line)["url"])
        except Exception:
            self.stop()
            raise
        finally:
            done.set()
            timer.cancel()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Close every worker's stdin (it stops: records flushed, files closed) and wait for it."""
        for p in self._procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self._procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        self._http.close()

    @property
    def url(self) -> str:
        """Worker 0's URL (each execution has its own: :meth:`url_for`)."""
        return self.urls[0]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def url_for(self, execution_id: str) -> str:
        """The URL of the worker that owns ``execution_id``."""
        return self.urls[worker_index(execution_id, self.workers)]

    def add_engine(self, engine: Any) -> None:
        """Add a :class:`~gyre.proxy.engines.ClientEngine` (its id, URL and seeding) to the spec;
        only before :meth:`start`."""
        if self._procs:
            raise RuntimeError("proxy workers take engines before they start")
        self.spec.engines.append((engine.engine_id, engine.client.base_url, engine.seed_each_request))

    # ------------------------------------------------------------------ admin calls
    def _request(self, worker: int, method: str, path: str, body: Any = None) -> Any:
        proc = self._procs[worker]
        try:
            r = self._http.request(method, self.urls[worker] + path, json=body, headers=self._admin)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"proxy worker {worker} (exit {proc.poll()}): {exc}") from exc
        if r.status_code == 404:
            raise KeyError(path)
        if r.status_code >= 400:
            msg = r.json().get("error", {}).get("message", r.text) if r.headers.get(
                "content-type", "").startswith("application/json") else r.text
            raise ValueError(f"proxy worker {worker}: {msg}")
        return r.json()

    def register_execution(self, execution_id: str, *, task_id: str | None = None, harness: str | None = None,
                           engine_id: str | None = None, api_key: str | None = None,
                           role_rules: Any = None) -> RemoteExecution:
        """Register at the owning worker (the run's role rules apply: ``role_rules`` must be the
        spec's or ``None``). Raises ``ValueError`` as the proxy's registration does."""
        if role_rules is not None and role_rules != self.spec.role_rules:
            raise ValueError("proxy workers apply the role rules of their spec only")
        w = worker_index(execution_id, self.workers)
        out = self._request(w, "POST", "/gyre/executions", {"execution_id": execution_id, "task_id": task_id,
                                                             "harness": harness, "engine_id": engine_id,
                                                             "api_key": api_key})
        return RemoteExecution(out["execution_id"], out["api_key"], self.urls[w], w)

    def counters(self, execution_id: str) -> dict[str, int]:
        """The execution's counters (a dict of :class:`~gyre.proxy.admin.ExecutionCounters`)."""
        return self._request(worker_index(execution_id, self.workers), "GET", f"/gyre/executions/{execution_id}")[
            "counters"]

    def close_execution(self, execution_id: str) -> ExecutionCounters:
        """Close at the owning worker; its counters at closing."""
        out = self._request(worker_index(execution_id, self.workers), "POST", f"/gyre/executions/{execution_id}/close")
        return ExecutionCounters(**out["counters"])

    def set_route(self, execution_id: str, engine_id: str) -> None:
        self._request(worker_index(execution_id, self.workers), "POST", "/gyre/routes",
                      {"execution_id": execution_id, "engine_id": engine_id})

    def abort_engine(self, engine_id: str) -> int:
        """Abort ``engine_id``'s requests in flight at every worker; how many were aborted."""
        return sum(int(self._request(w, "POST", f"/gyre/engines/{engine_id}/abort")["aborted"])
                   for w in range(self.workers))

    def tree(self, execution_id: str):
        """The execution's trajectory tree: the first ``n`` lines of its record file (records and
        delivery marks), where the owning worker's tree reflects ``n``; checked against that
        tree's digest.

        Raises:
            RuntimeError: the rebuilt tree differs from the worker's.
        """
        from gyre.trajectory.store import load_tree
        from gyre.trajectory.tree import TrajectoryTree

        info = self._request(worker_index(execution_id, self.workers), "GET", f"/gyre/executions/{execution_id}/tree")
        if info["entries"]:
            tree = load_tree(Path(self.spec.records_dir) / f"{execution_id}.jsonl", lines=info["entries"])
        else:
            tree = TrajectoryTree(execution_id)
        if tree.digest() != info["digest"]:
            raise RuntimeError(f"execution {execution_id}: the tree read from its records differs from its worker's")
        return tree


# ---------------------------------------------------------------------------- the worker process
def _serve(spec_path: str, index: int, host: str, port: int) -> int:
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyServer
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.trajectory.store import TrajectoryStore

    spec: WorkerSpec = pickle.loads(Path(spec_path).read_bytes())
    srv = ProxyServer(ChatRenderer(load_tokenizer(spec.model_dir)),
                      store=TrajectoryStore(spec.records_dir, fsync_every=0, max_open=1024), config=spec.config)
    srv.default_role_rules = spec.role_rules
    for eid, url, seeded in spec.engines:
        srv.add_engine(ClientEngine(AsyncEngineClient(url), eid, seed_each_request=seeded))
    srv.start(host, port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop.set()), daemon=True).start()
    print(json.dumps({"url": srv.url, "index": index}), flush=True)
    while not stop.wait(1.0):
        pass
    srv.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gyre.proxy.workers", description="One proxy worker process.")
    ap.add_argument("spec")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args(argv)
    return _serve(a.spec, a.index, a.host, a.port)


if __name__ == "__main__":
    sys.exit(main())
