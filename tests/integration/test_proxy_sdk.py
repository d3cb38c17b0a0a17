"""The official ``openai`` and ``anthropic`` SDKs against the proxy (real HTTP on 127.0.0.1),
stream and non-stream, with tools and tool results, on a scripted engine that emits tool calls
(a random tiny model never does); transparent retry when the engine aborts mid-stream.

The same flows on the embedded engine behind ``tools/serve_rollout.py`` are in
``test_proxy_serve_rollout.py``.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from gyre.proxy.engines import ScriptedEngine  # noqa: E402
from gyre.proxy.server import ProxyConfig, ProxyServer  # noqa: E402
from gyre.trajectory.store import TrajectoryStore  # noqa: E402

TOOL_TEXT = '<think>\nI should look.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "bash", "arguments": {"command":  "ls -la"}}\n</tool_call>'
FINAL_TEXT = "<think>\nDone looking.\n</think>\n\nThere are 3 files."


def _script(renderer):
    """Teacher-forced script: a tool call until a tool result is in the context, then a final
    answer; continues a partial output (input after the last generation prompt)."""
    gen = renderer.encode("<|im_start|>assistant\n")

    def script(input_ids, params):
        text = renderer.decode(input_ids)
        start = max(i for i in range(len(input_ids) - len(gen) + 1) if input_ids[i:i + len(gen)] == gen) + len(gen)
        partial = input_ids[start:]
        last_turn = text[text.rfind("<|im_start|>assistant\n") - 200:]
        target = renderer.encode(FINAL_TEXT if "<tool_response>" in last_turn else TOOL_TEXT) + [renderer.eos_id]
        assert target[: len(partial)] == partial
        return target[len(partial):]

    return script


@pytest.fixture(scope="module")
def local_renderer(tiny_model_dir):
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer

    return ChatRenderer(load_tokenizer(tiny_model_dir))


@pytest.fixture()
def proxy(local_renderer, tmp_path):
    store = TrajectoryStore(tmp_path / "records")
    srv = ProxyServer(local_renderer, store=store, config=ProxyConfig(model_name="gyre-tiny", retry_timeout_s=30))
    srv.add_engine(ScriptedEngine("e0", _script(local_renderer), chunk=2))
    srv.add_engine(ScriptedEngine("e1", _script(local_renderer), chunk=2))
    srv.start()
    yield srv
    srv.stop()


def _one_path_exact(srv, eid, n_calls):
    tree = srv.tree(eid)
    assert len(tree.records) == n_calls and len(tree.leaves()) == 1
    prev = None
    for ci in range(n_calls):
        info = tree.record_info(ci)
        assert info.delivered
        if prev is not None:  # the whole previous path (input + sampled output) is reused
            assert info.matched_tokens == prev.num_input_tokens + prev.num_output_tokens
        prev = info
    return tree


ANTHROPIC_TOOLS = [{"name": "bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_multi_turn_with_tools(proxy, stream, local_renderer):
    ex = proxy.register_execution(task_id="t", harness="generic")
    client = anthropic.Anthropic(base_url=proxy.url, api_key=ex.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "How many files?"}]

    def create(messages):
        kw = dict(model="gyre-tiny", max_tokens=200, messages=messages, tools=ANTHROPIC_TOOLS, system="You are terse.")
        if stream:
            with client.messages.stream(**kw) as s:
                return s.get_final_message()
        return client.messages.create(**kw)

    m1 = create(msgs)
    assert [b.type for b in m1.content] == ["thinking", "text", "tool_use"] and m1.stop_reason == "tool_use"
    tu = m1.content[2]
    assert tu.name == "bash" and tu.input == {"command": "ls -la"}
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "a b c"}]}]
    m2 = create(msgs)
    assert [b.type for b in m2.content] == ["thinking", "text"] and m2.content[1].text == "There are 3 files."
    assert m2.stop_reason == "end_turn" and m2.usage.input_tokens > m1.usage.input_tokens
    tree = _one_path_exact(proxy, ex.execution_id, 2)
    assert tree.record_info(1).metadata["api"] == "anthropic"
    n = client.messages.count_tokens(model="gyre-tiny", messages=msgs, tools=ANTHROPIC_TOOLS, system="You are terse.")
    assert n.input_tokens == tree.record_info(1).num_input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_sdk_multi_turn_with_tools(proxy, stream):
    ex = proxy.register_execution(harness="generic")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=ex.api_key, max_retries=0)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "How many files?"}]

    def create(messages):
        if not stream:
            return client.chat.completions.create(model="gyre-tiny", messages=messages, tools=OPENAI_TOOLS).choices[0].message
        chunks = list(client.chat.completions.create(model="gyre-tiny", messages=messages, tools=OPENAI_TOOLS, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        return {"content": content, "tool_calls": calls}

    m1 = create(msgs)
    if stream:
        assert m1["content"] == "Let me check."
        tc = m1["tool_calls"][0]
        asst = {"role": "assistant", "content": m1["content"], "tool_calls": [
            {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": tc.function.arguments}}]}
    else:
        assert m1.content == "Let me check." and m1.tool_calls[0].function.name == "bash"
        tc = m1.tool_calls[0]
        asst = m1.model_dump(exclude_none=True)
    assert json.loads(tc.function.arguments) == {"command": "ls -la"}
    assert tc.function.arguments == '{"command":  "ls -la"}'  # the model's own bytes
    msgs += [asst, {"role": "tool", "tool_call_id": tc.id, "content": "a b c"}]
    m2 = create(msgs)
    assert (m2["content"] if stream else m2.content) == "There are 3 files."
    _one_path_exact(proxy, ex.execution_id, 2)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses_sdk_multi_turn_with_tools(proxy, stream):
    ex = proxy.register_execution(harness="generic")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=ex.api_key, max_retries=0)
    tools = [{"type": "function", "name": "bash", "description": "Run", "parameters": OPENAI_TOOLS[0]["function"]["parameters"]}]
    inp = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "How many files?"}]

    def create(items):
        if not stream:
            return client.responses.create(model="gyre-tiny", input=items, tools=tools, store=False,
                                           include=["reasoning.encrypted_content"])
        with client.responses.stream(model="gyre-tiny", input=items, tools=tools, store=False,
                                     include=["reasoning.encrypted_content"]) as s:
            for _ in s:
                pass
            return s.get_final_response()

    r1 = create(inp)
    types = [o.type for o in r1.output]
    assert types == ["reasoning", "message", "function_call"]
    fc = r1.output[2]
    assert fc.name == "bash" and fc.arguments == '{"command":  "ls -la"}'
    inp += [o.model_dump(exclude_none=True) for o in r1.output]
    inp.append({"type": "function_call_output", "call_id": fc.call_id, "output": "a b c"})
    r2 = create(inp)
    assert r2.output_text == "There are 3 files." and r2.status == "completed"
    _one_path_exact(proxy, ex.execution_id, 2)


def test_unknown_and_closed_keys_get_401_and_touch_no_tree(proxy):
    ex = proxy.register_execution()
    bad = anthropic.Anthropic(base_url=proxy.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        bad.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "authentication_error"
    good = openai.OpenAI(base_url=proxy.url + "/v1", api_key=ex.api_key, max_retries=0)
    good.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    proxy.close_execution(ex.execution_id)
    with pytest.raises(openai.AuthenticationError) as ei:
        good.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["type"] == "authentication_error"
    assert len(proxy.tree(ex.execution_id).records) == 1
    with pytest.raises(openai.AuthenticationError):
        good.models.list()


def test_engine_abort_mid_stream_is_retried_transparently(local_renderer, tmp_path):
    store = TrajectoryStore(tmp_path / "records")
    srv = ProxyServer(local_renderer, store=store, config=ProxyConfig(retry_timeout_s=30))
    e0 = ScriptedEngine("e0", _script(local_renderer), chunk=1, delay_s=0.02, weight_version=3)
    e1 = ScriptedEngine("e1", _script(local_renderer), chunk=1, delay_s=0.0, weight_version=3)
    srv.add_engine(e0)
    srv.add_engine(e1)
    srv.start()
    try:
        ex = srv.register_execution(engine_id="e0")
        client = anthropic.Anthropic(base_url=srv.url, api_key=ex.api_key, max_retries=0)
        texts = []
        with client.messages.stream(model="m", max_tokens=200, messages=[{"role": "user", "content": "go"}],
                                    tools=ANTHROPIC_TOOLS) as s:
            for event in s:
                texts.append(event.type)
                if len(texts) == 6:  # mid-stream: a role transition moves the execution away
                    srv.set_route(ex.execution_id, "e1")
                    assert srv.abort_engine("e0") == 1
            final = s.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[0].thinking == "I should look." and final.content[2].input == {"command": "ls -la"}
        deadline = time.time() + 5
        while len(srv.tree(ex.execution_id).records) < 1 and time.time() < deadline:
            time.sleep(0.01)
        tree = srv.tree(ex.execution_id)
        assert len(tree.records) == 1
        info = tree.record_info(0)
        assert info.delivered and info.engine_id == "e1" and info.policy_version == 3
        attempts = info.metadata["attempts"]
        assert [a["engine_id"] for a in attempts] == ["e0", "e1"] and attempts[0]["outcome"] == "abort"
        assert 0 < attempts[0]["tokens"] and sum(a["tokens"] for a in attempts) == info.num_output_tokens
        want = local_renderer.encode(TOOL_TEXT) + [local_renderer.eos_id]
        rec = store.read_records(ex.execution_id)[0]
        assert rec.output_ids.tolist() == want and np.all(rec.output_logprobs < 0)
        c = srv.counters(ex.execution_id)
        assert (c["calls"], c["delivered"], c["retries"], c["reroutes"]) == (1, 1, 1, 1)
        # the second engine got the first one's partial output as a continuation
        assert e1.calls[0][1][: len(e0.calls[0][1])] == e0.calls[0][1]
    finally:
        srv.stop()
