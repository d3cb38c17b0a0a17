"""The ``asyncio`` client of one rollout engine over SGLang's native HTTP API, on aiohttp (the proxy
sends every model call through it): :class:`AsyncEngineClient`, with the methods of
:class:`gyre.rollout.client.engine_client.EngineClient`, each ``async``, but for the weight-update
group and session calls and ``clear_hicache_storage``, which only the blocking client has."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Mapping, Sequence

import aiohttp
import httpx

from gyre.rollout.client.base import HTTP_LIMITS, ClientBase, export_kv_result, import_kv_body, tensor_payloads
from gyre.rollout.client.messages import (
    EngineConnectionError,
    EngineError,
    GenerateResult,
    Op,
    SamplingLike,
    StreamChunk,
    StreamNormalizer,
    build_generate_body,
    ids_json,
    incremental_streaming,
    iter_sse_events,
    json_content,
    op_abort,
    op_generate,
    op_health,
    op_json,
    op_memory,
    op_update_weight_version,
    op_update_weights_from_disk,
    op_update_weights_from_tensor,
    raise_for_status,
)


#: how long a stream's body is read after its ``[DONE]`` for the connection to be reused
_DRAIN_TIMEOUT_S = 1.0


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The lines of a streamed body, without their ends; a line may be of any length (a
    cumulative SGLang stream repeats every output id and logprob so far in each event)."""
    buf = b""
    async for data in content.iter_any():
        buf += data
        if b"\n" in data:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
    if buf:
        yield buf.rstrip(b"\r").decode()


def _as_httpx(resp: aiohttp.ClientResponse, content: bytes) -> httpx.Response:
    """An aiohttp answer read whole, as the ``httpx.Response`` the parsers take (its body already
    decoded, so without the ``Content-Encoding`` that would have httpx decode it again)."""
    headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in ("content-encoding", "content-length")]
    return httpx.Response(resp.status, headers=headers, content=content)


class AsyncEngineClient(ClientBase):
    """``asyncio`` twin of :class:`~gyre.rollout.client.engine_client.EngineClient` (its methods but
    for the weight-update group, session and hierarchical-cache calls, ``async``; ``stream`` is an
    async iterator), on aiohttp: the proxy sends every model call through it, and per call aiohttp
    costs a fraction of httpx's CPU (``bench/engine_client.py``).  Each event loop that uses the
    client gets its own ``aiohttp.ClientSession``, made on first use (a session belongs to the loop
    it was made in).  An answer is read whole and handed to the same parsers as the blocking
    client's, as an ``httpx.Response``.

    Timeouts: ``timeout`` seconds for each read of the socket (``None``: none) and 10 s to connect;
    connection pool of 256, kept-alive connections reused.  Proxy variables in the environment are
    not used (engines are reached directly).
    """

    def __init__(self, base_url: str, *, timeout: float | None = 600.0):
        super().__init__(base_url, timeout)
        self._client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=timeout)
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for gone in [lp for lp in self._sessions if lp.is_closed()]:
                del self._sessions[gone]  # its loop is closed, and its connections with it
            session = aiohttp.ClientSession(
                timeout=self._client_timeout, trust_env=False,
                connector=aiohttp.TCPConnector(limit=HTTP_LIMITS.max_connections, limit_per_host=0))
            self._sessions[loop] = session
        return session

    async def aclose(self) -> None:
        """Close the session of the running loop (the only one that can be closed from it)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    async def __aenter__(self) -> "AsyncEngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, *, content: bytes | memoryview | None = None,
                       headers: Mapping[str, str] | None = None) -> httpx.Response:
        """One request, its answer read whole (as an ``httpx.Response`` for the shared parsers)."""
        try:
            async with self._session().request(method, self.base_url + path, data=content,
                                               headers=headers) as resp:
                return _as_httpx(resp, await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._connection_error(path, exc) from exc

    async def _do(self, op: Op) -> Any:
        return op.parse(await self._request(op.method, op.path, **json_content(op.body, buffer=True)))

    async def generate(self, input_ids: Sequence[int], sampling_params: SamplingLike = None, *,
                       rid: str | None = None, return_logprob: bool = True, top_logprobs_num: int = 0,
                       return_text_in_logprobs: bool = False, extra_key: str | None = None
                       ) -> GenerateResult | list[GenerateResult]:
        res = await self._do(op_generate(input_ids, sampling_params, rid, return_logprob, top_logprobs_num,
                                         return_text_in_logprobs, extra_key))
        return self._pick(res, sampling_params)

    async def generate_batch(self, batch_input_ids: Sequence[Sequence[int]], sampling_params: SamplingLike = None, *,
                             rids: Sequence[str] | None = None, return_logprob: bool = True,
                             top_logprobs_num: int = 0) -> list[GenerateResult]:
        return await self._do(op_generate([list(x) for x in batch_input_ids], sampling_params, rids,
                                          return_logprob, top_logprobs_num, False))

    async def stream(self, input_ids: Sequence[int], sampling_params: SamplingLike = None, *,
                     rid: str | None = None, return_logprob: bool = True,
                     extra_key: str | None = None) -> AsyncIterator[StreamChunk]:
        norm = StreamNormalizer(await self._incremental_mode())
        body = build_generate_body(input_ids, sampling_params, rid=rid, return_logprob=return_logprob, stream=True,
                                   extra_key=extra_key)
        post = json_content(body, buffer=True)
        final: StreamChunk | None = None
        try:
            async with self._session().post(self.base_url + "/generate", data=post["content"],
                                            headers=post["headers"]) as resp:
                if resp.status >= 400:
                    raise_for_status(_as_httpx(resp, await resp.read()))
                async with contextlib.aclosing(_lines(resp.content)) as lines:
                    async for line in lines:
                        for event in iter_sse_events([line]):
                            chunk = norm.feed(event)
                            if chunk.finish_reason is not None:
                                final = chunk  # yielded once the response is closed (below)
                            elif final is None:
                                yield chunk
                        if line.strip() == "data: [DONE]":
                            break
                # Read the end of the body (the chunked encoding's last chunk follows [DONE]) so
                # that the connection goes back to the pool instead of being closed; callers stop
                # at the finish chunk. An engine that keeps the stream open is cut after 1 s.
                try:
                    async with asyncio.timeout(_DRAIN_TIMEOUT_S):
                        await resp.read()
                except (TimeoutError, aiohttp.ClientError):
                    pass
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._connection_error("/generate", exc) from exc
        if final is not None:
            yield final

    async def _incremental_mode(self) -> bool:
        if self._incremental is None:
            try:
                self._incremental = incremental_streaming(await self.get_server_info())
            except EngineError:
                self._incremental = False
        return self._incremental

    async def abort(self, rid: str) -> bool:
        return await self._do(op_abort(rid, False))

    async def abort_all(self) -> None:
        await self._do(op_abort(None, True))

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._do(op_json("POST", "/pause_generation", {"mode": mode}))

    async def continue_generation(self) -> dict:
        return await self._do(op_json("POST", "/continue_generation", {}))

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        return await self._do(op_memory("release", tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        return await self._do(op_memory("resume", tags))

    async def flush_cache(self) -> None:
        await self._do(op_json("POST", "/flush_cache"))

    async def export_kv(self, input_ids: Sequence[int], transport: str = "http") -> tuple[int, bytes | dict | None]:
        """As :meth:`gyre.rollout.client.engine_client.EngineClient.export_kv`."""
        return export_kv_result(await self._request("POST", "/gyre/export_kv", **json_content(
            {"input_ids": ids_json(input_ids), "transport": transport})))

    async def import_kv(self, payload: bytes | dict) -> dict:
        """As :meth:`gyre.rollout.client.engine_client.EngineClient.import_kv`."""
        resp = await self._request("POST", "/gyre/import_kv", **import_kv_body(payload))
        raise_for_status(resp)
        return resp.json()

    async def release_kv(self, pin: int) -> bool:
        """As :meth:`gyre.rollout.client.engine_client.EngineClient.release_kv`."""
        resp = await self._request("POST", "/gyre/release_kv", **json_content({"pin": int(pin)}))
        raise_for_status(resp)
        return bool(resp.json()["released"])

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str,
                                       abort_all_requests: bool = False, flush_cache: bool = True,
                                       load_format: str | None = None) -> dict:
        return await self._do(op_update_weights_from_disk(model_path, load_format, weight_version,
                                                          abort_all_requests, flush_cache))

    async def update_weights_from_tensor(self, named_tensors=None, *, weight_version: str,
                                         serialized_named_tensors: Sequence[str] | None = None,
                                         load_format: str | None = None, abort_all_requests: bool = False,
                                         flush_cache: bool = True) -> dict:
        if named_tensors is not None:
            await self._refuse_sglang_async()
        payloads = tensor_payloads(named_tensors, serialized_named_tensors)
        return await self._do(op_update_weights_from_tensor(payloads, load_format, weight_version, abort_all_requests,
                                                            flush_cache))

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> dict:
        return await self._do(op_update_weight_version(new_version, abort_all_requests))

    async def get_weight_version(self) -> str:
        return str((await self.get_model_info())["weight_version"])

    async def health(self) -> bool:
        try:
            return await self._do(op_health("/health"))
        except EngineConnectionError:
            return False

    async def health_generate(self) -> bool:
        try:
            return await self._do(op_health("/health_generate"))
        except EngineConnectionError:
            return False

    async def wait_until_ready(self, timeout: float = 300.0, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine at {self.base_url} not ready after {timeout:.0f} s")
            await asyncio.sleep(poll_s)

    async def get_model_info(self) -> dict:
        return await self._json_or_older("GET", "/model_info", "/get_model_info")

    async def get_server_info(self) -> dict:
        return await self._json_or_older("GET", "/server_info", "/get_server_info")

    async def _json_or_older(self, method: str, path: str, older: str) -> dict:
        """As :meth:`gyre.rollout.client.engine_client.EngineClient._json_or_older`."""
        try:
            return await self._do(op_json(method, path))
        except EngineError as exc:
            if exc.status_code != 404:
                raise
            return await self._do(op_json(method, older))
