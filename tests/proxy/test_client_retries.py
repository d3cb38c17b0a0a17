"""A client retry is not a new sample (gyre/proxy/model_call.py over real HTTP on 127.0.0.1).

For each model API, streamed and not: a byte-identical request sent while the first is in flight
joins it (one generation, one delivered record, the same answer twice); one sent after the first
was answered to nobody gets that answer (one undelivered record); one sent after a delivered answer
with the SDK's retry header gets the same answer again (one record); one sent after a delivered
answer without a retry header is a new model call (two records).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.trajectory.store import TrajectoryStore

PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
END_MARK = {"anthropic": "message_stop", "chat": "[DONE]", "responses": "response.completed"}
CASES = [(api, stream) for api in PATHS for stream in (True, False)]


@pytest.fixture()
def served(local_renderer, tmp_path):
    r = local_renderer
    eng = ScriptedEngine("e0", r.encode("Hello there, this is a longer answer to retry.") + [r.eos_id],
                         chunk=1, delay_s=0.03)
    srv = ProxyServer(r, store=TrajectoryStore(tmp_path), config=ProxyConfig(max_context_tokens=400))
    srv.add_engine(eng)
    srv.start()
    yield srv, eng, tmp_path
    srv.stop()


def _body(api: str, stream: bool) -> bytes:
    msgs = [{"role": "user", "content": "hi"}]
    if api == "anthropic":
        b = {"model": "m", "max_tokens": 64, "messages": msgs}
    elif api == "chat":
        b = {"model": "m", "max_tokens": 64, "messages": msgs}
    else:
        b = {"model": "m", "max_output_tokens": 64, "input": "hi"}
    return json.dumps(dict(b, stream=stream)).encode()


def _headers(api: str, key: str, retry: int | None = None) -> dict[str, str]:
    h = {"content-type": "application/json"}
    h.update({"x-api-key": key} if api == "anthropic" else {"authorization": f"Bearer {key}"})
    if retry is not None:
        h["x-stainless-retry-count"] = str(retry)
    return h


def _wait(pred, timeout=10.0):
    end = time.time() + timeout
    while not pred():
        assert time.time() < end, "timed out"
        time.sleep(0.01)


def _give_up_early(srv, api: str, stream: bool, raw: bytes, key: str) -> None:
    """A client that leaves after the first bytes (streamed) or a short read timeout (not)."""
    with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(30.0, read=0.2)) as c:
        if stream:
            with c.stream("POST", PATHS[api], content=raw, headers=_headers(api, key)) as resp:
                assert resp.status_code == 200
                next(resp.iter_lines())
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post(PATHS[api], content=raw, headers=_headers(api, key))


def _post(srv, api: str, raw: bytes, key: str, retry: int | None = None) -> str:
    with httpx.Client(base_url=srv.url, timeout=30.0) as c:
        r = c.post(PATHS[api], content=raw, headers=_headers(api, key, retry))
    assert r.status_code == 200, r.text
    return r.text


def _records(save, srv, ex):
    return [r.delivered for r in TrajectoryStore(save).read_records(ex.execution_id)]


def _first_attempt_given_up(served, api, stream):
    """An execution whose first attempt of a call was given up early: (srv, eng, save, ex, raw)."""
    srv, eng, save = served
    ex = srv.register_execution()
    raw = _body(api, stream)
    _give_up_early(srv, api, stream, raw, ex.api_key)
    return srv, eng, save, ex, raw


def _assert_whole_answer(api, stream, text):
    assert (END_MARK[api] in text) if stream else ("retry" in text)


@pytest.mark.parametrize("api, stream", CASES)
def test_a_retry_in_flight_joins_the_generation(served, api, stream):
    served[1].delay_s = 0.1  # ~1.5 s of generation: still in flight when the client gives up, on a busy machine too
    srv, eng, save, ex, raw = _first_attempt_given_up(served, api, stream)
    assert srv.counters(ex.execution_id)["calls"] == 0           # still generating
    _assert_whole_answer(api, stream, _post(srv, api, raw, ex.api_key))  # the SDK sends the same bytes again
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 1)
    assert len(eng.calls) == 1                                   # one generation
    assert _records(save, srv, ex) == [True]                     # delivered once, to the retry
    c = srv.counters(ex.execution_id)
    assert (c["joined_retries"], c["delivered"], c["undelivered"]) == (1, 1, 0)


@pytest.mark.parametrize("api, stream", CASES)
def test_a_retry_of_an_undelivered_answer_gets_that_answer(served, api, stream):
    srv, eng, save, ex, raw = _first_attempt_given_up(served, api, stream)
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 1)   # answered to nobody: recorded undelivered
    _assert_whole_answer(api, stream, _post(srv, api, raw, ex.api_key))
    time.sleep(0.3)
    assert len(eng.calls) == 1 and _records(save, srv, ex) == [False]   # never trained
    assert srv.counters(ex.execution_id)["joined_retries"] == 1


@pytest.mark.parametrize("api, stream", CASES)
def test_a_retry_header_after_delivery_replays_and_a_plain_repeat_is_new(served, api, stream):
    srv, eng, save = served
    ex = srv.register_execution()
    raw = _body(api, stream)
    first = _post(srv, api, raw, ex.api_key)
    again = _post(srv, api, raw, ex.api_key, retry=1)            # the SDK retried a call it did not get whole
    assert again == first                                        # the same answer, ids included
    assert len(eng.calls) == 1 and _records(save, srv, ex) == [True]
    _post(srv, api, raw, ex.api_key, retry=0)                    # the agent asked the same again: a new call
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 2)
    assert len(eng.calls) == 2 and _records(save, srv, ex) == [True, True]
    assert srv.counters(ex.execution_id)["joined_retries"] == 1


def test_a_retry_of_a_failed_call_generates_again(served):
    srv, eng, save = served
    ex = srv.register_execution()
    raw = _body("chat", False)
    eng.fail_next = 100
    srv.router.retry_timeout_s = 0.5
    with httpx.Client(base_url=srv.url, timeout=30.0) as c:
        assert c.post(PATHS["chat"], content=raw, headers=_headers("chat", ex.api_key)).status_code == 503
    eng.fail_next = 0
    assert "retry" in _post(srv, "chat", raw, ex.api_key, retry=1)
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 1)
    assert _records(save, srv, ex) == [True] and srv.counters(ex.execution_id)["joined_retries"] == 0


def test_the_request_digest_covers_the_api_the_encoding_and_every_byte():
    import xxhash

    from gyre.proxy.retries import request_digest

    body = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    d = request_digest("chat", body, " GZIP ")
    assert d == xxhash.xxh3_128(b"chat\0gzip\0" + body).digest() and len(d) == 16
    assert request_digest("chat", body, "gzip") == d  # the header's case and spaces do not count
    flipped = body[:50_000] + bytes([body[50_000] ^ 1]) + body[50_001:]
    assert len({d, request_digest("messages", body, "gzip"), request_digest("chat", body, ""),
                request_digest("chat", flipped, "gzip"), request_digest("chat", body + b" ", "gzip")}) == 5
