"""What the proxy's engine adapter (``ClientEngine``) sends an SGLang server: request ids no other id
begins (SGLang aborts by prefix), and a seed of each request's own (SGLang in deterministic mode
samples every unseeded request with one fixed seed).  The seeding is shown against a stand-in
SGLang server on 127.0.0.1 that samples as SGLang's deterministic mode does."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gyre.proxy.engines import RID_END, ClientEngine, engine_rid, request_seed


def test_engine_ids_are_prefix_free_and_distinct():
    """Against every pair of ids over an alphabet holding the end and escape characters (brute force),
    and Gyre's own ids: no id's engine id begins another's."""
    alphabet = ["E", "1", "2", "-", ".", "r", RID_END, "\\"]
    ids = ["".join(p) for n in range(4) for p in itertools.product(alphabet, repeat=n)]
    wire = [engine_rid(i) for i in ids]
    assert len(set(wire)) == len(ids)
    by_len = sorted(wire, key=len)
    for i, a in enumerate(by_len):
        for b in by_len[i + 1:]:
            assert not b.startswith(a), (a, b)
    assert [engine_rid(r) for r in ("E-1", "E-12", "E-1.r1")] == ["E-1#", "E-12#", "E-1.r1#"]
    assert not any(engine_rid(r).startswith(engine_rid("E-1")) for r in ("E-12", "E-1.r1", "E-1.r12"))


def test_the_request_and_its_abort_carry_the_same_engine_id():
    from types import SimpleNamespace

    seen = []

    class Client:
        async def stream(self, ids, params, *, rid, return_logprob):
            seen.append(("stream", rid))
            yield SimpleNamespace(delta_output_ids=[5], delta_logprobs=[-0.1], weight_version="0",
                                  finish_reason=SimpleNamespace(type="length", status_code=None))

        async def abort(self, rid):
            seen.append(("abort", rid))

    async def run(engine):
        [ch async for ch in engine.generate_stream([1, 2], {}, "E-1")]
        await engine.abort("E-1")

    asyncio.run(run(ClientEngine(Client(), "e0")))
    assert seen == [("stream", "E-1#"), ("abort", "E-1#")]


class _DeterministicSGLang(BaseHTTPRequestHandler):
    """An SGLang server in deterministic mode, scripted: ``/server_info`` reports an SGLang version
    (or the embedded engine), and ``/generate`` streams ``max_new_tokens`` ids drawn with the
    request's ``sampling_seed``, or with seed 42 when it has none (as SGLang does in that mode)."""

    info: dict = {}
    bodies: list = []

    def do_GET(self):
        if self.path != "/server_info":
            self.send_error(404)
            return
        self._send(200, "application/json", json.dumps(self.info).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.bodies.append(body)
        params = body.get("sampling_params") or {}
        rng = random.Random(params.get("sampling_seed", 42))
        n = params["max_new_tokens"]
        ids = [rng.randrange(1000) for _ in range(n)]
        event = {"output_ids": ids, "meta_info": {"id": body["rid"], "weight_version": "0",
                                                  "finish_reason": {"type": "length", "length": n},
                                                  "output_token_logprobs": [[-1.0, t, None] for t in ids]}}
        self._send(200, "text/event-stream", f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())

    def _send(self, status, kind, data):
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def stand_in():
    handler = type("H", (_DeterministicSGLang,), {"info": {}, "bodies": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield handler, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _group(url, rids, **kw):
    """The outputs of one prompt sampled once per rid through a default ``ClientEngine``."""
    from gyre.rollout.client.async_client import AsyncEngineClient

    async def run():
        async with AsyncEngineClient(url) as client:
            engine = ClientEngine(client, "engine-0", **kw)
            outs = []
            for rid in rids:
                outs.append([t async for ch in engine.generate_stream([7, 8, 9], {"max_new_tokens": 6}, rid)
                             for t in ch.output_ids])
            return outs, engine.seed_each_request

    return asyncio.run(run())


def test_a_group_on_a_deterministic_sglang_gets_distinct_outputs(stand_in):
    """The engine reports an SGLang version, whatever switched its deterministic mode on: each request
    carries the seed of its own rid, so a group's identical prompts are sampled apart."""
    handler, url = stand_in
    handler.info = {"version": "0.5.23"}
    rids = [f"exec{i}-1" for i in range(4)]
    outs, seeded = _group(url, rids)
    assert seeded is True and len({tuple(o) for o in outs}) == 4
    assert [b["sampling_params"]["sampling_seed"] for b in handler.bodies] == [request_seed(r) for r in rids]
    assert [b["rid"] for b in handler.bodies] == [r + RID_END for r in rids]
    handler.bodies.clear()
    outs, _ = _group(url, rids, seed_each_request=False)  # what an unseeded group gets there
    assert len({tuple(o) for o in outs}) == 1 and "sampling_seed" not in handler.bodies[0]["sampling_params"]


def test_the_embedded_engine_and_a_seed_the_caller_chose_are_left_as_they_are(stand_in):
    handler, url = stand_in
    handler.info = {"version": "0.1.0", "engine": "gyre-embedded"}
    _, seeded = _group(url, ["e-1"])
    assert seeded is False and "sampling_seed" not in handler.bodies[0]["sampling_params"]
    handler.info = {"version": "0.5.23"}
    handler.bodies.clear()

    async def run():
        from gyre.rollout.client.async_client import AsyncEngineClient

        async with AsyncEngineClient(url) as client:
            engine = ClientEngine(client, "engine-0")
            [ch async for ch in engine.generate_stream([1], {"max_new_tokens": 2, "sampling_seed": 7}, "e-2")]

    asyncio.run(run())
    assert handler.bodies[0]["sampling_params"]["sampling_seed"] == 7


def test_requests_to_sglang_are_keyed_by_the_weight_version_the_engine_reports_before_each():
    """``extra_key`` is ``weights-<version>`` as the engine answers just before each request (a push
    between two requests changes it); while the engine gives no answer the last version is kept; an
    engine that is not SGLang gets no key."""
    from types import SimpleNamespace

    class Client:
        def __init__(self, info):
            self.info, self.versions, self.keys = info, ["3", "4", RuntimeError("down")], []

        async def get_server_info(self):
            return self.info

        async def get_weight_version(self):
            v = self.versions.pop(0)
            if isinstance(v, Exception):
                raise v
            return v

        async def stream(self, ids, params, *, rid, return_logprob, **kw):
            self.keys.append(kw.get("extra_key"))
            yield SimpleNamespace(delta_output_ids=[5], delta_logprobs=[-0.1], weight_version="0",
                                  finish_reason=SimpleNamespace(type="length", status_code=None))

    async def run(client):
        engine = ClientEngine(client, "e0")
        for n in range(3):
            [ch async for ch in engine.generate_stream([1, 2], {}, f"E-{n}")]
        return client.keys

    assert asyncio.run(run(Client({"version": "0.5.23"}))) == ["weights-3", "weights-4", "weights-4"]
    assert asyncio.run(run(Client({"model_path": "tiny"}))) == [None] * 3
