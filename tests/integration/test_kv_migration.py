"""KV migration on reroute through the real proxy: two embedded engines on 127.0.0.1, a streamed
Chat call moved mid-generation from one to the other by the cell's role switch (``CellRoles.to_train``:
reroute, abort, release the source's memory), with migration on
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
from gyre.rollout.client.async_client import AsyncEngineClient
from gyre.rollout.client.engine_client import EngineClient
from gyre.rollout.embedded.config import EngineConfig
from gyre.rollout.embedded.server import EngineServer
from gyre.training.cell import CellRoles
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


def proxy(tmp_path, tiny_model_dir, engines, **config) -> tuple[ProxyServer, TrajectoryStore]:
    store = TrajectoryStore(tmp_path / "records", fsync_every=0)
    srv = ProxyServer(ChatRenderer(load_tokenizer(tiny_model_dir)), store=store,
                      config=ProxyConfig(max_context_tokens=4096, retry_timeout_s=60, **config))
    for i, e in enumerate(engines):
        srv.add_engine(ClientEngine(AsyncEngineClient(e.url), f"engine-{i}"))
    return srv.start(), store


def moved_call(tmp_path, tiny_model_dir, engines, *, migration: bool, transport: str = "mooncake", box=None):
    """One streamed call on engine-0, moved to engine-1 after 20 chunks; returns (record, client
    text, engine-1's prefilled tokens for the retry)."""
    srv, store = proxy(tmp_path, tiny_model_dir, engines, kv_migration=migration, kv_transport=transport)
    if box is not None:
        box["router"] = srv.router
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
                if chunks == 20:  # mid-generation: cell 0 leaves rollout as in the main job
                    tr = CellRoles(0, "engine-0", EngineClient(engines[0].url), srv).to_train("engine-1")
                    assert (tr.rerouted, tr.aborted) == (1, 1)
        srv.close_execution(ex.execution_id)
        (rec,) = store.read_records(ex.execution_id)
        return rec, "".join(text), prefill_tokens(engines[1].url) - before
    finally:
        srv.stop()


@pytest.mark.parametrize("transport", ["mooncake", "http"])
def test_a_rerouted_call_hits_the_migrated_prefix(tmp_path, tiny_model_dir, engines, transport):
    if transport == "mooncake":
        pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not installed")
    box = {}
    rec, text, prefilled = moved_call(tmp_path, tiny_model_dir, engines, migration=True, transport=transport, box=box)
    stats = box["router"].migration_stats
    assert (stats["copies"], stats["failed"]) == (1, 0) and stats["bytes"] > 1000 * stats["tokens"] > 0
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


def test_a_failing_mooncake_copy_falls_back_to_http(tmp_path, tiny_model_dir, engines, monkeypatch):
    from gyre.rollout.embedded.kv_transfer import MooncakeKVStage
    from gyre.transfer_engine import TransferEngineError

    def refuse(self, data):
        raise TransferEngineError("register_memory failed: rc=-1")

    monkeypatch.setattr(MooncakeKVStage, "stage", refuse)
    box = {}
    rec, _, prefilled = moved_call(tmp_path, tiny_model_dir, engines, migration=True, box=box)
    stats = box["router"].migration_stats
    assert (stats["copies"], stats["failed"]) == (1, 1)  # mooncake failed, HTTP moved it
    first, retry = rec.metadata["attempts"]
    assert retry["migrated_tokens"] >= len(rec.input_ids) + first["tokens"] - 1 and prefilled <= 5


def two_calls(srv, store, between) -> tuple:
    """Two non-streamed calls of one execution (the second continues the first's conversation)
    with ``between(execution_id)`` in between; returns both records."""
    ex = srv.register_execution(engine_id="engine-0")
    auth = {"authorization": f"Bearer {ex.api_key}"}
    msgs = [{"role": "user", "content": PROMPT}]
    body = {"model": "m", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    r1 = httpx.post(srv.url + "/v1/chat/completions", json={**body, "messages": msgs}, headers=auth, timeout=120)
    assert r1.status_code == 200
    between(ex.execution_id)
    msgs += [r1.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
    r2 = httpx.post(srv.url + "/v1/chat/completions", json={**body, "messages": msgs}, headers=auth, timeout=120)
    assert r2.status_code == 200
    srv.close_execution(ex.execution_id)
    return store.read_records(ex.execution_id)


def test_an_idle_execution_s_context_moves_when_its_engine_leaves_rollout(tmp_path, tiny_model_dir, engines):
    srv, store = proxy(tmp_path, tiny_model_dir, engines, kv_migration=True)

    def role_switch(execution_id):
        srv.set_route(execution_id, "engine-1")
        assert srv.abort_engine("engine-0") == 0  # nothing in flight; the idle context is copied
        EngineClient(engines[0].url).flush_cache()  # the source frees its memory afterwards

    try:
        before = prefill_tokens(engines[1].url)
        rec1, rec2 = two_calls(srv, store, role_switch)
        stats = srv.router.migration_stats
    finally:
        srv.stop()
    held = len(rec1.input_ids) + len(rec1.output_ids) - 1  # the first call's context, in engine-0's cache
    assert stats["copies"] == 1 and stats["tokens"] >= held
    (att,) = rec2.metadata["attempts"]
    assert att["engine_id"] == "engine-1" and "migrated_tokens" not in att  # copied before the call
    assert prefill_tokens(engines[1].url) - before <= len(rec2.input_ids) - held  # only the new turn


def test_the_next_call_after_a_route_change_copies_from_the_previous_engine(tmp_path, tiny_model_dir, engines):
    srv, store = proxy(tmp_path, tiny_model_dir, engines, kv_migration=True)
    try:
        before = prefill_tokens(engines[1].url)
        rec1, rec2 = two_calls(srv, store, lambda e: srv.set_route(e, "engine-1"))  # a move for balance
    finally:
        srv.stop()
    held = len(rec1.input_ids) + len(rec1.output_ids) - 1
    (att,) = rec2.metadata["attempts"]
    assert att["engine_id"] == "engine-1" and att["migrated_tokens"] >= held
    assert prefill_tokens(engines[1].url) - before <= len(rec2.input_ids) - held
