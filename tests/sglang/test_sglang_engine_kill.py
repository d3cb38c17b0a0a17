"""The proxy's retry when a real SGLang server is killed in the middle of a streamed call."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx

from tests.sglang.conftest import start_server


def test_a_call_survives_its_server_killed_mid_stream(sglang_server, sglang_model_dir, tmp_path):
    """A streamed Chat call on a server that is SIGKILLed (its whole process group) after a few
    chunks: the execution is moved to the other server, the proxy retries there, and the client
    gets one whole answer; the record carries both attempts, and every token it trains on came
    from one of them."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.trajectory.store import TrajectoryStore

    victim = start_server(sglang_model_dir, tmp_path, "victim")
    store = TrajectoryStore(tmp_path / "records", fsync_every=0)
    proxy = ProxyServer(ChatRenderer(load_tokenizer(sglang_model_dir)), store=store,
                        config=ProxyConfig(max_context_tokens=1024, retry_timeout_s=120))
    proxy.add_engine(ClientEngine(AsyncEngineClient(victim.url), "victim"))
    proxy.add_engine(ClientEngine(AsyncEngineClient(sglang_server.url), "survivor"))
    proxy.start()
    try:
        ex = proxy.register_execution(engine_id="victim")
        body = {"model": "m", "max_tokens": 160, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}
        chunks, done = 0, False
        killed = threading.Event()
        with httpx.Client(timeout=180) as c:
            with c.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                          headers={"authorization": f"Bearer {ex.api_key}"}) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if json.loads(line[6:]).get("choices"):
                        chunks += 1
                    if chunks == 8 and not killed.is_set():
                        os.killpg(victim.proc.pid, signal.SIGKILL)  # the server and its schedulers
                        killed.set()
                        proxy.set_route(ex.execution_id, "survivor")
        assert killed.is_set() and done
        proxy.close_execution(ex.execution_id)
        (rec,) = store.read_records(ex.execution_id)
        attempts = rec.metadata["attempts"]
        print(f"killed mid-stream: {len(attempts)} attempts "
              f"{[(a['engine_id'], a['outcome'], a['tokens']) for a in attempts]}, {rec.num_output_tokens} tokens")
        assert [a["engine_id"] for a in attempts][0] == "victim" and attempts[-1]["engine_id"] == "survivor"
        assert rec.delivered and rec.num_output_tokens == 160
        assert sum(a["tokens"] for a in attempts) == 160
    finally:
        proxy.stop()
        victim.stop()
