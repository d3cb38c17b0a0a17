"""The engine clients (gyre/rollout/client/): the blocking one against a scripted
httpx transport, the asyncio one (aiohttp) against scripted servers on 127.0.0.1: request bodies, typed results,
stream normalisation (cumulative and incremental), error mapping."""

import asyncio
import json

import httpx
import pytest
import torch

from gyre.rollout.api.sglang_api import SamplingParams
from gyre.rollout.client.async_client import AsyncEngineClient
from gyre.rollout.client.engine_client import EngineClient
from gyre.rollout.client.messages import EngineConnectionError, EngineError, FinishReason, build_generate_body
from gyre.rollout.weights import deserialize_named_tensors


def result(ids, lps, rid="r", finish=None, version="v0", cached=0, index=None):
    d = {"text": "".join(chr(97 + i % 26) for i in ids), "output_ids": ids,
         "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids),
                       "cached_tokens": cached, "weight_version": version,
                       "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}
    if index is not None:
        d["index"] = index
    return d


class Script:
    """An httpx transport that records requests and answers from a handler."""

    def __init__(self, handler):
        self.handler = handler
        self.requests = []

    def __call__(self, request: httpx.Request):
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        return self.handler(request.url.path, body)


def client(handler, **kw):
    s = Script(handler)
    return EngineClient("http://engine", transport=httpx.MockTransport(s), **kw), s


class ScriptServer:
    """An HTTP server on 127.0.0.1 (aiohttp, in a thread) answering every request from
    ``handler(path, body) -> httpx.Response``; ``requests`` as :class:`Script`'s.  ``raw`` maps a
    path to a coroutine ``(request) -> response`` for answers a whole body cannot script (a stall,
    a connection cut mid-stream)."""

    def __init__(self, handler=None, raw=None):
        self.handler, self.raw, self.requests = handler, raw or {}, []

    async def _answer(self, request):
        from aiohttp import web

        if request.path in self.raw:
            return await self.raw[request.path](request)
        data = await request.read()
        body = json.loads(data) if data else None
        self.requests.append((request.method, request.path, body))
        r = self.handler(request.path, body)
        return web.Response(status=r.status_code, body=r.content,
                            headers={k: v for k, v in r.headers.items() if k.lower() != "content-length"})

    def __enter__(self):
        import threading

        from aiohttp import web

        ready = threading.Event()

        async def main():
            app = web.Application(client_max_size=1 << 26)
            app.router.add_route("*", "/{tail:.*}", self._answer)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self._stop = asyncio.Event()
            ready.set()
            await self._stop.wait()
            await self._runner.cleanup()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(main(),), daemon=True)
        self._thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def test_generate_body_and_typed_result():
    c, s = client(lambda path, body: httpx.Response(200, json=result([5, 6], [-0.5, -1.0],
                                                                      finish={"type": "length", "length": 2})))
    r = c.generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.7), rid="abc")
    method, path, body = s.requests[0]
    assert (method, path) == ("POST", "/generate")
    assert body == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.7},
                    "return_logprob": True, "stream": False, "rid": "abc"}
    assert r.output_ids == [5, 6] and r.output_logprobs == [-0.5, -1.0] and r.weight_version == "v0"
    assert r.finish_reason == FinishReason("length", length=2) and not r.aborted


def test_n_and_batch_return_lists():
    c, s = client(lambda path, body: httpx.Response(200, json=[result([1], [-0.1]), result([2], [-0.2])]))
    assert len(c.generate([1], {"n": 2})) == 2
    rs = c.generate_batch([[1], [2, 3]], {"max_new_tokens": 1}, rids=["a", "b"])
    assert [r.output_ids for r in rs] == [[1], [2]]
    assert s.requests[-1][2]["input_ids"] == [[1], [2, 3]] and s.requests[-1][2]["rid"] == ["a", "b"]
    assert build_generate_body([[1]], None, return_logprob=False)["input_ids"] == [[1]]


def test_errors_map_to_engine_error_and_aborts_are_results():
    c, _ = client(lambda path, body: httpx.Response(400, json={"error": {"message": "bad ids", "code": 400}}))
    with pytest.raises(EngineError) as ei:
        c.generate([1])
    assert ei.value.status_code == 400 and ei.value.message == "bad ids"
    c, _ = client(lambda path, body: httpx.Response(200, json=result([1], [-1.0], finish={"type": "abort",
                                                                                          "message": "x"})))
    assert c.generate([1]).aborted

    def boom(request):
        raise httpx.ConnectError("refused")

    dead = EngineClient("http://engine", transport=httpx.MockTransport(boom))
    with pytest.raises(EngineConnectionError):
        dead.generate([1])
    assert dead.health() is False


def test_abort_true_false_and_other_errors():
    answers = {"known": (200, {"success": True}), "gone": (400, {"success": False, "error": {"message": "no"}}),
               "bad": (400, {"error": {"message": "rid must be a string"}})}
    c, s = client(lambda path, body: httpx.Response(answers[body.get("rid", "known")][0],
                                                    json=answers[body.get("rid", "known")][1]))
    assert c.abort("known") is True and c.abort("gone") is False
    with pytest.raises(EngineError):
        c.abort("bad")
    c.abort_all()
    assert s.requests[-1][2] == {"abort_all": True}


def test_control_calls_use_sglang_paths_and_bodies(tmp_path):
    c, s = client(lambda path, body: httpx.Response(200, json={"success": True, "weight_version": "w"}))
    c.pause_generation("in_place")
    c.continue_generation()
    c.release_memory_occupation(["kv_cache"])
    c.resume_memory_occupation()
    c.flush_cache()
    c.update_weights_from_disk(tmp_path, weight_version="v1", abort_all_requests=True)
    c.update_weights_from_tensor({"w": torch.ones(2)}, weight_version="v2")
    c.update_weight_version("v3")
    assert c.get_weight_version() == "w"
    paths = [(p, b) for _, p, b in s.requests]
    assert paths[:6] == [("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {}),
                         ("/release_memory_occupation", {"tags": ["kv_cache"]}), ("/resume_memory_occupation", {}),
                         ("/flush_cache", None),
                         ("/update_weights_from_disk", {"model_path": str(tmp_path), "load_format": None,
                                                        "weight_version": "v1", "abort_all_requests": True,
                                                        "flush_cache": True})]
    assert paths[6] == ("/server_info", None)  # an embedded-format payload goes to no SGLang server
    tensor_body = paths[7][1]
    assert paths[7][0] == "/update_weights_from_tensor" and tensor_body["weight_version"] == "v2"
    assert torch.equal(deserialize_named_tensors(tensor_body["serialized_named_tensors"])["w"], torch.ones(2))
    assert paths[8] == ("/update_weight_version", {"new_version": "v3", "abort_all_requests": False})
    with pytest.raises(ValueError):
        c.update_weights_from_disk("/x", weight_version="")
    with pytest.raises(ValueError):
        c.update_weights_from_tensor(weight_version="v")


def _sse(events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


STOP = {"type": "stop", "matched": 9}


@pytest.mark.parametrize("incremental", [False, True, "sglang"])
def test_stream_normalises_cumulative_and_incremental_events(incremental):
    if incremental == "sglang":  # SGLang's incremental mode: ids are deltas, log-probs stay cumulative
        events = [result([1], [-0.1]), result([2, 3], [-0.2, -0.3]), result([9], [-0.9], finish=STOP)]
        whole = [[-0.1, 1, None], [-0.2, 2, None], [-0.3, 3, None], [-0.9, 9, None]]
        for e, n in zip(events, (1, 3, 4)):
            e["meta_info"]["output_token_logprobs"] = whole[:n]
    elif incremental:
        events = [result([1], [-0.1]), result([2, 3], [-0.2, -0.3]), result([9], [-0.9], finish=STOP)]
    else:
        events = [result([1], [-0.1]), result([1, 2, 3], [-0.1, -0.2, -0.3]),
                  result([1, 2, 3, 9], [-0.1, -0.2, -0.3, -0.9], finish=STOP)]

    def handler(path, body):
        if path == "/server_info":
            return httpx.Response(200, json={"incremental_streaming_output": bool(incremental)})
        assert body["stream"] is True
        return httpx.Response(200, text=_sse(events), headers={"content-type": "text/event-stream"})

    c, _ = client(handler)
    chunks = list(c.stream([1], {"max_new_tokens": 4}))
    assert [ch.delta_output_ids for ch in chunks] == [[1], [2, 3], [9]]
    assert [ch.delta_logprobs for ch in chunks] == [[-0.1], [-0.2, -0.3], [-0.9]]
    assert chunks[-1].output_ids == [1, 2, 3, 9] and chunks[-1].finished and not chunks[0].finished
    assert "".join(ch.delta_text for ch in chunks) == chunks[-1].text == "bcdj"

    async def astream(url):
        ac = AsyncEngineClient(url)
        out = [ch async for ch in ac.stream([1])]
        await ac.aclose()
        return out

    with ScriptServer(handler) as server:
        achunks = asyncio.run(astream(server.url))
    assert [ch.delta_output_ids for ch in achunks] == [[1], [2, 3], [9]]


def test_stream_error_event_raises():
    def handler(path, body):
        if path == "/server_info":
            return httpx.Response(200, json={})
        return httpx.Response(200, text=_sse([{"error": {"message": "boom"}}]))

    c, _ = client(handler)
    with pytest.raises(EngineError, match="boom"):
        list(c.stream([1]))


def test_async_client_generate_and_health():
    async def main(url):
        async with AsyncEngineClient(url) as c:
            r = await c.generate([1, 2], {"max_new_tokens": 1}, rid="g")
            ok = await c.health()
            assert await c.abort("x") is True
        return r, ok

    with ScriptServer(lambda path, body: httpx.Response(200, json=result([4], [-0.4]))) as server:
        r, ok = asyncio.run(main(server.url))
    assert r.output_ids == [4] and r.output_logprobs == [-0.4] and ok
    assert [(m, p) for m, p, _ in server.requests] == [("POST", "/generate"), ("GET", "/health"), ("POST", "/abort_request")]
    assert server.requests[0][2] == {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1},
                                     "return_logprob": True, "stream": False, "rid": "g"}


def test_async_client_errors_map_to_engine_errors():
    """An error status (its message from the body, in a stream too), a refused connection, a server
    that stalls past the read timeout and one that cuts a stream short each raise the engine error
    the proxy's adapter expects."""
    from aiohttp import web

    async def stall(request):
        await asyncio.sleep(3)
        return web.json_response({})

    async def cut(request):
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse([result([1], [-0.1])]).split("data: [DONE]")[0].encode())
        request.transport.close()  # the engine died mid-stream
        return resp

    def handler(path, body):
        if path == "/server_info":
            return httpx.Response(200, json={"incremental_streaming_output": True})
        return httpx.Response(400, json={"error": {"message": "prompt is too long"}})

    async def main(url, dead_url):
        c = AsyncEngineClient(url, timeout=0.5)
        with pytest.raises(EngineError, match="prompt is too long") as err:
            await c.generate([1])
        assert err.value.status_code == 400 and not isinstance(err.value, EngineConnectionError)
        with pytest.raises(EngineError, match="prompt is too long"):
            [ch async for ch in c.stream([1])]
        with pytest.raises(EngineConnectionError, match="/flush_cache"):
            await c.flush_cache()  # stalls 3 s, read timeout 0.5 s
        await c.aclose()
        dead = AsyncEngineClient(dead_url)
        with pytest.raises(EngineConnectionError, match="/generate"):
            await dead.generate([1])
        assert await dead.health() is False
        await dead.aclose()

    async def cut_stream(url):
        async with AsyncEngineClient(url) as c:
            got = []
            with pytest.raises(EngineConnectionError, match="/generate"):
                async for ch in c.stream([1]):
                    got.append(ch.delta_output_ids)
            return got

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        with ScriptServer(handler, raw={"/flush_cache": stall}) as server:
            asyncio.run(main(server.url, dead_url))
        with ScriptServer(handler, raw={"/generate": cut}) as server:
            assert asyncio.run(cut_stream(server.url)) == [[1]]


def test_async_stream_reads_long_lines_and_serves_two_event_loops():
    """A cumulative stream repeats every output id and logprob in each event, so a line can be far
    longer than aiohttp's line buffer (128 KiB); and one client serves a second event loop after
    the first one closed."""
    n = 40_000
    events = [result(list(range(1, k + 1)), [-0.5] * k, finish=STOP if k == n else None) for k in (1, n // 2, n)]

    def handler(path, body):
        if path == "/server_info":
            return httpx.Response(200, json={})
        return httpx.Response(200, text=_sse(events), headers={"content-type": "text/event-stream"})

    c = AsyncEngineClient("http://unset")

    async def run():
        return [ch async for ch in c.stream([1])]

    with ScriptServer(handler) as server:
        assert len(_sse(events[-1:])) > 512 * 1024
        c.base_url = server.url
        first = asyncio.run(run())
        second = asyncio.run(run())
    for chunks in (first, second):
        assert [len(ch.delta_output_ids) for ch in chunks] == [1, n // 2 - 1, n // 2]
        assert chunks[-1].output_ids == list(range(1, n + 1)) and chunks[-1].finished


def test_info_calls_use_sglang_0_5_10_paths_and_fall_back_on_older_engines():
    new = {"/model_info": {"weight_version": "v7", "model_path": "/m"}, "/server_info": {"tp_size": 2}}
    c, s = client(lambda path, body: httpx.Response(200, json=new[path]) if path in new else httpx.Response(404))
    assert c.get_weight_version() == "v7" and c.get_server_info() == {"tp_size": 2}
    assert [p for _, p, _ in s.requests] == ["/model_info", "/server_info"]
    old = {"/get_model_info": {"weight_version": "v1"}, "/get_server_info": {"tp_size": 1}}
    c, s = client(lambda path, body: httpx.Response(200, json=old[path]) if path in old
                  else httpx.Response(404, json={"detail": "Not Found"}))
    assert c.get_weight_version() == "v1" and c.get_server_info() == {"tp_size": 1}
    assert [p for _, p, _ in s.requests] == ["/model_info", "/get_model_info", "/server_info", "/get_server_info"]
    c, _ = client(lambda path, body: httpx.Response(500, json={"error": {"message": "down"}}))
    with pytest.raises(EngineError, match="down"):
        c.get_model_info()  # only a 404 means "an older engine"


def test_clearing_the_hicache_store_uses_the_new_path_then_the_old_one():
    c, s = client(lambda path, body: httpx.Response(200, text="cleared"))
    c.clear_hicache_storage()
    assert [p for _, p, _ in s.requests] == ["/hicache/storage-backend/clear"]
    c, s = client(lambda path, body: httpx.Response(404) if path.startswith("/hicache") else httpx.Response(200))
    c.clear_hicache_storage()
    assert [p for _, p, _ in s.requests] == ["/hicache/storage-backend/clear", "/clear_hicache_storage_backend"]


def test_async_streams_reuse_one_connection_to_a_real_server():
    """Each stream is read to the end of its body after ``[DONE]``, so consecutive generations go
    over one kept-alive connection (a new TCP connection per call costs the proxy CPU), and every
    chunk, the finish chunk last, still arrives."""
    import socket
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app, ports = FastAPI(), []

    @app.get("/get_server_info")
    async def info():
        return {"incremental_streaming_output": True}

    @app.post("/generate")
    async def generate(request: Request):
        ports.append(request.client.port)
        events = [result([5], [-0.5]), result([6], [-0.25], finish={"type": "stop", "matched": 6})]
        return StreamingResponse(iter([_sse(events)]), media_type="text/event-stream")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)

    async def run():
        c = AsyncEngineClient(f"http://127.0.0.1:{sock.getsockname()[1]}")
        got = []
        for _ in range(4):
            async for ch in c.stream([1, 2, 3], {"max_new_tokens": 2}):
                got.append((ch.delta_output_ids, ch.finish_reason.type if ch.finish_reason else None))
                if ch.finish_reason is not None:
                    break  # as the proxy's engine adapter does
        await c.aclose()
        return got

    try:
        got = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(10)
    assert got == [([5], None), ([6], "stop")] * 4
    assert len(ports) == 4 and len(set(ports)) == 1


def test_async_client_posts_a_long_numpy_prompt_from_its_buffer():
    """A prompt long enough for the table-written body (a memoryview, not bytes) arrives whole, in
    a plain call and in a stream."""
    import numpy as np

    ids = np.random.default_rng(3).integers(0, 151_936, 60_000).astype(np.int32)

    def handler(path, body):
        if path == "/server_info":
            return httpx.Response(200, json={})
        if body.get("stream"):
            return httpx.Response(200, text=_sse([result([5], [-0.1], finish=STOP)]),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=result([4], [-0.4]))

    async def main(url):
        async with AsyncEngineClient(url) as c:
            r = await c.generate(ids, {"max_new_tokens": 1}, rid="g")
            chunks = [ch async for ch in c.stream(ids, {"max_new_tokens": 1}, rid="s")]
        return r, chunks

    with ScriptServer(handler) as server:
        r, chunks = asyncio.run(main(server.url))
    assert r.output_ids == [4] and chunks[-1].output_ids == [5]
    posted = [b for _, p, b in server.requests if p == "/generate"]
    assert [b["rid"] for b in posted] == ["g", "s"]
    assert all(b["input_ids"] == ids.tolist() for b in posted)
