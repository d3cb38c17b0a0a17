"""Fuzz of the three model endpoints with malformed bodies (hypothesis): never a 5xx, errors in
the API's own shape, and the server stays healthy and keeps recording."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.testing.json_paths import json_paths, json_replaced

SCALE = float(os.environ.get("GYRE_HYPOTHESIS_SCALE", "1"))
KEYS = ["model", "messages", "role", "content", "type", "text", "tools", "tool_calls", "function", "name",
        "arguments", "input", "id", "call_id", "tool_use_id", "tool_call_id", "system", "stream", "max_tokens",
        "max_output_tokens", "temperature", "top_p", "stop", "stop_sequences", "thinking", "signature", "summary",
        "output", "namespace", "instructions", "input_schema", "parameters", "n", "stream_options", "include_usage",
        "is_error", "cache_control", "reasoning_content", "metadata", "include", "chat_template_kwargs", "tool_choice"]
VALUES = ["user", "assistant", "system", "developer", "tool", "text", "tool_use", "tool_result", "thinking", "function",
          "function_call", "function_call_output", "reasoning", "message", "custom_tool_call", "input_text", "namespace",
          "custom", "<tool_call>", "<|im_end|>", "{\"a\": 1}", ""]
scalars = (st.none() | st.booleans() | st.integers(-2, 2 ** 40) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from(VALUES) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5), c, max_size=5),
                           max_leaves=25)

VALID = {
    "anthropic": {"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "S"}], "tools": [
        {"name": "f", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                          {"type": "tool_use", "id": "a", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "r"}]}]}]},
    "chat": {"model": "m", "max_tokens": 64, "tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"}]},
    "responses": {"model": "m", "max_output_tokens": 64, "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "p"}],
                  "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
                            {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "t"}]},
                            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                            {"type": "function_call_output", "call_id": "a", "output": "r"}]},
}
PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}


@st.composite
def bodies(draw):
    api = draw(st.sampled_from(sorted(PATHS)))
    kind = draw(st.sampled_from(["random", "mutate", "mutate", "bytes"]))
    if kind == "random":
        return api, json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        return api, draw(st.binary(max_size=64))
    base = VALID[api]
    paths = list(json_paths(base))
    body = base
    for _ in range(draw(st.integers(1, 3))):
        body = json_replaced(body, draw(st.sampled_from(paths)), draw(json_values))
        paths = list(json_paths(body)) or [()]
    if isinstance(body, dict) and draw(st.booleans()):
        body["stream"] = True
    return api, json.dumps(body).encode()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer

    r = ChatRenderer(load_tokenizer(tiny_model_dir))
    srv = ProxyServer(r, config=ProxyConfig(max_context_tokens=4096, retry_timeout_s=5))
    srv.add_engine(ScriptedEngine("e0", r.encode('ok\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>') + [r.eos_id], chunk=8))
    srv.start()
    ex = srv.register_execution()
    yield srv, ex
    srv.stop()


def _check_error_shape(api, status, body):
    if api == "anthropic":
        assert body["type"] == "error" and isinstance(body["error"]["message"], str) and body["error"]["type"]
    else:
        assert isinstance(body["error"]["message"], str) and "type" in body["error"]


@settings(max_examples=max(1, int(150 * SCALE)), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_fuzz_model_endpoints(server, case):
    srv, ex = server
    api, raw = case
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(PATHS[api], content=raw, headers={"x-api-key": ex.api_key, "content-type": "application/json"})
        assert r.status_code < 500, (r.status_code, r.text[:500])
        if r.status_code >= 400:
            _check_error_shape(api, r.status_code, r.json())
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert "data:" in r.text
        else:
            r.json()


def test_server_healthy_after_fuzz(server):
    srv, ex = server
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/health").json()["status"] == "ok"
        n = srv.counters(ex.execution_id)["calls"]
        r = c.post("/v1/chat/completions", json=VALID["chat"], headers={"authorization": f"Bearer {ex.api_key}"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
        assert srv.counters(ex.execution_id)["calls"] == n + 1
        for api, path in PATHS.items():  # unknown key: 401 in the API's shape
            r = c.post(path, json=VALID[api], headers={"x-api-key": "nope"})
            assert r.status_code == 401
            _check_error_shape(api, 401, r.json())
        r = c.post("/v1/nope", json={})
        assert r.status_code == 404 and "error" in r.json()
