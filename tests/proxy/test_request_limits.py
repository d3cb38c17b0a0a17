"""Rank 0's request limits over real HTTP on 127.0.0.1 (gyre/proxy/request_body.py): sizes are
capped before memory is spent, unrepresentable values and too many parts are refused in the API's
own error shape, nothing refused is recorded, and the server goes on serving."""

from __future__ import annotations

import gzip
import json
import socket
import time
import tracemalloc

import httpx
import orjson
import pytest

from gyre.proxy.engines import ClientEngine, EngineRejected, ScriptedEngine
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.trajectory.store import TrajectoryStore

PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
CAP = 256 << 10


def _body(api: str, **extra) -> dict:
    if api == "responses":
        return {"model": "m", "input": "hi", "max_output_tokens": 4, **extra}
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.fixture()
def served(local_renderer, tmp_path):
    r = local_renderer
    srv = ProxyServer(r, store=TrajectoryStore(tmp_path), config=ProxyConfig(
        max_body_bytes=CAP, max_messages=50, max_tools=4, max_tool_results=3, body_check_bytes=0))
    srv.add_engine(ScriptedEngine("e0", r.encode("ok") + [r.eos_id], chunk=1))
    srv.start()
    yield srv
    srv.stop()


def _post(srv, path, content: bytes, key: str, **headers) -> httpx.Response:
    h = {"authorization": f"Bearer {key}", "x-api-key": key, "content-type": "application/json", **headers}
    return httpx.post(srv.url + path, content=content, headers=h, timeout=30)


def _error(api: str, r: httpx.Response) -> tuple[str, str]:
    """(type, message) of an error body, checking the API's shape."""
    b = r.json()
    if api == "anthropic":
        assert b["type"] == "error"
        return b["error"]["type"], b["error"]["message"]
    assert set(b["error"]) == {"message", "type", "param", "code"}
    return b["error"]["type"], b["error"]["message"]


def _assert_still_serving(srv, key):
    r = _post(srv, PATHS["chat"], json.dumps(_body("chat")).encode(), key)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("api", sorted(PATHS))
def test_a_declared_length_over_the_cap_is_answered_413_before_any_byte_is_sent(served, api):
    ex = served.register_execution()
    with socket.create_connection((served.host, served.port), timeout=10) as s:
        s.sendall((f"POST {PATHS[api]} HTTP/1.1\r\nHost: x\r\nx-api-key: {ex.api_key}\r\n"
                   f"authorization: Bearer {ex.api_key}\r\ncontent-type: application/json\r\n"
                   f"content-length: {1 << 40}\r\n\r\n").encode())
        head = s.recv(65536).decode()                    # answered although no body byte was sent
    assert head.startswith("HTTP/1.1 413"), head[:200]
    body = json.loads(head.split("\r\n\r\n", 1)[1])
    etype = body["error"]["type"]
    assert etype == ("request_too_large" if api == "anthropic" else "invalid_request_error")
    assert "Content-Length says 1099511627776 bytes" in head
    _assert_still_serving(served, ex.api_key)
    assert served.counters(ex.execution_id)["calls"] == 1


@pytest.mark.parametrize("api", sorted(PATHS))
def test_a_body_over_the_cap_is_413_and_one_under_it_is_served(served, api):
    ex = served.register_execution()
    pad = lambda n: json.dumps(_body(api, metadata={"p": "x" * n})).encode()  # noqa: E731
    under, over = pad(CAP - 200), pad(CAP + 10)
    assert len(under) <= CAP < len(over)
    assert _post(served, PATHS[api], under, ex.api_key).status_code == 200
    r = _post(served, PATHS[api], over, ex.api_key)
    assert r.status_code == 413 and "Content-Length says" in _error(api, r)[1]
    chunked = _post(served, PATHS[api], iter([over[i:i + 4096] for i in range(0, len(over), 4096)]), ex.api_key)
    assert chunked.status_code == 413 and "received more than" in _error(api, chunked)[1]
    c = served.counters(ex.execution_id)
    assert c["calls"] == 1 and c["rejected"] == 2


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compression_bomb_is_413_and_costs_about_the_cap(served, encoding):
    ex = served.register_execution()
    inner = json.dumps(_body("chat", metadata={"p": "x" * (256 << 20)})).encode()   # 256 MB inflated
    bomb = gzip.compress(inner, 9) if encoding == "gzip" else __import__("zlib").compress(inner, 9)
    del inner
    assert len(bomb) < 1 << 20
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        r = _post(served, PATHS["chat"], bomb, ex.api_key, **{"content-encoding": encoding})
        elapsed = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.status_code == 413 and "decoded to more than" in r.json()["error"]["message"]
    assert peak < 4 * CAP + len(bomb) * 3, peak           # not the 256 MB it inflates to
    assert elapsed < 10
    _assert_still_serving(served, ex.api_key)


@pytest.mark.parametrize("api", sorted(PATHS))
@pytest.mark.parametrize("field", ["content", "stop", "model", "tool_name", "key"])
def test_lone_surrogates_are_400_and_nothing_is_recorded(served, api, field):
    ex = served.register_execution()
    body = _body(api)
    mark = "\ud800"
    if field == "content":
        if api == "responses":
            body["input"] = f"hi {mark}"
        else:
            body["messages"][0]["content"] = f"hi {mark}"
    elif field == "stop":
        body["stop_sequences" if api == "anthropic" else "stop"] = [mark]
    elif field == "model":
        body["model"] = mark
    elif field == "tool_name":
        body["tools"] = [{"name": mark, "input_schema": {"type": "object"}} if api == "anthropic" else
                         {"type": "function", "name": mark} if api == "responses" else
                         {"type": "function", "function": {"name": mark}}]
    else:
        body["metadata"] = {mark: 1}
    raw = json.dumps(body).encode()                          # ASCII escapes: "\ud800" in the bytes
    assert b"\\ud800" in raw
    for stream in (False, True):
        r = _post(served, PATHS[api], raw.replace(b'"model"', b'"stream": %s, "model"' % str(stream).lower().encode()),
                  ex.api_key)
        assert r.status_code == 400, r.text
        assert "lone surrogate" in _error(api, r)[1]
    assert served.counters(ex.execution_id)["calls"] == 0 and len(served.tree(ex.execution_id).records) == 0
    _assert_still_serving(served, ex.api_key)


@pytest.mark.parametrize("api", sorted(PATHS))
@pytest.mark.parametrize("literal", [b"NaN", b"-Infinity", b"1e400", b"1" + b"0" * 400])
def test_numbers_no_float_holds_are_400(served, api, literal):
    ex = served.register_execution()
    key = b'"temperature"'
    raw = json.dumps(_body(api)).encode()[:-1] + b", " + key + b": " + literal + b"}"
    r = _post(served, PATHS[api], raw, ex.api_key)
    assert r.status_code == 400, r.text
    assert served.counters(ex.execution_id)["calls"] == 0
    _assert_still_serving(served, ex.api_key)


def test_too_many_messages_tools_or_tool_results_are_400(served):
    ex = served.register_execution()
    many = [{"role": "user", "content": "x"}] * 51
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(5)]
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "t0", "arguments": "{}"}} for i in range(4)]
    results = [{"role": "tool", "tool_call_id": f"c{i}", "content": "r"} for i in range(4)]
    cases = [({"messages": many}, "too many messages: 51 > 50 (max_messages)"),
             ({"tools": tools}, "too many tools: 5 > 4 (max_tools)"),
             ({"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": calls},
                            *results]}, "too many tool results in one turn")]
    for extra, message in cases:
        r = _post(served, PATHS["chat"], json.dumps(_body("chat", **extra)).encode(), ex.api_key)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert served.counters(ex.execution_id)["calls"] == 0


def test_count_tokens_has_the_same_limits(served):
    ex = served.register_execution()
    path = "/v1/messages/count_tokens"
    ok = _post(served, path, json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
               ex.api_key)
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * CAP}]}).encode()
    r = _post(served, path, big, ex.api_key)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    bomb = gzip.compress(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (64 << 20)}]}).encode())
    r = _post(served, path, bomb, ex.api_key, **{"content-encoding": "gzip"})
    assert r.status_code == 413
    deep = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": ' + b"[" * 200 + b"]" * 200 + b"}"
    r = _post(served, path, deep, ex.api_key)
    assert r.status_code == 400 and "max_json_depth" in r.json()["error"]["message"]
    r = _post(served, path, json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 51}).encode(),
              ex.api_key)
    assert r.status_code == 400 and "max_messages" in r.json()["error"]["message"]


def test_an_engine_request_that_cannot_be_encoded_is_a_client_error_never_retried():
    """A client that fails to write the request (orjson cannot encode it) is the request's fault:
    the engine adapter raises EngineRejected (400), which the router does not retry."""
    import asyncio

    class _Client:
        base_url = "http://unused"
        calls = 0

        async def stream(self, input_ids, sampling_params, *, rid, return_logprob):
            _Client.calls += 1
            orjson.dumps(sampling_params)
            yield None

    async def run():
        eng = ClientEngine(_Client(), "e0")
        with pytest.raises(EngineRejected) as ei:
            async for _ in eng.generate_stream([1, 2], {"stop": ["\ud800"]}, "r1"):
                pass
        return ei.value

    exc = asyncio.run(run())
    assert exc.status == 400 and "cannot be encoded as JSON" in exc.message and _Client.calls == 1
