"""Routing and transparent retry (gyre/proxy/router.py) with scripted engines."""

from __future__ import annotations

import asyncio

import pytest

from gyre.proxy.engines import EngineChunk, EngineRejected, EngineUnavailable, ScriptedEngine, parse_version
from gyre.proxy.router import Attempt, GenerationFailed, RouteError, Router


async def _collect(router, eid, ids, params, **kw):
    out, finish = [], None
    async for ch in router.generate(eid, ids, params, **kw):
        out += ch.output_ids
        finish = ch.finish_reason or finish
    return out, finish


def test_routes_and_reroute():
    r = Router()
    r.add_engine(ScriptedEngine("a", [1, 2]))
    r.add_engine(ScriptedEngine("b", [1, 2]))
    r.set_route("x", "a")
    r.set_route("y", "a")
    r.set_route("z", "b")
    assert r.reroute_engine("a", "b") == ["x", "y"] and r.route("x") == "b"
    with pytest.raises(RouteError):
        r.set_route("x", "nope")
    with pytest.raises(RouteError):
        r.route("unknown")


def test_plain_generation_and_length():
    r = Router()
    r.add_engine(ScriptedEngine("a", list(range(10)), chunk=3))
    r.set_route("x", "a")
    att: list[Attempt] = []
    out, finish = asyncio.run(_collect(r, "x", [5], {"max_new_tokens": 4}, attempts=att))
    assert out == [0, 1, 2, 3] and finish == "length" and [a.outcome for a in att] == ["length"]


def test_abort_is_continued_on_the_new_route():
    a = ScriptedEngine("a", lambda ids, p: list(range(100, 120))[len(ids) - 1:], chunk=2, delay_s=0.01)
    b = ScriptedEngine("b", lambda ids, p: list(range(100, 120))[len(ids) - 1:], chunk=2)
    r = Router(retry_backoff_s=5.0)  # a reroute must not wait for the backoff
    r.add_engine(a)
    r.add_engine(b)
    r.set_route("x", "a")
    retries = []
    r.on_retry = lambda eid, att, rerouted: retries.append(rerouted)

    async def main():
        att: list[Attempt] = []
        task = asyncio.create_task(_collect(r, "x", [7], {"max_new_tokens": 50}, attempts=att))
        while not r.inflight("a") or len(a.calls) == 0:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.03)
        r.set_route("x", "b")
        assert await r.abort_engine("a") == 1
        out, finish = await asyncio.wait_for(task, 2.0)
        return out, finish, att

    out, finish, att = asyncio.run(main())
    assert out == list(range(100, 120)) and finish == "stop"
    assert [x.engine_id for x in att] == ["a", "b"] and att[0].outcome == "abort" and att[0].tokens > 0
    assert att[0].tokens + att[1].tokens == 20 and retries == [True]
    assert b.calls[0][1] == [7] + list(range(100, 100 + att[0].tokens))  # continuation input
    assert b.calls[0][0] == att[1].rid and att[1].rid.endswith(".r1")


def test_retry_keeps_the_remaining_min_new_tokens():
    seen: list[dict] = []

    def script(ids, params):
        seen.append(dict(params))
        return list(range(100, 120))[len(ids) - 1:]

    a = ScriptedEngine("a", script, chunk=2, delay_s=0.01)
    b = ScriptedEngine("b", script, chunk=2)
    r = Router()
    r.add_engine(a)
    r.add_engine(b)
    r.set_route("x", "a")

    async def main():
        att: list[Attempt] = []
        task = asyncio.create_task(_collect(r, "x", [7], {"max_new_tokens": 20, "min_new_tokens": 15}, attempts=att))
        while not r.inflight("a") or len(a.calls) == 0:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.03)
        r.set_route("x", "b")
        await r.abort_engine("a")
        await asyncio.wait_for(task, 2.0)
        return att

    att = asyncio.run(main())
    done = att[0].tokens
    assert 0 < done < 15 and len(seen) == 2
    assert seen[0]["min_new_tokens"] == 15 and seen[0]["max_new_tokens"] == 20
    assert seen[1]["min_new_tokens"] == 15 - done and seen[1]["max_new_tokens"] == 20 - done


class _Refusing:
    """An engine that refuses every request as invalid (an engine 4xx); counts the calls."""

    engine_id = "bad"

    def __init__(self):
        self.calls = 0

    async def generate_stream(self, ids, params, rid):
        self.calls += 1
        raise EngineRejected(400, "top_p must be in (0, 1]")
        yield  # pragma: no cover

    async def abort(self, rid):
        pass


def test_engine_rejection_is_raised_at_once_never_retried():
    e = _Refusing()
    r = Router(retry_timeout_s=60, retry_backoff_s=0.5)
    r.add_engine(e)
    r.set_route("x", "bad")
    att: list[Attempt] = []
    with pytest.raises(EngineRejected) as info:
        asyncio.run(asyncio.wait_for(_collect(r, "x", [1], {"max_new_tokens": 4}, attempts=att), 2.0))
    assert info.value.status == 400 and e.calls == 1 and [a.outcome for a in att] == ["rejected"]


def test_failures_back_off_then_give_up():
    e = ScriptedEngine("a", [1, 2, 3], fail_next=2)
    r = Router(retry_backoff_s=0.001)
    r.add_engine(e)
    r.set_route("x", "a")
    att: list[Attempt] = []
    out, finish = asyncio.run(_collect(r, "x", [0], {}, attempts=att))
    assert out == [1, 2, 3] and [x.outcome for x in att] == ["error", "error", "stop"]
    dead = ScriptedEngine("d", [1], fail_next=10 ** 6)
    r2 = Router(retry_timeout_s=0.05, retry_backoff_s=0.01)
    r2.add_engine(dead)
    r2.set_route("x", "d")
    with pytest.raises(GenerationFailed):
        asyncio.run(_collect(r2, "x", [0], {}))


def test_waiting_retry_wakes_up_on_route_change():
    dead = ScriptedEngine("d", [1], fail_next=10 ** 6)
    ok = ScriptedEngine("ok", [4, 5])
    r = Router(retry_backoff_s=30.0, retry_backoff_max_s=30.0)
    r.add_engine(dead)
    r.add_engine(ok)
    r.set_route("x", "d")

    async def main():
        task = asyncio.create_task(_collect(r, "x", [0], {}))
        await asyncio.sleep(0.05)  # first attempt failed, now waiting 30 s
        r.set_route("x", "ok")
        return await asyncio.wait_for(task, 2.0)

    assert asyncio.run(main()) == ([4, 5], "stop")


def test_parse_version():
    assert [parse_version(v) for v in (None, 3, "4", "v5", "default")] == [None, 3, 4, 5, None]


def test_client_engine_adapter_maps_chunks_and_errors():
    from types import SimpleNamespace as NS

    from gyre.proxy.engines import ClientEngine

    class Client:
        def __init__(self, fail=False):
            self.fail = fail

        async def stream(self, ids, params, rid, return_logprob):
            if self.fail:
                raise ConnectionError("refused")
            yield NS(delta_output_ids=[1, 2], delta_logprobs=[-0.1, -0.2], finish_reason=None, weight_version="v2")
            yield NS(delta_output_ids=[3], delta_logprobs=[-0.3], finish_reason=NS(type="stop"), weight_version="v2")

        async def abort(self, rid):
            return True

    async def run(engine):
        return [c async for c in engine.generate_stream([0], {}, "r")]

    chunks = asyncio.run(run(ClientEngine(Client(), "e")))
    assert chunks == [EngineChunk([1, 2], [-0.1, -0.2], None, 2), EngineChunk([3], [-0.3], "stop", 2)]
    with pytest.raises(EngineUnavailable):
        asyncio.run(run(ClientEngine(Client(fail=True), "e")))
    from gyre.rollout.client.messages import EngineConnectionError, EngineError

    class Failing(Client):
        def __init__(self, exc):
            self.exc = exc

        async def stream(self, ids, params, rid, return_logprob):
            raise self.exc
            yield  # pragma: no cover

    # an engine 4xx is a refusal (not retried); 5xx, 429 and connection errors are unavailability
    with pytest.raises(EngineRejected) as info:
        asyncio.run(run(ClientEngine(Failing(EngineError(400, "bad top_p")), "e")))
    assert info.value.status == 400 and info.value.message == "bad top_p"
    for exc in (EngineError(500, "boom"), EngineError(503, "busy"), EngineError(429, "slow down"),
                EngineConnectionError("refused")):
        with pytest.raises(EngineUnavailable):
            asyncio.run(run(ClientEngine(Failing(exc), "e")))


def test_each_request_gets_its_own_seed_for_a_deterministic_sglang():
    """SGLang with deterministic inference samples every request without a sampling_seed with the
    same seed: a group's identical prompts would all get one output.  The engine adapter then gives
    each request a seed of its own (stable per rid) and keeps one the client chose."""
    from types import SimpleNamespace

    from gyre.proxy.engines import ClientEngine, request_seed

    sent = []

    class Client:
        async def stream(self, ids, params, *, rid, return_logprob):
            sent.append(params)
            yield SimpleNamespace(delta_output_ids=[5], delta_logprobs=[-0.1], weight_version="0",
                                  finish_reason=SimpleNamespace(type="length", status_code=None))

    async def run(engine, rid, params):
        return [ch async for ch in engine.generate_stream([1, 2], params, rid)]

    seeded, plain = ClientEngine(Client(), "e0", seed_each_request=True), ClientEngine(Client(), "e1")
    for rid in ("g0-s0", "g0-s1", "g0-s2"):
        asyncio.run(run(seeded, rid, {"temperature": 1.0}))
    asyncio.run(run(seeded, "g0-s3", {"sampling_seed": 7}))
    asyncio.run(run(plain, "g0-s4", {"temperature": 1.0}))
    seeds = [p.get("sampling_seed") for p in sent]
    assert seeds[:3] == [request_seed(r) for r in ("g0-s0", "g0-s1", "g0-s2")] and len(set(seeds[:3])) == 3
    assert seeds[3] == 7 and seeds[4] is None
    assert all(0 <= s < 2 ** 63 for s in seeds[:3])


def test_an_abort_with_a_4xx_status_is_a_rejection_and_a_plain_abort_is_not():
    """SGLang ends a prompt longer than its context as an abort with status_code 400: that is the
    request's fault (EngineRejected, no retry); an abort without a status (a pause, a client) is not."""
    from types import SimpleNamespace

    import pytest

    from gyre.proxy.engines import ClientEngine, EngineRejected

    def client(status):
        class Client:
            async def stream(self, ids, params, *, rid, return_logprob):
                yield SimpleNamespace(delta_output_ids=[], delta_logprobs=[], weight_version="0",
                                      finish_reason=SimpleNamespace(type="abort", status_code=status,
                                                                    message="The input (1495 tokens) is longer"))
        return Client()

    async def run(engine):
        return [ch.finish_reason async for ch in engine.generate_stream([1], {}, "r")]

    with pytest.raises(EngineRejected) as ei:
        asyncio.run(run(ClientEngine(client(400), "e0")))
    assert ei.value.status == 400 and "longer" in ei.value.message
    for status in (None, 429):  # no status, or "not now": retried like any abort
        assert asyncio.run(run(ClientEngine(client(status), "e0"))) == ["abort"]
