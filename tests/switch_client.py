"""A proxy over two engines and a client that keeps calling it: what the role-switch tests (the
embedded engine through the SGLang launcher, and a real SGLang server) drive their cycles under."""

from __future__ import annotations

import threading

import httpx


class CallingClient:
    """Rank 0's proxy in front of ``engine-0`` (``other_url``, where executions go while the cell
    trains) and ``engine-1`` (``cell_url``), one execution pinned to the cell, and a thread calling
    the model through the proxy until :meth:`stop`.  ``ok`` counts answered calls, ``other`` keeps
    ``(status, text)`` of every other answer."""

    def __init__(self, model_dir, records_dir, other_url: str, cell_url: str, *, max_context_tokens: int = 4096):
        from gyre.embedded_model import load_tokenizer
        from gyre.proxy.engines import ClientEngine
        from gyre.proxy.render import ChatRenderer
        from gyre.proxy.server import ProxyConfig, ProxyServer
        from gyre.rollout.client.async_client import AsyncEngineClient
        from gyre.trajectory.store import TrajectoryStore

        self.store = TrajectoryStore(records_dir, fsync_every=0)
        self.proxy = ProxyServer(ChatRenderer(load_tokenizer(model_dir)), store=self.store,
                                 config=ProxyConfig(max_context_tokens=max_context_tokens, retry_timeout_s=120))
        self.proxy.add_engine(ClientEngine(AsyncEngineClient(other_url), "engine-0"))
        self.proxy.add_engine(ClientEngine(AsyncEngineClient(cell_url), "engine-1"))
        self.proxy.start()
        self.execution = self.proxy.register_execution(engine_id="engine-1")
        self.ok, self.other = 0, []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._call, daemon=True)
        self.thread.start()

    def _call(self) -> None:
        with httpx.Client(timeout=120) as h:
            while not self._stop.is_set():
                r = h.post(self.proxy.url + "/v1/chat/completions",
                           headers={"authorization": f"Bearer {self.execution.api_key}"},
                           json={"model": "m", "max_tokens": 24, "ignore_eos": True,
                                 "messages": [{"role": "user", "content": "Tell me a long story."}]})
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.other.append((r.status_code, r.text[:200]))

    def stop(self, timeout: float = 120) -> None:
        """Stop calling (the call in flight finishes)."""
        self._stop.set()
        self.thread.join(timeout)

    def records(self) -> list:
        """Close the execution and read what the proxy recorded for it."""
        self.proxy.close_execution(self.execution.execution_id)
        return self.store.read_records(self.execution.execution_id)

    def close(self) -> None:
        self._stop.set()
        self.proxy.stop()
