"""What Gyre sends to a rollout engine and gets back, with no I/O (SGLang's native HTTP API).

Both backends -- a real SGLang server (:mod:`gyre.rollout.sglang_driver.engine`) and the embedded CPU
engine (:mod:`gyre.rollout.embedded.server`) -- answer the same routes, so one set of messages
serves both, and both clients in :mod:`gyre.rollout.client.engine_client` build on it:

* typed results: :class:`GenerateResult` (one sequence), :class:`StreamChunk` (one SSE event,
  given as deltas *and* cumulative values whatever the server's ``incremental_streaming_output``,
  see :class:`StreamNormalizer`), :class:`FinishReason`;
* errors: an error status raises :class:`EngineError` (``status_code``, ``message``); the
  clients raise :class:`EngineConnectionError` when the engine cannot be reached.  An aborted
  request is not an error: its result has ``finish_reason.type == "abort"`` and the partial output;
* each call as an :class:`Op` (``op_*``: method, path, body and response parser), plus
  :func:`build_generate_body` and :func:`iter_sse_events` for streaming.

Upstream: ``sglang/srt/entrypoints/http_server.py`` (routes), ``sglang/srt/managers/io_struct.py``
(bodies).
"""


from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import httpx
import numpy as np
import orjson

from gyre.rollout.api.sglang_api import SamplingParams
from gyre.rollout.client.token_json import dumps_with_ids

_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
JSON_HEADERS = {"content-type": "application/json"}


def json_content(body: Any, *, buffer: bool = False) -> dict[str, Any]:
    """httpx keyword arguments posting ``body`` as JSON (none for ``None``). Serialised by
    orjson, so token ids may be numpy arrays or scalars; a long ``input_ids`` array is written by
    table lookup (:mod:`gyre.rollout.client.token_json`), with ``buffer`` into a ``memoryview`` that is
    not copied into ``bytes`` (for aiohttp; httpx needs ``bytes``)."""
    if body is None:
        return {}
    return {"content": dumps_with_ids(body, _ORJSON_OPTS, buffer=buffer), "headers": JSON_HEADERS}


def ids_json(x: Any) -> Any:
    """Token ids as sent: a numpy array kept as a C-contiguous array, anything else as a list."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    return list(x)

#: Sampling parameters as :class:`SamplingParams`, an SGLang ``sampling_params`` dict, or ``None``.
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
    ``message``: abort reason; ``status_code``: the HTTP status SGLang gives an abort that is the
    request's own fault (400 for a prompt longer than the context or the KV pool), ``None`` for an
    abort asked for by a client or a pause.
    """

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> "FinishReason | None":
        if d is None:
            return None
        status = d.get("status_code")
        return cls(type=str(d.get("type")), matched=d.get("matched"), length=d.get("length"),
                   message=d.get("message"),
                   status_code=status if isinstance(status, int) and not isinstance(status, bool) else None)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        elif self.type == "abort":
            out["message"] = self.message
            if self.status_code is not None:
                out["status_code"] = self.status_code
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
    """One streamed update of sequence ``index``, whatever the server's streaming mode.

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


class StreamNormalizer:
    """Turns one request's SGLang stream events (cumulative or incremental) into :class:`StreamChunk`.

    In incremental mode ``output_ids`` and ``text`` are deltas; ``output_token_logprobs`` may be
    deltas too (the embedded engine) or cumulative (SGLang, which keeps them whole in every chunk):
    a list as long as the tokens so far plus the new ones is taken as cumulative."""

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
            new_ids = raw_ids
            if raw_lps is not None and lps and len(raw_lps) == len(lps) + len(new_ids):
                raw_lps = raw_lps[len(lps):]  # SGLang: ids are deltas, log-probs stay cumulative
            new_lps = [float(x[0]) for x in raw_lps] if raw_lps is not None else None
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


# ---------------------------------------------------------------------------- calls as data


@dataclass(slots=True)
class Op:
    """One engine call as data: HTTP ``method`` and ``path``, JSON ``body``, and ``parse``, which
    turns the response into the call's result (raising :class:`EngineError` on error statuses)."""

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


def raise_for_status(resp: httpx.Response) -> None:
    """Raise :class:`EngineError` for a 4xx/5xx answer (message taken from the body)."""
    if resp.status_code >= 400:
        msg, body = _error_message(resp)
        raise EngineError(resp.status_code, msg, body)


def _parse_json(resp: httpx.Response) -> Any:
    raise_for_status(resp)
    if not resp.content:
        return {}
    try:
        return resp.json()
    except ValueError:
        return {"message": resp.text}


def _parse_ok(resp: httpx.Response) -> bool:
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
                        stream: bool = False, extra_key: str | None = None) -> dict[str, Any]:
    """The ``/generate`` JSON body (SGLang ``GenerateReqInput``).  ``extra_key`` namespaces the
    request's prefix-cache entries on SGLang (a prefix is reused only by requests with the same
    key; the embedded engine ignores it)."""
    batched = len(input_ids) > 0 and isinstance(input_ids[0], (list, tuple, np.ndarray))
    body: dict[str, Any] = {"input_ids": [ids_json(x) for x in input_ids] if batched else ids_json(input_ids),
                            "sampling_params": _params_json(sampling_params), "return_logprob": return_logprob,
                            "stream": stream}
    if rid is not None:
        body["rid"] = rid if isinstance(rid, str) else list(rid)
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    if return_text_in_logprobs:
        body["return_text_in_logprobs"] = True
    if extra_key is not None:
        body["extra_key"] = extra_key
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
    raise_for_status(resp)
    try:
        body = resp.json()
    except ValueError:
        return True
    return not (isinstance(body, dict) and body.get("success") is False)


def op_generate(input_ids, sampling_params: SamplingLike, rid, return_logprob: bool, top_logprobs_num: int,
                return_text_in_logprobs: bool, extra_key: str | None = None) -> Op:
    """``POST /generate`` (one prompt or a batch); parses to a list of :class:`GenerateResult`."""
    return Op("POST", "/generate", build_generate_body(
        input_ids, sampling_params, rid=rid, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, extra_key=extra_key), _parse_generate)


def op_abort(rid: str | None, abort_all: bool) -> Op:
    """``POST /abort_request``; parses to ``False`` when the engine reports an unknown ``rid``."""
    body: dict[str, Any] = {"abort_all": abort_all}
    if rid is not None:
        body["rid"] = rid
    return Op("POST", "/abort_request", body, _parse_abort)


def op_json(method: str, path: str, body: Any = None) -> Op:
    """Any call answered with a JSON object (``{}`` for an empty answer)."""
    return Op(method, path, body, _parse_json)


def op_health(path: str = "/health") -> Op:
    """``GET /health`` or ``/health_generate``; parses to whether the answer was 200."""
    return Op("GET", path, None, _parse_ok)


def op_memory(action: str, tags: Sequence[str] | None) -> Op:
    """``POST /{action}_memory_occupation`` (``release`` | ``resume``) for ``tags`` (``None``: all)."""
    return op_json("POST", f"/{action}_memory_occupation", {"tags": list(tags)} if tags is not None else {})


def _update_common(weight_version: str, abort_all_requests: bool, flush_cache: bool) -> dict[str, Any]:
    if not isinstance(weight_version, str) or not weight_version:
        raise ValueError("weight_version must be a non-empty string (it labels every later response)")
    return {"weight_version": weight_version, "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}


def op_update_weights_from_disk(model_path: str, load_format: str | None, weight_version: str,
                                abort_all_requests: bool, flush_cache: bool) -> Op:
    """``POST /update_weights_from_disk``.

    Raises:
        ValueError: ``weight_version`` is not a non-empty string.
    """
    body = {"model_path": str(model_path), "load_format": load_format,
            **_update_common(weight_version, abort_all_requests, flush_cache)}
    return op_json("POST", "/update_weights_from_disk", body)


def op_update_weights_from_tensor(serialized_named_tensors: Sequence[str], load_format: str | None,
                                  weight_version: str, abort_all_requests: bool, flush_cache: bool) -> Op:
    """``POST /update_weights_from_tensor`` with payloads already serialised (the embedded engine's
    format: :func:`gyre.rollout.weights.serialize_named_tensors`; SGLang's: one per TP rank).

    Raises:
        ValueError: an empty ``weight_version``.
    """
    body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
            **_update_common(weight_version, abort_all_requests, flush_cache)}
    return op_json("POST", "/update_weights_from_tensor", body)


def op_init_weights_update_group(master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str, backend: str) -> Op:
    """``POST /init_weights_update_group`` (answers once every rank of the group has joined)."""
    return op_json("POST", "/init_weights_update_group",
                   {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                    "world_size": int(world_size), "group_name": group_name, "backend": backend})


def op_update_weights_from_distributed(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                       group_name: str, weight_version: str, abort_all_requests: bool,
                                       flush_cache: bool) -> Op:
    """``POST /update_weights_from_distributed``: the engine receives ``names`` by broadcast from
    rank 0 of ``group_name``, in order."""
    body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, **_update_common(weight_version, abort_all_requests, flush_cache)}
    return op_json("POST", "/update_weights_from_distributed", body)


def op_destroy_weights_update_group(group_name: str) -> Op:
    """``POST /destroy_weights_update_group``."""
    return op_json("POST", "/destroy_weights_update_group", {"group_name": group_name})


def op_update_weight_version(new_version: str, abort_all_requests: bool) -> Op:
    """``POST /update_weight_version``."""
    return op_json("POST", "/update_weight_version",
                   {"new_version": new_version, "abort_all_requests": abort_all_requests})


def incremental_streaming(server_info: Mapping[str, Any]) -> bool:
    """Whether the engine streams deltas (``/get_server_info`` ``incremental_streaming_output``)."""
    return bool(server_info.get("incremental_streaming_output", False))


def sample_count(sampling_params: SamplingLike) -> int:
    """``n`` (parallel samples per prompt) of ``sampling_params``."""
    if isinstance(sampling_params, SamplingParams):
        return sampling_params.n
    return int((sampling_params or {}).get("n", 1) or 1)


def iter_sse_events(lines: Iterable[str]) -> Iterator[Any]:
    """The JSON payloads of server-sent ``data:`` lines, up to ``data: [DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        if payload:
            yield json.loads(payload)
