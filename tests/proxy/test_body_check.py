"""A very large body is checked by a helper process before the proxy parses it
(gyre/proxy/body_check.py; the server over real HTTP on 127.0.0.1, the helper a real process)."""

from __future__ import annotations

import json

import httpx
import pytest

import gyre.proxy.intake as intake_module
from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.server import ProxyConfig, ProxyServer


@pytest.fixture()
def parsed(monkeypatch):
    """Bodies the proxy's own process parsed (sizes, in bytes)."""
    sizes: list[int] = []
    real = intake_module.decode_json

    def counting(raw, encoding, limits=None, **kw):
        sizes.append(len(raw))
        return real(raw, encoding, limits, **kw)

    monkeypatch.setattr(intake_module, "decode_json", counting)
    return sizes


def _served(renderer, **config):
    eng = ScriptedEngine("e0", renderer.encode("ok") + [renderer.eos_id], chunk=1)
    srv = ProxyServer(renderer, config=ProxyConfig(**config))
    srv.add_engine(eng)
    return srv.start()


def _post(srv, body: bytes, api_key: str, path: str = "/v1/chat/completions") -> httpx.Response:
    h = {"authorization": f"Bearer {api_key}", "x-api-key": api_key, "content-type": "application/json"}
    return httpx.post(srv.url + path, content=body, headers=h, timeout=60)


def test_a_huge_body_too_long_is_refused_without_the_proxy_parsing_it(local_renderer, parsed):
    srv = _served(local_renderer, max_context_tokens=131072)
    try:
        ex = srv.register_execution()
        name = "tool_" * 2_000_000                                   # 10 MB of tool name
        raw = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": name, "parameters": {}}}]}).encode()
        assert len(raw) >= ProxyConfig().body_check_bytes
        r = _post(srv, raw, ex.api_key)
        assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"], r.text[:300]
        assert parsed == []                                           # refused by the helper
        assert srv.counters(ex.execution_id)["rejected"] == 1
        small = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
        assert _post(srv, small, ex.api_key).status_code == 200
        assert parsed == [len(small)]                                 # small bodies: parsed in the proxy
    finally:
        srv.stop()


@pytest.mark.parametrize("api,path,body,message", [
    ("chat", "/v1/chat/completions", b'{"model": "m", "messages": [' + b" " * 3000, "not valid JSON"),
    ("anthropic", "/v1/messages", json.dumps({"model": "m", "max_tokens": "x" * 3000,
                                              "messages": [{"role": "user", "content": "hi"}]}).encode(), "max_tokens"),
    ("responses", "/v1/responses", json.dumps({"model": "m", "input": "hi", "max_output_tokens": "x" * 3000}).encode(),
     "max_output_tokens"),
])
def test_the_helper_answers_each_api_with_the_proxy_s_own_error(local_renderer, parsed, api, path, body, message):
    srv = _served(local_renderer, body_check_bytes=1000)
    try:
        ex = srv.register_execution()
        direct = _served(local_renderer, body_check_bytes=0)        # the same body checked in-process
        try:
            ex2 = direct.register_execution()
            want = _post(direct, body, ex2.api_key, path)
        finally:
            direct.stop()
        parsed.clear()
        r = _post(srv, body, ex.api_key, path)
        assert r.status_code == want.status_code == 400, r.text[:300]
        assert r.json() == want.json() and message in json.dumps(r.json())
        assert parsed == []
    finally:
        srv.stop()


def test_a_large_valid_body_goes_ahead_and_is_recorded(local_renderer, parsed):
    srv = _served(local_renderer, body_check_bytes=1000)
    try:
        ex = srv.register_execution()
        text = "word " * 1000
        raw = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}).encode()
        r = _post(srv, raw, ex.api_key)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
        assert parsed == [len(raw)]                                   # checked by the helper, then parsed once here
        tree = srv.tree(ex.execution_id)
        assert len(tree.records) == 1 and tree.records[0].delivered
    finally:
        srv.stop()


def test_a_dead_helper_is_started_again_and_a_failing_one_leaves_the_check_to_the_proxy(local_renderer, parsed,
                                                                                         monkeypatch):
    import subprocess
    import sys

    from gyre.proxy.body_check import BodyChecker

    srv = _served(local_renderer, body_check_bytes=1000)
    try:
        ex = srv.register_execution()
        bad = b'{"model": "m", "messages": [' + b" " * 3000
        assert _post(srv, bad, ex.api_key).status_code == 400 and parsed == []
        first = srv._body_checker._proc
        first.kill()
        first.wait()
        assert _post(srv, bad, ex.api_key).status_code == 400 and parsed == []   # a new helper answered
        assert srv._body_checker._proc is not first and srv._body_checker._proc.poll() is None
        srv._body_checker.close()

        def broken(self):  # a helper that exits at once, without an answer
            self._proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE)
            return self._proc

        monkeypatch.setattr(BodyChecker, "_start", broken)
        r = _post(srv, bad, ex.api_key)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        assert parsed == [len(bad)]                                   # the proxy checked it itself
    finally:
        srv.stop()
    assert srv._body_checker._proc is None                           # stop() ends the helper


@pytest.mark.parametrize("where", ["metadata", "tool_schema", "tool_arguments"])
@pytest.mark.parametrize("depth", [120, 140, 1015, 5000])
def test_deeply_nested_json_is_served_or_refused_never_a_server_error(local_renderer, where, depth):
    """Nesting within max_json_depth (128 levels) is served wherever it is -- a field the API
    ignores, a tool's schema (rendered into the prompt), a tool call's arguments; deeper bodies
    get 400 naming the limit, before anything is recorded. Chat and Responses carry arguments as
    JSON text, which is rendered as text: its nesting is not the body's."""
    srv = _served(local_renderer)
    try:
        ex = srv.register_execution()
        deep = json.loads('{"a":' * depth + "1" + "}" * depth) if depth < 900 else 0
        answered = 0
        for api, path in [("chat", "/v1/chat/completions"), ("anthropic", "/v1/messages"),
                          ("responses", "/v1/responses")]:
            if api == "responses":
                body = {"model": "m", "input": "hi", "max_output_tokens": 4}
            else:
                body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            if where == "metadata":
                body["metadata"] = deep
            elif where == "tool_schema":
                schema = {"type": "object", "properties": deep}
                body["tools"] = [{"name": "f", "input_schema": schema} if api == "anthropic" else
                                 {"type": "function", "name": "f", "parameters": schema} if api == "responses" else
                                 {"type": "function", "function": {"name": "f", "parameters": schema}}]
            else:
                call = {"anthropic": {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                                        "input": deep}]},
                        "chat": {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": json.dumps(deep)}}]},
                        "responses": {"type": "function_call", "call_id": "t1", "name": "f",
                                      "arguments": json.dumps(deep)}}[api]
                result = {"anthropic": {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                     "content": "ok"}]},
                          "chat": {"role": "tool", "tool_call_id": "t1", "content": "ok"},
                          "responses": {"type": "function_call_output", "call_id": "t1", "output": "ok"}}[api]
                if api == "responses":
                    body["input"] = [{"role": "user", "content": "hi"}, call, result]
                else:
                    body["messages"] += [call, result]
            # json.dumps recurses as deep as the standard library parses; write the deepest by hand
            raw = json.dumps(body).encode() if depth < 900 else (
                json.dumps(dict(body, metadata=0)).encode().replace(b'"metadata": 0', b'"metadata": ' + b'{"a":' * depth + b"1" + b"}" * depth))
            served = depth <= 128 or (where == "tool_arguments" and api != "anthropic" and depth < 900)
            r = _post(srv, raw, ex.api_key, path)
            assert r.status_code == (200 if served else 400), (api, r.text[:300])
            answered += served
            if not served:
                assert "max_json_depth" in r.json()["error"]["message"] or "not valid JSON" in r.text
        assert srv.counters(ex.execution_id)["calls"] == answered              # refusals record nothing
        assert srv.counters(ex.execution_id)["rejected"] == 3 - answered
    finally:
        srv.stop()


def test_the_helper_counts_what_the_renderer_s_template_keeps(qwen3_renderer, qwen_renderer, parsed):
    """An earlier turn's <think> block of 4,000 tokens: Qwen3's template drops it, so the helper
    (told the renderer's kept parts) lets the body go ahead and the call is served; told the parts
    Gyre's template keeps, it refuses the same body."""
    from gyre.proxy.body_check import BodyChecker, check_body
    from gyre.proxy.errors import ProxyError

    think = " " * 128 * 4000
    body = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": f"<think>\n{think}\n</think>\n\nok"},
        {"role": "user", "content": "next"}]}
    raw = json.dumps(body).encode()
    assert check_body("chat", raw, "", 1000, 128, qwen3_renderer.kept_parts) == {"ok": True}
    assert "at least 4000 tokens" in check_body("chat", raw, "", 1000, 128, qwen_renderer.kept_parts)["message"]
    checker = BodyChecker()
    try:
        checker.check("chat", raw, "", 1000, 128, qwen3_renderer.kept_parts)          # the real helper process
        with pytest.raises(ProxyError, match="at least 4000 tokens"):
            checker.check("chat", raw, "", 1000, 128, qwen_renderer.kept_parts)
    finally:
        checker.close()
    for threshold in (1000, 0):                                       # the helper, then the proxy's own check
        srv = _served(qwen3_renderer, body_check_bytes=threshold, max_context_tokens=1000)
        try:
            ex = srv.register_execution()
            parsed.clear()
            r = _post(srv, raw, ex.api_key)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", r.text[:300]
            assert parsed == [len(raw)]
        finally:
            srv.stop()
