"""A client retry is not a new sample, and the answer it gets counts as delivered
(gyre/proxy/model_call.py and gyre/proxy/retries.py over real HTTP on 127.0.0.1).

For each model API, streamed and not, a byte-identical request sent again by a client that gave
up on the first copy
* while the first was still being prepared (the tokenizer's thread pool held),
* while it was generating,
* after the generation ended, while its record was being stored (the store's writer held),
* after it was recorded undelivered,
gets the one answer, and the call leaves exactly one record, delivered, which the next call of the
conversation extends (its output restored from the cache, not re-rendered). After a delivered
answer, a repeat with the SDK's retry header gets the same bytes again (one record); one without
it is a new model call. A retry of a request refused in preparation is refused the same way, and
the answers kept for retries stay under ``ProxyConfig.retry_memory_bytes``.
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import threading
import time
import tracemalloc

import httpx
import pytest

from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.retries import request_digest
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.trajectory.store import TrajectoryStore, load_tree

PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
END_MARK = {"anthropic": "message_stop", "chat": "[DONE]", "responses": "response.completed"}
CASES = [(api, stream) for api in PATHS for stream in (True, False)]
ANSWER = "Hello there, this is a longer answer to retry."


class GatedStore(TrajectoryStore):
    """A record store whose writer waits at ``gate`` before each append (``waiting``: it is)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()

    def append(self, record):
        self.waiting.set()
        self.gate.wait(30)
        return super().append(record)


def _serve(r, tmp_path, **config):
    eng = ScriptedEngine("e0", r.encode(ANSWER) + [r.eos_id], chunk=1, delay_s=0.015)
    store = GatedStore(tmp_path)
    srv = ProxyServer(r, store=store, config=ProxyConfig(max_context_tokens=400, **config))
    srv.add_engine(eng)
    return srv.start(), eng, store


@pytest.fixture()
def served(local_renderer, tmp_path):
    srv, eng, store = _serve(local_renderer, tmp_path)
    yield srv, eng, store, tmp_path
    store.gate.set()
    srv.stop()


def _body(api: str, stream: bool, user: str = "hi", answer: str | None = None) -> bytes:
    """A request of ``api``: the user's message, and with ``answer`` that answer echoed and a
    next user message (the conversation's next call)."""
    msgs = [{"role": "user", "content": user}]
    if answer is not None:
        echo = ({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]}
                if api == "responses" else {"role": "assistant", "content": answer})
        msgs += [echo, {"role": "user", "content": "go on"}]
    if api == "responses":
        b = {"model": "m", "max_output_tokens": 64, "input": msgs if answer is not None else user}
    else:
        b = {"model": "m", "max_tokens": 64, "messages": msgs}
    return json.dumps(dict(b, stream=stream)).encode()


def _headers(api: str, key: str, retry: int | None = None) -> dict[str, str]:
    h = {"content-type": "application/json"}
    h.update({"x-api-key": key} if api == "anthropic" else {"authorization": f"Bearer {key}"})
    if retry is not None:
        h["x-stainless-retry-count"] = str(retry)
    return h


def _wait(pred, timeout=20.0):
    end = time.time() + timeout
    while not pred():
        assert time.time() < end, "timed out"
        time.sleep(0.01)


def _give_up_early(srv, api: str, stream: bool, raw: bytes, key: str, started: bool = True) -> None:
    """A client that leaves after the first bytes of a stream or a short read timeout."""
    with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(30.0, read=0.2)) as c:
        if stream and started:
            with c.stream("POST", PATHS[api], content=raw, headers=_headers(api, key)) as resp:
                assert resp.status_code == 200
                next(resp.iter_lines())
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post(PATHS[api], content=raw, headers=_headers(api, key))


def _send(srv, api: str, raw: bytes, key: str, retry: int | None = None) -> httpx.Response:
    with httpx.Client(base_url=srv.url, timeout=30.0) as c:
        return c.post(PATHS[api], content=raw, headers=_headers(api, key, retry))


def _post(srv, api: str, raw: bytes, key: str, retry: int | None = None) -> str:
    r = _send(srv, api, raw, key, retry)
    assert r.status_code == 200, r.text
    return r.text


def _in_thread(fn, *args):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return fut


def _records(save, ex):
    return [r.delivered for r in TrajectoryStore(save).read_records(ex.execution_id)]


def _assert_whole_answer(api, stream, text):
    assert (END_MARK[api] in text) if stream else ("retry" in text)


def _assert_one_delivered_call_extended(srv, eng, save, ex, api, stream, user="hi"):
    """One generation and one record, delivered; the conversation's next call extends it with
    the output restored (its reused prefix covers the whole first call); the live tree equals
    the one rebuilt from the record file (records and delivery marks)."""
    eid = ex.execution_id
    _wait(lambda: srv.counters(eid)["calls"] == 1)
    assert len(eng.calls) == 1 and _records(save, ex) == [True]
    c = srv.counters(eid)
    assert (c["delivered"], c["undelivered"]) == (1, 0)
    eng.delay_s = 0.0  # nothing to give up on in the next call: no need to generate slowly
    _post(srv, api, _body(api, stream, user=user, answer=ANSWER), ex.api_key)
    _wait(lambda: srv.counters(eid)["calls"] == 2)
    r0, r1 = TrajectoryStore(save).read_records(eid)
    first = r0.num_input_tokens + r0.num_output_tokens
    assert r1.metadata["reused_tokens"] >= first
    assert list(r1.input_ids[:first]) == list(r0.input_ids) + list(r0.output_ids)
    live = srv._call(lambda: (srv.tree(eid).digest(), srv.tree(eid).record_node(0), srv.tree(eid).path(
        srv.tree(eid).record_node(1))))
    assert live[1] in live[2]  # record 1's path runs through record 0's output
    assert load_tree(save / f"{eid}.jsonl").digest() == live[0]


@pytest.mark.parametrize("api, stream", CASES)
def test_a_retry_while_the_first_is_prepared_waits_for_it(served, api, stream):
    srv, eng, store, save = served
    ex = srv.register_execution()
    user = "word " * 250  # > 1,024 characters: encoded in the thread pool
    raw = _body(api, stream, user=user)
    gate = threading.Event()
    held = [srv._encoders.submit(gate.wait, 30) for _ in range(2)]  # both encoder threads busy
    try:
        _give_up_early(srv, api, stream, raw, ex.api_key, started=False)  # still being prepared
        assert len(ex.recent_calls) == 1 and srv.counters(ex.execution_id)["calls"] == 0
        retry = _in_thread(_send, srv, api, raw, ex.api_key)
        slot = ex.recent_calls.retry_target(request_digest(api, raw, ""), 0)
        _wait(lambda: slot.waiters == 1)  # the retry is waiting for the first copy's preparation
    finally:
        gate.set()
        [h.result() for h in held]
    resp = retry.result(30)
    assert resp.status_code == 200
    _assert_whole_answer(api, stream, resp.text)
    assert srv.counters(ex.execution_id)["joined_retries"] == 1
    _assert_one_delivered_call_extended(srv, eng, save, ex, api, stream, user)


@pytest.mark.parametrize("api, stream", CASES)
def test_a_retry_in_flight_joins_the_generation(served, api, stream):
    srv, eng, store, save = served
    eng.delay_s = 0.1  # ~1.5 s of generation: still in flight when the client gives up, on a busy machine too
    ex = srv.register_execution()
    raw = _body(api, stream)
    _give_up_early(srv, api, stream, raw, ex.api_key)
    assert srv.counters(ex.execution_id)["calls"] == 0           # still generating
    _assert_whole_answer(api, stream, _post(srv, api, raw, ex.api_key))  # the SDK sends the same bytes again
    assert srv.counters(ex.execution_id)["joined_retries"] == 1
    _assert_one_delivered_call_extended(srv, eng, save, ex, api, stream)


@pytest.mark.parametrize("api, stream", CASES)
def test_a_retry_while_the_record_is_stored_gets_the_answer_and_marks_it_delivered(served, api, stream):
    srv, eng, store, save = served
    ex = srv.register_execution()
    raw = _body(api, stream)
    store.gate.clear()
    _give_up_early(srv, api, stream, raw, ex.api_key)
    store.waiting.wait(20)  # generation over, the undelivered record held at the store's writer
    retry = _in_thread(_post, srv, api, raw, ex.api_key)
    _wait(lambda: srv.counters(ex.execution_id)["joined_retries"] == 1)
    assert srv.counters(ex.execution_id)["calls"] == 0
    store.gate.set()
    _assert_whole_answer(api, stream, retry.result(30))
    lines = (save / f"{ex.execution_id}.jsonl").read_bytes().splitlines()
    assert len(lines) == 2 and b'"mark":"delivered"' in lines[1]  # stored undelivered, then marked
    _assert_one_delivered_call_extended(srv, eng, save, ex, api, stream)


@pytest.mark.parametrize("api, stream", CASES)
def test_a_retry_of_an_undelivered_answer_gets_it_and_marks_it_delivered(served, api, stream):
    srv, eng, store, save = served
    ex = srv.register_execution()
    raw = _body(api, stream)
    _give_up_early(srv, api, stream, raw, ex.api_key)
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 1)   # answered to nobody: recorded undelivered
    assert _records(save, ex) == [False] and srv.counters(ex.execution_id)["undelivered"] == 1
    _assert_whole_answer(api, stream, _post(srv, api, raw, ex.api_key))
    assert srv.counters(ex.execution_id)["joined_retries"] == 1
    again = _post(srv, api, raw, ex.api_key)  # now delivered: a plain repeat is a new call
    _assert_whole_answer(api, stream, again)
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 2)
    assert _records(save, ex) == [True, True] and len(eng.calls) == 2


@pytest.mark.parametrize("api, stream", CASES)
def test_an_undelivered_answer_got_by_a_retry_is_extended_by_the_next_call(served, api, stream):
    srv, eng, store, save = served
    ex = srv.register_execution()
    raw = _body(api, stream)
    _give_up_early(srv, api, stream, raw, ex.api_key)
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 1)
    _assert_whole_answer(api, stream, _post(srv, api, raw, ex.api_key))
    _assert_one_delivered_call_extended(srv, eng, save, ex, api, stream)


@pytest.mark.parametrize("api, stream", CASES)
def test_a_retry_header_after_delivery_replays_and_a_plain_repeat_is_new(served, api, stream):
    srv, eng, store, save = served
    ex = srv.register_execution()
    raw = _body(api, stream)
    first = _post(srv, api, raw, ex.api_key)
    again = _post(srv, api, raw, ex.api_key, retry=1)            # the SDK retried a call it did not get whole
    assert again == first                                        # the same answer, ids included
    assert len(eng.calls) == 1 and _records(save, ex) == [True]
    _post(srv, api, raw, ex.api_key, retry=0)                    # the agent asked the same again: a new call
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 2)
    assert len(eng.calls) == 2 and _records(save, ex) == [True, True]
    assert srv.counters(ex.execution_id)["joined_retries"] == 1


@pytest.mark.parametrize("api", list(PATHS))
def test_a_retry_of_a_request_refused_in_preparation_is_refused_the_same_way(served, api):
    srv, eng, store, save = served
    ex = srv.register_execution()
    raw = _body(api, False, user="word " * 450)  # ~450 tokens: over max_context_tokens, known once encoded
    gate = threading.Event()
    held = [srv._encoders.submit(gate.wait, 30) for _ in range(2)]
    try:
        first = _in_thread(_send, srv, api, raw, ex.api_key)
        _wait(lambda: len(ex.recent_calls) == 1)
        retry = _in_thread(_send, srv, api, raw, ex.api_key, 1)
        slot = ex.recent_calls.retry_target(request_digest(api, raw, ""), 1)
        _wait(lambda: slot.waiters == 1)
    finally:
        gate.set()
        [h.result() for h in held]
    a, b = first.result(30), retry.result(30)
    assert a.status_code == b.status_code == 400 and a.json() == b.json() and "too long" in a.text
    assert len(ex.recent_calls) == 0                                 # no placeholder left behind
    c = _send(srv, api, raw, ex.api_key, 2)                          # a later copy: evaluated again
    assert c.status_code == 400 and c.json() == a.json()
    assert srv.counters(ex.execution_id)["rejected"] == 3 and eng.calls == []


def test_a_retry_of_a_failed_call_generates_again(served):
    srv, eng, store, save = served
    ex = srv.register_execution()
    raw = _body("chat", False)
    eng.fail_next = 100
    srv.router.retry_timeout_s = 0.5
    assert _send(srv, "chat", raw, ex.api_key).status_code == 503
    eng.fail_next = 0
    assert "retry" in _post(srv, "chat", raw, ex.api_key, retry=1)
    _wait(lambda: srv.counters(ex.execution_id)["calls"] == 1)
    assert _records(save, ex) == [True] and srv.counters(ex.execution_id)["joined_retries"] == 0


@pytest.mark.slow  # hundreds of calls under tracemalloc
def test_the_answers_kept_for_retries_stay_under_the_byte_bound(local_renderer, tmp_path):
    """Twelve executions' calls through a bound that holds three: the oldest are forgotten (a
    retry of one is a new generation), the newest replayed; the bytes counted per kept call
    cover what forgetting them frees (tracemalloc)."""
    srv, eng, store = _serve(local_renderer, tmp_path, retry_memory_bytes=1)
    try:
        raw = _body("anthropic", True)
        ex0 = srv.register_execution()
        _post(srv, "anthropic", raw, ex0.api_key)
        _wait(lambda: srv.retry_memory.evicted == 1)  # one call is over any 1-byte bound
        one = _answer_nbytes(srv, raw)
        limit = srv.retry_memory.limit_bytes = 3 * one + one // 2
        exs = [srv.register_execution() for _ in range(12)]
        for i, ex in enumerate(exs):
            _post(srv, "anthropic", raw, ex.api_key)
            _wait(lambda: srv.retry_memory.snapshot()["calls"] == min(i + 1, 3))
            snap = srv.retry_memory.snapshot()
            assert snap["bytes"] <= limit and abs(snap["bytes"] - snap["calls"] * one) < 100  # ids vary
        assert srv.retry_memory.evicted == 1 + 9 and [len(ex.recent_calls) for ex in exs] == [0] * 9 + [1] * 3
        n = len(eng.calls)
        assert _post(srv, "anthropic", raw, exs[-1].api_key, retry=1) and len(eng.calls) == n       # replayed
        assert _post(srv, "anthropic", raw, exs[0].api_key, retry=1) and len(eng.calls) == n + 1    # forgotten
    finally:
        srv.stop()


def _answer_nbytes(srv, raw):
    """Bytes counted for one kept streamed call, checked against what forgetting it frees."""
    tracemalloc.start()
    try:
        exs = [srv.register_execution() for _ in range(20)]
        srv.retry_memory.limit_bytes = 1 << 40
        for ex in exs:
            _post(srv, "anthropic", raw, ex.api_key)
        _wait(lambda: srv.retry_memory.snapshot()["calls"] == 20)
        counted = srv.retry_memory.nbytes
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        srv._call(lambda: [ex.recent_calls.clear() for ex in exs])
        gc.collect()
        freed = before - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert srv.retry_memory.nbytes == 0
    # the count is within a factor of 1.5 of what clearing them gives back; the proxy's own thread
    # may free other objects in the same moment (71,702 B freed for 52,616 counted was seen once)
    assert 0.5 * counted < freed <= 1.5 * counted, (freed, counted)
    return counted // 20


def test_a_waiting_retry_joins_its_call_even_after_newer_requests_pushed_the_placeholder_out():
    import asyncio
    import types

    from gyre.proxy.retries import RecentCalls

    async def go():
        recent = RecentCalls(size=1)
        first = recent.reserve(b"a")
        waiter = asyncio.ensure_future(first.wait())
        await asyncio.sleep(0)
        recent.reserve(b"b")                          # a newer request: "a" is pushed out
        assert recent.retry_target(b"a", 0) is None and first.waiters == 1
        call = types.SimpleNamespace(digest=b"")
        recent.add(b"a", call, first)
        assert await asyncio.wait_for(waiter, 5) is call
        refused = recent.reserve(b"c")
        waiter = asyncio.ensure_future(refused.wait())
        await asyncio.sleep(0)
        from gyre.proxy.errors import ProxyError
        recent.abandon(b"c", refused, ProxyError(400, "bad", param="messages"))
        with pytest.raises(ProxyError) as err:
            await waiter
        assert (err.value.status, err.value.message, err.value.param) == (400, "bad", "messages")
        assert recent.retry_target(b"c", 0) is None

    asyncio.run(go())
