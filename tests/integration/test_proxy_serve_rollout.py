"""``tools/serve_rollout.py`` on the embedded CPU engine, driven by the official SDKs, and
transparent retry when the embedded engine aborts a request mid-stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from gyre.trajectory.store import TrajectoryStore  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    save = tmp_path_factory.mktemp("records")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "tools/serve_rollout.py", "--config", "examples/cpu_tiny.yaml", "--port", "0",
         "--save-dir", str(save), "--num-engines", "1", "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    box: dict[str, str] = {}
    t = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    t.start()
    t.join(240)
    try:
        info = json.loads(box.get("line", ""))
    except ValueError:
        proc.kill()
        pytest.fail(f"serve_rollout did not start: {proc.stderr.read()[-2000:]}")
    yield info["base_url"], save, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _register(base, harness="generic"):
    r = httpx.post(base + "/gyre/executions", json={"task_id": "t0", "harness": harness})
    assert r.status_code == 200
    body = r.json()
    return body["execution_id"], body["api_key"]


TOOLS_OAI = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
TOOLS_ANT = [{"name": "bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def _check_one_path(save, eid, n):
    tree = TrajectoryStore(save).load_tree(eid)
    assert len(tree.records) == n and len(tree.leaves()) == 1
    for ci in range(1, n):
        prev, cur = tree.record_info(ci - 1), tree.record_info(ci)
        assert cur.delivered and cur.matched_tokens == prev.num_input_tokens + prev.num_output_tokens
    return tree


def test_sdks_against_serve_rollout(service):
    base, save, proc = service
    # OpenAI Chat Completions: a history with a tool call and its result, then three turns (stream + not)
    eid, key = _register(base)
    oc = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    msgs = [{"role": "system", "content": "You are a tester."}, {"role": "user", "content": "List files."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "a.txt\nb.txt"}]
    for turn in range(3):
        if turn % 2:
            chunks = list(oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OAI, max_tokens=8, stream=True,
                                                     stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].usage.completion_tokens > 0
        else:
            text = oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OAI, max_tokens=8).choices[0].message.content
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn}"}]
    assert [m.id for m in oc.models.list()]
    # Anthropic Messages
    eid2, key2 = _register(base)
    ac = anthropic.Anthropic(base_url=base, api_key=key2, max_retries=0)
    am = [{"role": "user", "content": "List files."},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": "bash", "input": {"command": "ls"}}]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "a.txt"}]}]
    for turn in range(3):
        kw = dict(model="m", max_tokens=8, messages=am, tools=TOOLS_ANT, system="You are a tester.")
        if turn % 2:
            with ac.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = ac.messages.create(**kw)
        assert m.usage.output_tokens > 0
        am += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": f"turn {turn}"}]
    # Responses
    eid3, key3 = _register(base)
    items = [{"role": "developer", "content": "You are a tester."}, {"role": "user", "content": "hi"}]
    for turn in range(2):
        r = oc.with_options(api_key=key3).responses.create(model="m", input=items, max_output_tokens=8, store=False,
                                                           tools=[{"type": "function", "name": "bash"}])
        items += [o.model_dump(exclude_none=True) for o in r.output] + [{"role": "user", "content": f"turn {turn}"}]
    for e in (eid, eid2, eid3):
        assert httpx.post(f"{base}/gyre/executions/{e}/close").status_code == 200
    _check_one_path(save, eid, 3)
    _check_one_path(save, eid2, 3)
    _check_one_path(save, eid3, 2)
    # a closed key is rejected and touches nothing
    with pytest.raises(openai.AuthenticationError):
        oc.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    assert len(TrajectoryStore(save).read_records(eid)) == 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


@pytest.mark.parametrize("how", ["reroute", "engine_abort"])
def test_embedded_engine_abort_mid_stream(tiny_model_dir, tmp_path, how):
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.engines import ClientEngine, engine_rid
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer

    engines = [EngineServer(EngineConfig(model_dir=str(tiny_model_dir), max_running_requests=4)).start() for _ in range(2)]
    srv = ProxyServer(ChatRenderer(load_tokenizer(tiny_model_dir)), store=TrajectoryStore(tmp_path),
                      config=ProxyConfig(retry_timeout_s=60))
    for i, e in enumerate(engines):
        srv.add_engine(ClientEngine(AsyncEngineClient(e.url), f"engine-{i}"))
    srv.start()
    try:
        ex = srv.register_execution(engine_id="engine-0")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=ex.api_key, max_retries=0)
        n_tokens = 256
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], stream=True,
                                                max_tokens=n_tokens, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        pieces, done = [], False
        for k, chunk in enumerate(stream):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if k == 2 and not done:
                done = True
                # freeze engine-0's batch first, so the request is still running there whatever the
                # engine's pace against this reader (the tiny model can outrun a loaded client)
                source = EngineClient(engines[0].url)
                source.pause_generation("in_place")
                rids = list(srv.router.inflight("engine-0"))
                assert len(rids) == 1
                if how == "reroute":  # a role transition: route away, cancel what runs on the source
                    srv.set_route(ex.execution_id, "engine-1")
                    assert srv.abort_engine("engine-0") == 1
                else:  # the request is killed on the engine itself; the retry stays on the route
                    assert source.abort(engine_rid(rids[0])) is True  # the id the engine knows it by
                source.continue_generation()
            usage = chunk.usage
        assert done and usage.completion_tokens == n_tokens  # one normal, complete response
        tree = srv.tree(ex.execution_id)
        assert len(tree.records) == 1
        info = tree.record_info(0)
        assert info.delivered and info.num_output_tokens == n_tokens and info.finish_reason == "length"
        attempts = info.metadata["attempts"]
        assert len(attempts) == 2 and attempts[0]["outcome"] == "abort"
        assert attempts[1]["engine_id"] == ("engine-1" if how == "reroute" else "engine-0")
        assert sum(a["tokens"] for a in attempts) == n_tokens
        text = "".join(pieces)
        from gyre.proxy.parse import parse_output
        rec = TrajectoryStore(tmp_path).read_records(ex.execution_id)[0]
        assert parse_output(srv.renderer.decode, rec.output_ids.tolist(), srv.stop_ids).content == text
        c = srv.counters(ex.execution_id)
        assert c["retries"] == 1 and c["reroutes"] == (1 if how == "reroute" else 0) and c["delivered"] == 1
    finally:
        srv.stop()
        for e in engines:
            e.stop()
