"""Server behaviour without SDKs: delivery tracking, count_tokens, limits
(gyre/proxy/server.py over real HTTP on 127.0.0.1, scripted engine)."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.trajectory.store import TrajectoryStore


@pytest.fixture()
def served(local_renderer, tmp_path):
    r = local_renderer
    eng = ScriptedEngine("e0", r.encode("Hello there, this is a longer answer.") + [r.eos_id], chunk=1, delay_s=0.02)
    srv = ProxyServer(r, store=TrajectoryStore(tmp_path), config=ProxyConfig(max_context_tokens=300))
    srv.add_engine(eng)
    srv.start()
    yield srv, eng, tmp_path
    srv.stop()


BODY = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _wait(pred, timeout=5.0):
    end = time.time() + timeout
    while not pred():
        assert time.time() < end
        time.sleep(0.01)


def test_disconnect_mid_stream_is_recorded_undelivered(served):
    srv, eng, save = served
    ex = srv.register_execution()
    h = {"x-api-key": ex.api_key}
    with httpx.Client(base_url=srv.url) as c:
        with c.stream("POST", "/v1/messages", json=BODY, headers=h) as resp:
            lines = resp.iter_lines()
            for _ in range(8):
                next(lines)
        # the client went away: the generation still finishes and is recorded as not delivered
        _wait(lambda: srv.counters(ex.execution_id)["calls"] == 1)
        # the harness goes on with another request (a byte-identical one would be a retry:
        # tests/proxy/test_client_retries.py)
        text = c.post("/v1/messages", json=dict(BODY, max_tokens=63), headers=h).text
        assert "message_stop" in text
    tree = srv.tree(ex.execution_id)
    assert [tree.record_info(i).delivered for i in range(2)] == [False, True]
    recs = TrajectoryStore(save).read_records(ex.execution_id)
    assert [r.delivered for r in recs] == [False, True]
    c = srv.counters(ex.execution_id)
    assert (c["delivered"], c["undelivered"], c["joined_retries"]) == (1, 1, 0)


def test_count_tokens_and_limits_touch_no_tree(served):
    srv, eng, _ = served
    ex = srv.register_execution()
    h = {"x-api-key": ex.api_key}
    with httpx.Client(base_url=srv.url) as c:
        n = c.post("/v1/messages/count_tokens", json={"messages": BODY["messages"]}, headers=h).json()["input_tokens"]
        r = c.post("/v1/messages", json=dict(BODY, stream=False), headers=h).json()
        assert r["usage"]["input_tokens"] == n
        long = {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 5}
        r = c.post("/v1/messages", json=long, headers=h)
        assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"authorization": f"Bearer {ex.api_key}"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert len(srv.tree(ex.execution_id).records) == 1
    assert srv.counters(ex.execution_id)["rejected"] == 2


def test_admin_endpoints(served):
    srv, eng, _ = served
    with httpx.Client(base_url=srv.url) as c:
        reg = c.post("/gyre/executions", json={"task_id": "t9", "harness": "codex", "execution_id": "run-1"}).json()
        assert reg["execution_id"] == "run-1" and reg["engine_id"] == "e0"
        assert c.post("/gyre/executions", json={"execution_id": "run-1"}).status_code == 409
        assert c.post("/gyre/executions", json={"execution_id": "bad id!"}).status_code == 400
        assert c.post("/gyre/routes", json={"execution_id": "run-1", "engine_id": "zz"}).status_code == 400
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
               headers={"authorization": f"Bearer {reg['api_key']}"})
        info = c.get("/gyre/executions/run-1").json()
        assert info["records"] == 1 and info["counters"]["calls"] == 1 and info["harness"] == "codex"
        closed = c.post("/gyre/executions/run-1/close").json()
        assert closed["counters"]["calls"] == 1
        r = c.post("/v1/chat/completions", json={"messages": []}, headers={"authorization": f"Bearer {reg['api_key']}"})
        assert r.status_code == 401
    rec = srv.tree("run-1").record_info(0)
    assert rec.metadata["task_id"] == "t9" and rec.role == "auxiliary"  # a codex call without tools
    assert np.isfinite(rec.timings["total_s"])


def test_admin_token(local_renderer):
    srv = ProxyServer(local_renderer, config=ProxyConfig(admin_token="s3cret"))
    srv.add_engine(ScriptedEngine("e0", [1]))
    with srv:
        with httpx.Client(base_url=srv.url) as c:
            assert c.post("/gyre/executions", json={}).status_code == 401
            ok = c.post("/gyre/executions", json={}, headers={"authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and json.loads(ok.text)["api_key"].startswith("gyre-")


def test_role_rules_hook(local_renderer):
    class Rules:
        def classify(self, headers, body):
            return "subagent" if "SUB" in json.dumps(body) else "main"

    srv = ProxyServer(local_renderer)
    srv.add_engine(ScriptedEngine("e0", [local_renderer.eos_id]))
    with srv:
        ex = srv.register_execution(role_rules=Rules())
        with httpx.Client(base_url=srv.url) as c:
            for text in ("main task", "SUB task"):
                c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]},
                       headers={"authorization": f"Bearer {ex.api_key}"})
        tree = srv.tree(ex.execution_id)
        assert [tree.record_info(i).role for i in range(2)] == ["main", "subagent"]


def test_evaluator_header_wins_over_role_rules(local_renderer):
    class Rules:  # a harness's rules know nothing of the judge: everything is main
        def classify(self, headers, body):
            return "main"

    srv = ProxyServer(local_renderer)
    srv.add_engine(ScriptedEngine("e0", [local_renderer.eos_id]))
    with srv:
        ex = srv.register_execution(role_rules=Rules())
        with httpx.Client(base_url=srv.url) as c:
            for role in (None, "evaluator", "subagent"):
                headers = {"authorization": f"Bearer {ex.api_key}", **({"x-gyre-role": role} if role else {})}
                c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"q {role}"}]},
                       headers=headers)
        tree = srv.tree(ex.execution_id)
        # only the judge's own header overrides the rules; other roles stay the harness's call
        assert [tree.record_info(i).role for i in range(3)] == ["main", "evaluator", "main"]


def test_stored_tree_is_bit_identical_to_the_live_one(served):
    srv, eng, save = served
    ex = srv.register_execution()
    msgs = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=srv.url) as c:
        for turn in range(3):
            r = c.post("/v1/chat/completions", json={"messages": msgs}, headers={"authorization": f"Bearer {ex.api_key}"})
            msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
    live = srv.tree(ex.execution_id)
    srv.close_execution(ex.execution_id)
    _wait(lambda: len(TrajectoryStore(save).read_records(ex.execution_id)) == 3)
    stored = TrajectoryStore(save).load_tree(ex.execution_id)
    assert len(live.leaves()) == 1 and stored.digest() == live.digest()
    assert srv.tree(ex.execution_id).digest() == live.digest()       # after closing: read from the file


def _conversation(srv, ex, turns: int) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for turn in range(turns):
            r = c.post("/v1/chat/completions", json={"messages": msgs}, headers={"authorization": f"Bearer {ex.api_key}"})
            msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]


def test_a_closed_execution_frees_its_state_without_the_cyclic_collector(served):
    """Nothing of a closed execution waits for a full garbage collection: its message trie, tree
    and calls are freed by reference counting, and its tree is read from its record file."""
    import gc

    srv, eng, save = served
    ex = srv.register_execution()
    _conversation(srv, ex, 3)
    digest = srv.tree(ex.execution_id).digest()
    gc.collect()
    gc.disable()
    try:
        srv.close_execution(ex.execution_id)
        _wait(lambda: srv.executions[ex.execution_id].session.tree is None)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kinds = {type(o).__name__ for o in gc.garbage}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not kinds & {"TrieNode", "Message", "TitoSession", "TrajectoryTree", "Node", "ModelCall", "Execution"}
    assert srv.tree(ex.execution_id).digest() == digest
    info = httpx.get(f"{srv.url}/gyre/executions/{ex.execution_id}").json()
    assert info["closed"] and info["records"] == 3 and info["counters"]["calls"] == 3


def test_a_call_in_flight_at_closing_is_in_the_tree_read_after(served):
    srv, eng, save = served
    ex = srv.register_execution()
    _conversation(srv, ex, 1)
    import threading

    t = threading.Thread(target=_conversation, args=(srv, ex, 1))
    t.start()
    _wait(lambda: srv.counters(ex.execution_id)["inflight"] == 1)
    srv.close_execution(ex.execution_id)                             # while it generates (~0.2 s)
    assert srv.executions[ex.execution_id].session.tree is not None  # not released with a call uncommitted
    t.join()
    _wait(lambda: srv.executions[ex.execution_id].session.tree is None)
    tree = srv.tree(ex.execution_id)
    assert len(tree.records) == 2 and len(tree.leaves()) == 2


def test_stats_since_returns_the_stage_times_recorded_from_that_index(served):
    srv, _, _ = served
    _conversation(srv, srv.register_execution(), 3)
    with httpx.Client(base_url=srv.url) as c:
        full = c.get("/gyre/stats").json()
        assert full["stages_recorded"] == 3 and len(full["stage_times"]) == 3
        assert all(st["input_tokens"] > 0 and st["record_s"] >= 0 for st in full["stage_times"])
        assert c.get("/gyre/stats", params={"since": 2}).json()["stage_times"] == full["stage_times"][2:]
        none = c.get("/gyre/stats", params={"since": 1 << 62}).json()
        assert none["stages_recorded"] == 3 and none["stage_times"] == []
        # the server shares this test's process: its CPU clock, read between two of the test's own
        assert full["process_cpu_s"] <= none["process_cpu_s"] <= time.process_time()
        bad = c.get("/gyre/stats", params={"since": "x"})
        assert bad.status_code == 400 and "since must be an integer" in bad.text


def test_a_large_body_is_answered_whether_its_length_is_declared_or_chunked(served):
    srv, _, save = served
    body = json.dumps(dict(BODY, stream=False)).encode()
    padded = body[:-1] + b" " * (3 << 20) + b"}"  # 3 MB of JSON whitespace, a two-token prompt
    answers = []
    for declared in (True, False):
        ex = srv.register_execution()
        content = padded if declared else iter([padded[i:i + 100_000] for i in range(0, len(padded), 100_000)])
        with httpx.Client(base_url=srv.url) as c:
            r = c.post("/v1/messages", content=content, headers={"x-api-key": ex.api_key,
                                                                  "content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert ("content-length" in r.request.headers) == declared
        answers.append((r.json()["content"], TrajectoryStore(save).read_records(ex.execution_id)[0].input_ids.tolist()))
    assert answers[0][0][0]["text"] == "Hello there, this is a longer answer."
    assert answers[0] == answers[1]
