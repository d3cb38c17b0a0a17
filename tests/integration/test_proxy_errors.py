"""Requests the engine would refuse, over real HTTP on 127.0.0.1: embedded engines behind the
proxy, every answer checked for its status, the API's own error shape and how long it took.

* bad sampling parameters answer 400 at once in each API, streamed or not, and no engine call
  is made;
* an engine 4xx is the client's 4xx at once, with exactly one engine call (no retry), and a
  streamed request gets the status, not a 200 stream;
* a ``min_tokens`` request rerouted mid-stream finishes;
* undecodable bodies answer 400;
* a request for more output than the operator's cap gets the cap, and its record says so.
"""

from __future__ import annotations

import gzip
import json
import time
import zlib

import httpx
import pytest

from gyre.rollout.client.async_client import AsyncEngineClient
from gyre.trajectory.store import TrajectoryStore

PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
MAX_KEY = {"anthropic": "max_tokens", "chat": "max_tokens", "responses": "max_output_tokens"}
ENGINE_CONTEXT = 96  # the engines' context length; the proxy allows much more


class CountingClient(AsyncEngineClient):
    """The proxy's client of an engine, counting the generations it asks for."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.generate_calls = 0

    def stream(self, *args, **kwargs):
        self.generate_calls += 1
        return super().stream(*args, **kwargs)


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer

    engines = [EngineServer(EngineConfig(model_dir=str(tiny_model_dir), max_running_requests=4,
                                         context_length=ENGINE_CONTEXT)).start() for _ in range(2)]
    clients = [CountingClient(e.url) for e in engines]
    save = tmp_path_factory.mktemp("records")
    srv = ProxyServer(ChatRenderer(load_tokenizer(tiny_model_dir)), store=TrajectoryStore(save, fsync_every=0),
                      config=ProxyConfig(max_context_tokens=4096, max_tokens_cap=64, default_max_tokens=8,
                                         retry_timeout_s=30))
    for i, (e, t) in enumerate(zip(engines, clients)):
        srv.add_engine(ClientEngine(t, f"engine-{i}"))
    srv.start()
    yield srv, clients, save
    srv.stop()
    for e in engines:
        e.stop()


def _calls(clients) -> int:
    return sum(t.generate_calls for t in clients)


def _body(api: str, content: str = "hi", **fields) -> dict:
    if api == "responses":
        body = {"model": "m", "input": content}
    else:
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    body.setdefault(MAX_KEY[api], 4)
    body.update(fields)
    return body


def _post(srv, key, api, body, *, stream=False, raw=None, headers=None):
    h = {"x-api-key": key, "content-type": "application/json", **(headers or {})}
    data = raw if raw is not None else json.dumps(dict(body, stream=stream) if stream else body).encode()
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", srv.url + PATHS[api], content=data, headers=h) as r:
            status, head = r.status_code, r.headers.get("content-type", "")
            text = r.read().decode()
    return status, head, text, time.monotonic() - t0


def _check_error_shape(api, text, status=400, param=None):
    body = json.loads(text)
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        msg = body["error"]["message"]
    else:
        err = body["error"]
        assert err["type"] == "invalid_request_error" and err["code"] is None
        if param is not None:
            assert err["param"] == param
        msg = err["message"]
    assert isinstance(msg, str) and msg
    return msg


BAD_SAMPLING = {
    "top_p_zero": ({"top_p": 0}, "top_p"),
    "top_p_above_one": ({"top_p": 1.5}, "top_p"),
    "top_k_zero": ({"top_k": 0}, "top_k"),
    "top_k_minus_two": ({"top_k": -2}, "top_k"),
    "temperature_negative": ({"temperature": -0.5}, "temperature"),
    "min_tokens_above_max": ({"min_tokens": 10}, "min_tokens"),
    "min_tokens_negative": ({"min_tokens": -1}, "min_tokens"),
    "max_tokens_zero": ({"__max__": 0}, "__max__"),
    "max_tokens_fraction": ({"__max__": 2.5}, "__max__"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", list(PATHS))
def test_bad_sampling_answers_400_at_once_without_an_engine_call(setup, api, stream):
    srv, clients, _ = setup
    ex = srv.register_execution(engine_id="engine-0")
    for name, (fields, param) in BAD_SAMPLING.items():
        fields = {(MAX_KEY[api] if k == "__max__" else k): v for k, v in fields.items()}
        param = MAX_KEY[api] if param == "__max__" else param
        before = _calls(clients)
        status, head, text, dt = _post(srv, ex.api_key, api, _body(api, **fields), stream=stream)
        assert status == 400, (name, text)
        assert head.startswith("application/json") and dt < 5.0, name
        msg = _check_error_shape(api, text, param=param)
        assert param in msg, (name, msg)
        assert _calls(clients) == before, name
    assert srv.counters(ex.execution_id)["rejected"] == len(BAD_SAMPLING)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", list(PATHS))
def test_engine_4xx_is_the_clients_4xx_at_once_never_retried(setup, api, stream):
    srv, clients, _ = setup
    ex = srv.register_execution(engine_id="engine-1")
    long_prompt = " ".join(["word"] * 200)  # within the proxy's limit, beyond the engine's context
    before = _calls(clients)
    status, head, text, dt = _post(srv, ex.api_key, api, _body(api, long_prompt), stream=stream)
    assert status == 400 and head.startswith("application/json"), text
    msg = _check_error_shape(api, text)
    assert msg.startswith("the engine refused the request") and "context length" in msg
    assert _calls(clients) - before == 1  # one engine call, no retry
    assert dt < 5.0
    c = srv.counters(ex.execution_id)
    assert c["rejected"] == 1 and c["retries"] == 0 and c["calls"] == 0


def test_rerouted_min_tokens_request_finishes(setup):
    openai = pytest.importorskip("openai")
    srv, _, save = setup
    first_attempt_tokens = []
    for _ in range(5):  # the engine may outrun the reader to min_tokens before the reroute: then again
        ex = srv.register_execution(engine_id="engine-0")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=ex.api_key, max_retries=0, timeout=30)
        t0 = time.monotonic()
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], stream=True,
                                                max_tokens=60, stream_options={"include_usage": True},
                                                extra_body={"min_tokens": 56, "temperature": 1.0})
        rerouted = False
        for k, chunk in enumerate(stream):
            if k == 4 and not rerouted:
                rerouted = True
                assert len(srv.router.inflight("engine-0")) == 1
                srv.set_route(ex.execution_id, "engine-1")
                assert srv.abort_engine("engine-0") == 1
            usage = chunk.usage
        assert rerouted and 56 <= usage.completion_tokens <= 60
        assert time.monotonic() - t0 < 20
        info = srv.tree(ex.execution_id).record_info(0)
        attempts = info.metadata["attempts"]
        assert [a["outcome"] for a in attempts][0] == "abort" and attempts[-1]["engine_id"] == "engine-1"
        assert len(attempts) == 2 and 0 < attempts[0]["tokens"]
        assert sum(a["tokens"] for a in attempts) == info.num_output_tokens == usage.completion_tokens
        first_attempt_tokens.append(attempts[0]["tokens"])
        if attempts[0]["tokens"] < 56:  # the retry had to honour the rest of min_tokens
            break
    assert first_attempt_tokens[-1] < 56, first_attempt_tokens


def _undecodable() -> dict[str, tuple[bytes, str]]:
    good = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    gz = gzip.compress(good)
    return {
        "truncated_gzip": (gz[: len(gz) // 2], "gzip"),
        "not_gzip": (b"plainly not gzip", "gzip"),
        "bad_deflate": (zlib.compress(good)[:-6] + b"\x00\x01", "deflate"),
        "invalid_utf8": (b'{"model": "\xff\xfe"}', ""),
        "not_json": (b"{model: m", ""),
        "empty": (b"", ""),
        "json_not_object": (b"[1, 2]", ""),
    }


@pytest.mark.parametrize("api", list(PATHS))
def test_undecodable_bodies_answer_400(setup, api):
    srv, clients, _ = setup
    ex = srv.register_execution(engine_id="engine-0")
    before = _calls(clients)
    for name, (raw, enc) in _undecodable().items():
        status, head, text, dt = _post(srv, ex.api_key, api, None, raw=raw,
                                       headers={"content-encoding": enc} if enc else None)
        assert status == 400, (name, text)
        _check_error_shape(api, text)
        assert dt < 5.0
    assert _calls(clients) == before


@pytest.mark.parametrize("api", list(PATHS))
def test_a_request_for_more_than_the_cap_gets_the_cap(setup, api):
    srv, _, save = setup
    old = srv.config.max_tokens_cap
    srv.config.max_tokens_cap = 6
    try:
        ex = srv.register_execution(engine_id="engine-0")
        fields = {MAX_KEY[api]: 32000, "ignore_eos": True}
        if api == "chat":
            fields["min_tokens"] = 20  # above the cap: cut to it
        status, _, text, _ = _post(srv, ex.api_key, api, _body(api, **fields))
        assert status == 200, text
        body = json.loads(text)
        usage = body["usage"]
        out = usage["completion_tokens"] if api == "chat" else usage["output_tokens"]
        assert out == 6
        rec = TrajectoryStore(save).read_records(ex.execution_id)[0]
        assert len(rec.output_ids) == 6 and rec.finish_reason == "length"
        assert rec.metadata["max_tokens_capped"] == {"requested": 32000, "applied": 6, "by": "max_tokens_cap"}
        if api == "chat":
            assert rec.metadata["min_tokens_capped"] == {"requested": 20, "applied": 6}
        # a request within the cap is not marked
        status, _, text, _ = _post(srv, ex.api_key, api, _body(api, **{MAX_KEY[api]: 3}))
        assert status == 200
        rec = TrajectoryStore(save).read_records(ex.execution_id)[1]
        assert "max_tokens_capped" not in rec.metadata and len(rec.output_ids) <= 3
    finally:
        srv.config.max_tokens_cap = old


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_whose_client_gave_up_is_recorded_undelivered(setup, stream):
    srv, _, save = setup
    ex = srv.register_execution()
    body = dict(_body("chat", max_tokens=48, ignore_eos=True), stream=stream)
    if stream:  # the harness hangs up after the first chunk (a read timeout between chunks is a race)
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", srv.url + PATHS["chat"], json=body, headers={"x-api-key": ex.api_key}) as r:
                assert r.status_code == 200
                next(r.iter_bytes())
    else:
        with pytest.raises(httpx.TimeoutException):  # no byte comes before the whole answer: 48 tokens
            with httpx.Client(timeout=httpx.Timeout(60, read=0.005)) as c:
                c.post(srv.url + PATHS["chat"], json=body, headers={"x-api-key": ex.api_key}).read()
    deadline = time.monotonic() + 60
    while not (save / f"{ex.execution_id}.jsonl").exists():
        assert time.monotonic() < deadline, "no record"
        time.sleep(0.1)
    records = TrajectoryStore(save).read_records(ex.execution_id)
    assert [r.delivered for r in records] == [False]
    srv.close_execution(ex.execution_id)
