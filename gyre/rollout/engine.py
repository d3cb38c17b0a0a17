"""The engine client protocol: how Gyre (proxy, scheduler, cells) talks to a rollout engine.

Both backends speak SGLang's native HTTP API -- a real SGLang server on GPUs
(:class:`gyre.rollout.sglang_engine.SGLangEngine`) and Gyre's embedded CPU engine
(:class:`gyre.rollout.embedded.EngineServer`) -- so one client serves both:

* :class:`EngineClient` (blocking, ``httpx.Client``) and :class:`AsyncEngineClient`
  (``httpx.AsyncClient``) expose the same methods: ``generate``, ``generate_batch``,
  ``stream``, ``abort``, ``abort_all``, ``pause_generation``, ``continue_generation``,
  ``release_memory_occupation``, ``resume_memory_occupation``, ``flush_cache``,
  ``update_weights_from_disk``, ``update_weights_from_tensor``, ``update_weight_version``,
  ``get_weight_version``, ``health``, ``health_generate``, ``wait_until_ready``,
  ``get_model_info``, ``get_server_info``.
* Results are typed: :class:`GenerateResult` (one sequence), :class:`StreamChunk` (one SSE
  event, normalised to deltas *and* cumulative values whatever the server's
  ``incremental_streaming_output``), :class:`FinishReason`.
* Errors: non-2xx answers raise :class:`EngineError` (``status_code``, ``message``); transport
  failures raise :class:`EngineConnectionError`.  An aborted request is *not* an error: its
  result has ``finish_reason.type == "abort"`` (``result.aborted``) with the partial output, and
  the proxy retries it elsewhere.

Upstream: ``sglang/srt/entrypoints/http_server.py`` (routes) and
``sglang/srt/managers/io_struct.py`` (bodies).  Every request body is built and every response
parsed by module-level functions (``_op_*``), shared by both clients (sans-I/O).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import httpx

from gyre.rollout.protocol import SamplingParams

SamplingLike = SamplingParams | Mapping[str, Any] | None


class EngineError(RuntimeError):
    """The engine answered with an error status (``status_code``; ``message`` from the body)."""

    def __init__(self, status_code: int, message: str, body: Any = None):
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class EngineConnectionError(EngineError):
    """The engine could not be reached (refused, reset, timed out)."""

    def __init__(self, message: str):
        super().__init__(0, message)


@dataclass(slots=True)
class FinishReason:
    """SGLang finish reason: ``type`` in ``stop`` | ``length`` | ``abort``.

    ``matched``: the stop token id (int) or stop string; ``length``: output tokens at the cap;
    ``message``: abort reason.
    """

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> "FinishReason | None":
        if d is None:
            return None
        return cls(type=str(d.get("type")), matched=d.get("matched"), length=d.get("length"),
                   message=d.get("message"))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        elif self.type == "abort":
            out["message"] = self.message
        return out


@dataclass(slots=True)
class GenerateResult:
    """One generated sequence.

    ``output_ids``: sampled token ids (a matched stop token included); ``output_logprobs``: one
    behaviour log-prob per output token (natural log, fp32 values) or ``None`` without
    ``return_logprob``; ``top_logprobs``: per token a list of ``(logprob, token_id)``;
    ``weight_version``: the weights that produced every token; ``cached_tokens``: prompt tokens
    served from the prefix cache; ``e2e_latency`` in seconds.
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str | None
    e2e_latency: float | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.type == "abort"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "GenerateResult":
        meta = dict(d.get("meta_info") or {})
        lps = meta.get("output_token_logprobs")
        tops = meta.get("output_top_logprobs")
        return cls(
            rid=str(meta.get("id", "")), output_ids=list(d.get("output_ids") or []),
            output_logprobs=[float(x[0]) for x in lps] if lps is not None else None,
            text=d.get("text") or "", finish_reason=FinishReason.from_json(meta.get("finish_reason")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)), completion_tokens=int(meta.get("completion_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens", 0) or 0), weight_version=meta.get("weight_version"),
            e2e_latency=meta.get("e2e_latency"),
            top_logprobs=[[(float(x[0]), int(x[1])) for x in row] for row in tops] if tops is not None else None,
            meta_info=meta)


@dataclass(slots=True)
class StreamChunk:
    """One streamed update of sequence ``index`` (normalised; see module docstring).

    ``delta_*`` are what this chunk added; ``output_ids`` / ``output_logprobs`` / ``text`` are
    cumulative.  ``finish_reason`` is set on the sequence's last chunk only.
    """

    index: int
    rid: str
    delta_output_ids: list[int]
    delta_logprobs: list[float] | None
    delta_text: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    text: str
    finish_reason: FinishReason | None
    weight_version: str | None
    meta_info: dict[str, Any]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _StreamNormalizer:
    """Turns SGLang stream events (cumulative or incremental) into :class:`StreamChunk`."""

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.ids: dict[int, list[int]] = {}
        self.lps: dict[int, list[float]] = {}
        self.text: dict[int, str] = {}

    def feed(self, d: Mapping[str, Any]) -> StreamChunk:
        if "error" in d:
            err = d["error"]
            raise EngineError(400, err.get("message", str(err)) if isinstance(err, dict) else str(err), d)
        meta = dict(d.get("meta_info") or {})
        i = int(d.get("index", 0))
        ids, lps, text = self.ids.setdefault(i, []), self.lps.setdefault(i, []), self.text.get(i, "")
        raw_ids = list(d.get("output_ids") or [])
        raw_lps = meta.get("output_token_logprobs")
        raw_text = d.get("text")
        if self.incremental:
            new_ids, new_lps = raw_ids, ([float(x[0]) for x in raw_lps] if raw_lps is not None else None)
            new_text = raw_text or ""
            text = text + new_text
        else:
            new_ids = raw_ids[len(ids):]
            new_lps = [float(x[0]) for x in raw_lps[len(lps):]] if raw_lps is not None else None
            full = raw_text if raw_text is not None else text
            new_text = full[len(text):] if full.startswith(text) else full
            text = full
        ids.extend(new_ids)
        if new_lps is not None:
            lps.extend(new_lps)
        self.text[i] = text
        return StreamChunk(index=i, rid=str(meta.get("id", "")), delta_output_ids=new_ids, delta_logprobs=new_lps,
                           delta_text=new_text, output_ids=list(ids),
                           output_logprobs=list(lps) if raw_lps is not None else None, text=text,
                           finish_reason=FinishReason.from_json(meta.get("finish_reason")),
                           weight_version=meta.get("weight_version"), meta_info=meta)


# ---------------------------------------------------------------------------- sans-I/O operations


@dataclass(slots=True)
class _Op:
    method: str
    path: str
    body: Any
    parse: Callable[[httpx.Response], Any]


def _error_message(resp: httpx.Response) -> tuple[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase, None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"]), body
        if isinstance(err, str):
            return err, body
        if "message" in body:
            return str(body["message"]), body
        if "detail" in body:
            return str(body["detail"]), body
    return str(body)[:500], body


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code >= 400:
        msg, body = _error_message(resp)
        raise EngineError(resp.status_code, msg, body)


def _parse_json(resp: httpx.Response) -> Any:
    _raise_for(resp)
    if not resp.content:
        return {}
    try:
        return resp.json()
    except ValueError:
        return {"message": resp.text}


def _parse_bool_ok(resp: httpx.Response) -> bool:
    return resp.status_code == 200


def _params_json(sampling_params: SamplingLike) -> dict[str, Any]:
    if sampling_params is None:
        return {}
    if isinstance(sampling_params, SamplingParams):
        return sampling_params.to_json()
    return dict(sampling_params)


def build_generate_body(input_ids: Sequence[int] | Sequence[Sequence[int]], sampling_params: SamplingLike = None, *,
                        rid: str | Sequence[str] | None = None, return_logprob: bool = True,
                        top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                        stream: bool = False) -> dict[str, Any]:
    """The ``/generate`` JSON body (SGLang ``GenerateReqInput``)."""
    body: dict[str, Any] = {"input_ids": [list(x) for x in input_ids] if input_ids and isinstance(input_ids[0], (list, tuple))
                            else list(input_ids),
                            "sampling_params": _params_json(sampling_params), "return_logprob": return_logprob,
                            "stream": stream}
    if rid is not None:
        body["rid"] = rid if isinstance(rid, str) else list(rid)
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    if return_text_in_logprobs:
        body["return_text_in_logprobs"] = True
    return body


def _parse_generate(resp: httpx.Response) -> list[GenerateResult]:
    body = _parse_json(resp)
    items = body if isinstance(body, list) else [body]
    return [GenerateResult.from_json(x) for x in items]


def _parse_abort(resp: httpx.Response) -> bool:
    if resp.status_code == 400:
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("success") is False:
            return False
    _raise_for(resp)
    try:
        body = resp.json()
    except ValueError:
        return True
    return not (isinstance(body, dict) and body.get("success") is False)


def _op_generate(input_ids, sampling_params, rid, return_logprob, top_logprobs_num, return_text_in_logprobs) -> _Op:
    return _Op("POST", "/generate", build_generate_body(
        input_ids, sampling_params, rid=rid, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs), _parse_generate)


def _op_abort(rid: str | None, abort_all: bool) -> _Op:
    body: dict[str, Any] = {"abort_all": abort_all}
    if rid is not None:
        body["rid"] = rid
    return _Op("POST", "/abort_request", body, _parse_abort)


def _op_json(method: str, path: str, body: Any = None) -> _Op:
    return _Op(method, path, body, _parse_json)


def _tags_body(tags: Sequence[str] | None) -> dict[str, Any]:
    return {"tags": list(tags)} if tags is not None else {}


def _update_common(weight_version: str, abort_all_requests: bool, flush_cache: bool) -> dict[str, Any]:
    if not isinstance(weight_version, str) or not weight_version:
        raise ValueError("weight_version must be a non-empty string (it labels every later response)")
    return {"weight_version": weight_version, "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}


def _op_update_tensor(named_tensors, serialized_named_tensors, load_format, weight_version, abort_all_requests,
                      flush_cache) -> _Op:
    if (named_tensors is None) == (serialized_named_tensors is None):
        raise ValueError("give exactly one of named_tensors or serialized_named_tensors")
    if named_tensors is not None:
        from gyre.rollout.weights import serialize_named_tensors

        serialized_named_tensors = [serialize_named_tensors(named_tensors)]
    body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
            **_update_common(weight_version, abort_all_requests, flush_cache)}
    return _Op("POST", "/update_weights_from_tensor", body, _parse_json)


def _iter_sse_lines(lines: Iterable[str]) -> Iterator[Any]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        if payload:
            yield json.loads(payload)


# ---------------------------------------------------------------------------- clients


class _ClientBase:
    def __init__(self, base_url: str, timeout: float | None):
        self.base_url = base_url.rstrip("/")
        self.timeout = httpx.Timeout(timeout, connect=10.0)
        self._incremental: bool | None = None

    @staticmethod
    def _pick(results: list[GenerateResult], n: int) -> GenerateResult | list[GenerateResult]:
        return results[0] if n == 1 and len(results) == 1 else results

    @staticmethod
    def _n(sampling_params: SamplingLike) -> int:
        if isinstance(sampling_params, SamplingParams):
            return sampling_params.n
        return int((sampling_params or {}).get("n", 1) or 1)


class EngineClient(_ClientBase):
    """Blocking client of one engine at ``base_url`` (``http://host:port``).

    Args:
        base_url: engine address.
        timeout: seconds per HTTP operation (``None``: no limit); connect timeout is 10 s.
        transport: optional ``httpx`` transport (tests).
    """

    def __init__(self, base_url: str, *, timeout: float | None = 600.0,
                 transport: httpx.BaseTransport | None = None):
        super().__init__(base_url, timeout)
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=transport,
                                  limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _do(self, op: _Op) -> Any:
        try:
            resp = self._http.request(op.method, op.path, json=op.body)
        except httpx.TransportError as exc:
            raise EngineConnectionError(f"{self.base_url}{op.path}: {type(exc).__name__}: {exc}") from exc
        return op.parse(resp)

    # generation ---------------------------------------------------------------

    def generate(self, input_ids: Sequence[int], sampling_params: SamplingLike = None, *, rid: str | None = None,
                 return_logprob: bool = True, top_logprobs_num: int = 0,
                 return_text_in_logprobs: bool = False) -> GenerateResult | list[GenerateResult]:
        """Generate from one prompt; a list of ``n`` results when ``sampling_params.n > 1``."""
        res = self._do(_op_generate(input_ids, sampling_params, rid, return_logprob, top_logprobs_num,
                                    return_text_in_logprobs))
        return self._pick(res, self._n(sampling_params))

    def generate_batch(self, batch_input_ids: Sequence[Sequence[int]], sampling_params: SamplingLike = None, *,
                       rids: Sequence[str] | None = None, return_logprob: bool = True,
                       top_logprobs_num: int = 0) -> list[GenerateResult]:
        """Generate from several prompts in one request (input-major, ``n`` samples each)."""
        return self._do(_op_generate([list(x) for x in batch_input_ids], sampling_params, rids, return_logprob,
                                     top_logprobs_num, False))

    def stream(self, input_ids: Sequence[int], sampling_params: SamplingLike = None, *, rid: str | None = None,
               return_logprob: bool = True) -> Iterator[StreamChunk]:
        """Stream one prompt's generation (SSE); closing the iterator early aborts it server-side."""
        norm = _StreamNormalizer(self._incremental_mode())
        body = build_generate_body(input_ids, sampling_params, rid=rid, return_logprob=return_logprob, stream=True)
        try:
            with self._http.stream("POST", "/generate", json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _raise_for(resp)
                for event in _iter_sse_lines(resp.iter_lines()):
                    yield norm.feed(event)
        except httpx.TransportError as exc:
            raise EngineConnectionError(f"{self.base_url}/generate: {type(exc).__name__}: {exc}") from exc

    def _incremental_mode(self) -> bool:
        if self._incremental is None:
            try:
                self._incremental = bool(self.get_server_info().get("incremental_streaming_output", False))
            except EngineError:
                self._incremental = False
        return self._incremental

    # control --------------------------------------------------------------------

    def abort(self, rid: str) -> bool:
        """Abort request ``rid`` (all its samples); the request then answers with
        ``finish_reason.type == "abort"`` and its partial output.  Returns ``False`` when the
        embedded engine does not know ``rid`` (finished or never seen); SGLang always says ``True``."""
        return self._do(_op_abort(rid, False))

    def abort_all(self) -> None:
        """Abort every running and waiting request."""
        self._do(_op_abort(None, True))

    def pause_generation(self, mode: str = "abort") -> dict:
        """``abort`` | ``in_place`` | ``retract`` (see ``gyre/rollout/core.py``)."""
        return self._do(_op_json("POST", "/pause_generation", {"mode": mode}))

    def continue_generation(self) -> dict:
        return self._do(_op_json("POST", "/continue_generation", {}))

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        """Free ``weights`` and/or ``kv_cache`` (``None``: both); requires no running request."""
        return self._do(_op_json("POST", "/release_memory_occupation", _tags_body(tags)))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        return self._do(_op_json("POST", "/resume_memory_occupation", _tags_body(tags)))

    def flush_cache(self) -> None:
        self._do(_op_json("POST", "/flush_cache"))

    def update_weights_from_disk(self, model_path: str, *, weight_version: str, abort_all_requests: bool = False,
                                 flush_cache: bool = True, load_format: str | None = None) -> dict:
        """Load HF-named weights from a directory or file visible to the engine."""
        body = {"model_path": str(model_path), "load_format": load_format,
                **_update_common(weight_version, abort_all_requests, flush_cache)}
        return self._do(_op_json("POST", "/update_weights_from_disk", body))

    def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
                                   *, weight_version: str, serialized_named_tensors: Sequence[str] | None = None,
                                   load_format: str | None = None, abort_all_requests: bool = False,
                                   flush_cache: bool = True) -> dict:
        """Update weights from tensors.

        ``named_tensors`` is serialised in the embedded engine's CPU format
        (:func:`gyre.rollout.weights.serialize_named_tensors`); for a real SGLang server pass
        ``serialized_named_tensors`` built by SGLang's own serializer (one per TP rank).
        """
        return self._do(_op_update_tensor(named_tensors, serialized_named_tensors, load_format, weight_version,
                                          abort_all_requests, flush_cache))

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> dict:
        return self._do(_op_json("POST", "/update_weight_version",
                                 {"new_version": new_version, "abort_all_requests": abort_all_requests}))

    def get_weight_version(self) -> str:
        return str(self._do(_op_json("GET", "/get_weight_version"))["weight_version"])

    # status ---------------------------------------------------------------------

    def health(self) -> bool:
        """``GET /health`` answered 200 (``False`` on errors or no answer)."""
        try:
            return self._do(_Op("GET", "/health", None, _parse_bool_ok))
        except EngineConnectionError:
            return False

    def health_generate(self) -> bool:
        """``GET /health_generate`` (runs a one-token generation) answered 200."""
        try:
            return self._do(_Op("GET", "/health_generate", None, _parse_bool_ok))
        except EngineConnectionError:
            return False

    def wait_until_ready(self, timeout: float = 300.0, poll_s: float = 0.2) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            TimeoutError: not ready within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine at {self.base_url} not ready after {timeout:.0f} s")
            time.sleep(poll_s)

    def get_model_info(self) -> dict:
        return self._do(_op_json("GET", "/get_model_info"))

    def get_server_info(self) -> dict:
        return self._do(_op_json("GET", "/get_server_info"))


class AsyncEngineClient(_ClientBase):
    """``asyncio`` twin of :class:`EngineClient` (same methods, ``async``; ``stream`` is an
    async iterator)."""

    def __init__(self, base_url: str, *, timeout: float | None = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(base_url, timeout)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=transport,
                                       limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncEngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _do(self, op: _Op) -> Any:
        try:
            resp = await self._http.request(op.method, op.path, json=op.body)
        except httpx.TransportError as exc:
            raise EngineConnectionError(f"{self.base_url}{op.path}: {type(exc).__name__}: {exc}") from exc
        return op.parse(resp)

    async def generate(self, input_ids: Sequence[int], sampling_params: SamplingLike = None, *,
                       rid: str | None = None, return_logprob: bool = True, top_logprobs_num: int = 0,
                       return_text_in_logprobs: bool = False) -> GenerateResult | list[GenerateResult]:
        res = await self._do(_op_generate(input_ids, sampling_params, rid, return_logprob, top_logprobs_num,
                                          return_text_in_logprobs))
        return self._pick(res, self._n(sampling_params))

    async def generate_batch(self, batch_input_ids: Sequence[Sequence[int]], sampling_params: SamplingLike = None, *,
                             rids: Sequence[str] | None = None, return_logprob: bool = True,
                             top_logprobs_num: int = 0) -> list[GenerateResult]:
        return await self._do(_op_generate([list(x) for x in batch_input_ids], sampling_params, rids,
                                           return_logprob, top_logprobs_num, False))

    async def stream(self, input_ids: Sequence[int], sampling_params: SamplingLike = None, *,
                     rid: str | None = None, return_logprob: bool = True) -> AsyncIterator[StreamChunk]:
        norm = _StreamNormalizer(await self._incremental_mode())
        body = build_generate_body(input_ids, sampling_params, rid=rid, return_logprob=return_logprob, stream=True)
        try:
            async with self._http.stream("POST", "/generate", json=body) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _raise_for(resp)
                async for line in resp.aiter_lines():
                    for event in _iter_sse_lines([line]):
                        yield norm.feed(event)
                    if line.strip() == "data: [DONE]":
                        return
        except httpx.TransportError as exc:
            raise EngineConnectionError(f"{self.base_url}/generate: {type(exc).__name__}: {exc}") from exc

    async def _incremental_mode(self) -> bool:
        if self._incremental is None:
            try:
                self._incremental = bool((await self.get_server_info()).get("incremental_streaming_output", False))
            except EngineError:
                self._incremental = False
        return self._incremental

    async def abort(self, rid: str) -> bool:
        return await self._do(_op_abort(rid, False))

    async def abort_all(self) -> None:
        await self._do(_op_abort(None, True))

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._do(_op_json("POST", "/pause_generation", {"mode": mode}))

    async def continue_generation(self) -> dict:
        return await self._do(_op_json("POST", "/continue_generation", {}))

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        return await self._do(_op_json("POST", "/release_memory_occupation", _tags_body(tags)))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        return await self._do(_op_json("POST", "/resume_memory_occupation", _tags_body(tags)))

    async def flush_cache(self) -> None:
        await self._do(_op_json("POST", "/flush_cache"))

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str,
                                       abort_all_requests: bool = False, flush_cache: bool = True,
                                       load_format: str | None = None) -> dict:
        body = {"model_path": str(model_path), "load_format": load_format,
                **_update_common(weight_version, abort_all_requests, flush_cache)}
        return await self._do(_op_json("POST", "/update_weights_from_disk", body))

    async def update_weights_from_tensor(self, named_tensors=None, *, weight_version: str,
                                         serialized_named_tensors: Sequence[str] | None = None,
                                         load_format: str | None = None, abort_all_requests: bool = False,
                                         flush_cache: bool = True) -> dict:
        return await self._do(_op_update_tensor(named_tensors, serialized_named_tensors, load_format,
                                                weight_version, abort_all_requests, flush_cache))

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> dict:
        return await self._do(_op_json("POST", "/update_weight_version",
                                       {"new_version": new_version, "abort_all_requests": abort_all_requests}))

    async def get_weight_version(self) -> str:
        return str((await self._do(_op_json("GET", "/get_weight_version")))["weight_version"])

    async def health(self) -> bool:
        try:
            return await self._do(_Op("GET", "/health", None, _parse_bool_ok))
        except EngineConnectionError:
            return False

    async def health_generate(self) -> bool:
        try:
            return await self._do(_Op("GET", "/health_generate", None, _parse_bool_ok))
        except EngineConnectionError:
            return False

    async def wait_until_ready(self, timeout: float = 300.0, poll_s: float = 0.2) -> None:
        import asyncio

        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine at {self.base_url} not ready after {timeout:.0f} s")
            await asyncio.sleep(poll_s)

    async def get_model_info(self) -> dict:
        return await self._do(_op_json("GET", "/get_model_info"))

    async def get_server_info(self) -> dict:
        return await self._do(_op_json("GET", "/get_server_info"))


class RolloutEngine(Protocol):
    """A running engine a cell owns (embedded :class:`~gyre.rollout.embedded.EngineServer`,
    :class:`~gyre.rollout.embedded.EmbeddedEngineProcess` or
    :class:`~gyre.rollout.sglang_engine.SGLangEngine`)."""

    @property
    def url(self) -> str: ...

    def start(self) -> "RolloutEngine": ...

    def stop(self) -> None: ...

    def client(self, timeout: float | None = 600.0) -> EngineClient: ...
