"""KV migration on reroute through the real proxy: two embedded engines on 127.0.0.1, a streamed
Chat call moved mid-generation from one to the other (as a role switch does), with migration on
(the destination hits its prefix cache), off (it recomputes everything), and failing (it
recomputes; the client sees a normal answer)."""

from __future__ import annotations

import json

import httpx
import pytest

from gyre.embedded_model import load_tokenizer
from gyre.proxy.engines import ClientEngine
from gyre.proxy.render import ChatRenderer
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.rollout.config import EngineConfig
from gyre.rollout.embedded_server import EngineServer
from gyre.rollout.engine_client import AsyncEngineClient, EngineClient
from gyre.trajectory.store import TrajectoryStore

PROMPT = "Count slowly from one to one hundred, one number per line, and say nothing else. " * 8


@pytest.fixture
def engines(tiny_model_dir):
    servers = [EngineServer(EngineConfig(model_dir=str(tiny_model_dir), max_running_requests=2)).start()
               for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def prefill_tokens(url: str) -> int:
    return EngineClient(url).get_server_info()["internal_states"][0]["num_prefill_tokens"]


def moved_call(tmp_path, tiny_model_dir, engines, *, migration: bool):
    """One streamed call on engine-0, moved to engine-1 after 20 chunks; returns (record, client
    text, engine-1's prefilled tokens for the retry)."""
    store = TrajectoryStore(tmp_path / "records", fsync_every=0)
    srv = ProxyServer(ChatRenderer(load_tokenizer(tiny_model_dir)), store=store,
                      config=ProxyConfig(max_context_tokens=4096, retry_timeout_s=60, kv_migration=migration))
    for i, e in enumerate(engines):
        srv.add_engine(ClientEngine(AsyncEngineClient(e.url), f"engine-{i}"))
    srv.start()
    try:
        ex = srv.register_execution(engine_id="engine-0")
        before = prefill_tokens(engines[1].url)
        body = {"model": "m", "stream": True, "max_tokens": 120, "temperature": 0.0, "ignore_eos": True,
                "messages": [{"role": "user", "content": PROMPT}]}
        text, chunks = [], 0
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {ex.api_key}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                text.append(delta or "")
                chunks += 1
                if chunks == 20:  # mid-generation: a role switch moves the execution away
                    srv.set_route(ex.execution_id, "engine-1")
                    assert srv.abort_engine("engine-0") == 1
        srv.close_execution(ex.execution_id)
        (rec,) = store.read_records(ex.execution_id)
        return rec, "".join(text), prefill_tokens(engines[1].url) - before
    finally:
        srv.stop()


def test_a_rerouted_call_hits_the_migrated_prefix(tmp_path, tiny_model_dir, engines):
    rec, text, prefilled = moved_call(tmp_path, tiny_model_dir, engines, migration=True)
    first, retry = rec.metadata["attempts"]
    assert (first["engine_id"], first["outcome"], retry["engine_id"]) == ("engine-0", "abort", "engine-1")
    context = len(rec.input_ids) + first["tokens"]  # what the retry sends: prompt + partial output
    assert retry["migrated_tokens"] >= context - 1
    assert prefilled <= 0.05 * context  # the destination computed (almost) nothing again
    assert len(rec.output_ids) == 120 and text  # the client saw one whole answer


def test_without_migration_the_destination_recomputes_the_context(tmp_path, tiny_model_dir, engines):
    rec, _, prefilled = moved_call(tmp_path, tiny_model_dir, engines, migration=False)
    first, retry = rec.metadata["attempts"]
    assert "migrated_tokens" not in retry
    assert prefilled == len(rec.input_ids) + first["tokens"] - 1


def test_a_failed_copy_falls_back_to_recompute(tmp_path, tiny_model_dir, engines):
    EngineClient(engines[1].url).update_weight_version("other")  # its import refuses engine-0's KV
    rec, text, prefilled = moved_call(tmp_path, tiny_model_dir, engines, migration=True)
    first, retry = rec.metadata["attempts"]
    assert "migrated_tokens" not in retry and retry["outcome"] == "length"
    assert prefilled == len(rec.input_ids) + first["tokens"] - 1
    assert len(rec.output_ids) == 120 and text
