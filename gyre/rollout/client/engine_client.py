"""The blocking client of one rollout engine over SGLang's native HTTP API (cells and tools use it).

:class:`EngineClient` (``httpx.Client``) exposes ``generate``, ``generate_batch``, ``stream``,
``abort``, ``abort_all``, ``pause_generation``, ``continue_generation``,
``release_memory_occupation``, ``resume_memory_occupation``, ``flush_cache``,
``update_weights_from_disk``, ``update_weights_from_tensor``, ``update_weight_version``,
``get_weight_version``, ``health``, ``health_generate``, ``wait_until_ready``,
``get_model_info``, ``get_server_info`` (``GET /model_info`` and ``/server_info``, where
SGLang 0.5.10 also reports the ``weight_version``); its ``asyncio`` twin, with the same methods, is
:class:`gyre.rollout.client.async_client.AsyncEngineClient`.  Each method sends one call built in
:mod:`gyre.rollout.client.messages` (which also defines the results and errors they return
and raise); the clients only add the transport.  A transport failure raises
:class:`~gyre.rollout.client.messages.EngineConnectionError`.

:func:`flush_when_idle` flushes an engine's prefix cache once nothing runs; :class:`RolloutEngine`
is what a cell needs from an engine it owns: ``start``, ``stop``, ``url`` and ``client``.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, Mapping, Protocol, Sequence

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
    op_destroy_weights_update_group,
    op_generate,
    op_health,
    op_init_weights_update_group,
    op_json,
    op_memory,
    op_update_weight_version,
    op_update_weights_from_disk,
    op_update_weights_from_distributed,
    op_update_weights_from_tensor,
    raise_for_status,
)


def flush_when_idle(engine, timeout_s: float = 30.0, poll_s: float = 0.05) -> int:
    """Call ``engine.flush_cache()`` until it succeeds; return the tries it took.  SGLang flushes
    only when nothing is running or waiting (HTTP 400 otherwise), so after a ``pause_generation``
    in ``abort`` mode this returns once the aborted requests have left the scheduler.

    Raises:
        EngineError: an answer other than 400, or still 400 after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    tries = 0
    while True:
        tries += 1
        try:
            engine.flush_cache()
            return tries
        except EngineError as exc:
            if exc.status_code != 400 or time.monotonic() > deadline:
                raise
        time.sleep(poll_s)


class EngineClient(ClientBase):
    """Blocking client of one engine at ``base_url`` (``http://host:port``).

    Args:
        base_url: engine address.
        timeout: seconds per HTTP operation (``None``: no limit); connect timeout is 10 s.
        transport: optional ``httpx`` transport (tests).
        shared_memory_weights: send ``named_tensors`` of :meth:`update_weights_from_tensor` as a
            shared-memory bucket (:mod:`gyre.rollout.tensor_bucket`) instead of their bytes: for an
            embedded engine on this host only (its own process or another one here).
    """

    def __init__(self, base_url: str, *, timeout: float | None = 600.0,
                 transport: httpx.BaseTransport | None = None, shared_memory_weights: bool = False):
        super().__init__(base_url, timeout)
        self.shared_memory_weights = shared_memory_weights
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=transport, limits=HTTP_LIMITS)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _do(self, op: Op) -> Any:
        try:
            resp = self._http.request(op.method, op.path, **json_content(op.body))
        except httpx.TransportError as exc:
            raise self._connection_error(op.path, exc) from exc
        return op.parse(resp)

    # generation ---------------------------------------------------------------

    def generate(self, input_ids: Sequence[int], sampling_params: SamplingLike = None, *, rid: str | None = None,
                 return_logprob: bool = True, top_logprobs_num: int = 0,
                 return_text_in_logprobs: bool = False, extra_key: str | None = None
                 ) -> GenerateResult | list[GenerateResult]:
        """Generate from one prompt; a list of ``n`` results when ``sampling_params.n > 1``
        (``extra_key``: :func:`~gyre.rollout.client.messages.build_generate_body`)."""
        res = self._do(op_generate(input_ids, sampling_params, rid, return_logprob, top_logprobs_num,
                                   return_text_in_logprobs, extra_key))
        return self._pick(res, sampling_params)

    def generate_batch(self, batch_input_ids: Sequence[Sequence[int]], sampling_params: SamplingLike = None, *,
                       rids: Sequence[str] | None = None, return_logprob: bool = True,
                       top_logprobs_num: int = 0) -> list[GenerateResult]:
        """Generate from several prompts in one request (input-major, ``n`` samples each)."""
        return self._do(op_generate([list(x) for x in batch_input_ids], sampling_params, rids, return_logprob,
                                    top_logprobs_num, False))

    def stream(self, input_ids: Sequence[int], sampling_params: SamplingLike = None, *, rid: str | None = None,
               return_logprob: bool = True) -> Iterator[StreamChunk]:
        """Stream one prompt's generation (SSE); closing the iterator early aborts it server-side."""
        norm = StreamNormalizer(self._incremental_mode())
        body = build_generate_body(input_ids, sampling_params, rid=rid, return_logprob=return_logprob, stream=True)
        try:
            with self._http.stream("POST", "/generate", **json_content(body)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise_for_status(resp)
                for event in iter_sse_events(resp.iter_lines()):
                    yield norm.feed(event)
        except httpx.TransportError as exc:
            raise self._connection_error("/generate", exc) from exc

    def _incremental_mode(self) -> bool:
        if self._incremental is None:
            try:
                self._incremental = incremental_streaming(self.get_server_info())
            except EngineError:
                self._incremental = False
        return self._incremental

    # control --------------------------------------------------------------------

    def abort(self, rid: str) -> bool:
        """Abort request ``rid``; the request then answers with ``finish_reason.type == "abort"``
        and its partial output.  On the embedded engine this reaches all ``n`` samples of the
        request; SGLang gives each of ``n > 1`` samples an id of its own, so there it reaches none
        of them (:meth:`abort_all` does).  SGLang aborts every request whose id starts with ``rid``
        (the proxy sends ids no other begins: :func:`gyre.proxy.engines.engine_rid`).  Returns
        ``False`` when the embedded engine does not know ``rid`` (finished or never seen); SGLang
        always says ``True``."""
        return self._do(op_abort(rid, False))

    def abort_all(self) -> None:
        """Abort every running and waiting request."""
        self._do(op_abort(None, True))

    def pause_generation(self, mode: str = "abort") -> dict:
        """Pause with mode ``abort`` | ``in_place`` | ``retract`` (see :mod:`gyre.rollout.embedded.core`)."""
        return self._do(op_json("POST", "/pause_generation", {"mode": mode}))

    def continue_generation(self) -> dict:
        return self._do(op_json("POST", "/continue_generation", {}))

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        """Free ``weights`` and/or ``kv_cache`` (``None``: both); requires no running request."""
        return self._do(op_memory("release", tags))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        return self._do(op_memory("resume", tags))

    def flush_cache(self) -> None:
        self._do(op_json("POST", "/flush_cache"))

    def export_kv(self, input_ids: Sequence[int], transport: str = "http") -> tuple[int, bytes | dict | None]:
        """``(m, payload)``: the KV payload of the longest prefix of ``input_ids`` the engine holds
        (:mod:`gyre.rollout.embedded.kv_transfer`; embedded engine only), ``(0, None)`` when it holds none.
        With ``transport="mooncake"`` the payload stays on the engine, staged and pinned, and
        ``payload`` is its Mooncake handle (release it with :meth:`release_kv`)."""
        return export_kv_result(self._post_kv("/gyre/export_kv", **json_content(
            {"input_ids": ids_json(input_ids), "transport": transport})))

    def import_kv(self, payload: bytes | dict) -> dict:
        """Store a KV payload (bytes, or a Mooncake handle the engine reads from the source) in the
        engine's prefix cache; ``{"imported_tokens", "tokens", "bytes"}``.

        Raises:
            EngineError: 400 when the payload is malformed, of other weights or layout, or the read failed.
        """
        resp = self._post_kv("/gyre/import_kv", **import_kv_body(payload))
        raise_for_status(resp)
        return resp.json()

    def release_kv(self, pin: int) -> bool:
        """Let the engine drop a staged payload; False when it was gone already."""
        resp = self._post_kv("/gyre/release_kv", json={"pin": int(pin)})
        raise_for_status(resp)
        return bool(resp.json()["released"])

    def _post_kv(self, path: str, **kwargs) -> httpx.Response:
        try:
            return self._http.post(path, **kwargs)
        except httpx.TransportError as exc:
            raise self._connection_error(path, exc) from exc

    def update_weights_from_disk(self, model_path: str, *, weight_version: str, abort_all_requests: bool = False,
                                 flush_cache: bool = True, load_format: str | None = None) -> dict:
        """Load HF-named weights from a directory or file visible to the engine."""
        return self._do(op_update_weights_from_disk(model_path, load_format, weight_version, abort_all_requests,
                                                    flush_cache))

    def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
                                   *, weight_version: str, serialized_named_tensors: Sequence[str] | None = None,
                                   load_format: str | None = None, abort_all_requests: bool = False,
                                   flush_cache: bool = True) -> dict:
        """Update weights from tensors.

        ``named_tensors`` is serialised in the embedded engine's CPU format
        (:func:`gyre.rollout.weights.serialize_named_tensors`), or, with ``shared_memory_weights``,
        copied to the host into one shared-memory bucket whose handle is sent (``load_format
        "flattened_bucket"``; the bucket is kept until the engine has answered); for a real SGLang
        server pass ``serialized_named_tensors`` built by SGLang's own serializer (one per TP rank).

        Raises:
            ValueError: ``named_tensors`` for a server that reports an SGLang version (that payload
                would kill it: use :class:`gyre.rollout.sglang_driver.weights.SGLangTensorClient`).
        """
        if named_tensors is not None:
            self._refuse_sglang(self.get_server_info)
            if self.shared_memory_weights and serialized_named_tensors is None:
                from gyre.rollout.tensor_bucket import LOAD_FORMAT as FLAT_BUCKET, FlatBucket

                items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
                bucket = FlatBucket.pack([(n, t.detach().cpu()) for n, t in items])  # kept until the engine answers
                return self._do(op_update_weights_from_tensor([bucket.serialize()], FLAT_BUCKET, weight_version,
                                                              abort_all_requests, flush_cache))
        payloads = tensor_payloads(named_tensors, serialized_named_tensors)
        return self._do(op_update_weights_from_tensor(payloads, load_format, weight_version, abort_all_requests,
                                                      flush_cache))

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> dict:
        return self._do(op_update_weight_version(new_version, abort_all_requests))

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> dict:
        """Join a weight-update group (:mod:`gyre.rollout.weight_group`); returns once all have joined."""
        return self._do(op_init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                     group_name, backend))

    def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], weight_version: str,
                                        group_name: str = "weight_update_group", abort_all_requests: bool = False,
                                        flush_cache: bool = True) -> dict:
        """Receive ``names`` by broadcast from rank 0 of ``group_name`` and load them."""
        return self._do(op_update_weights_from_distributed(names, dtypes, shapes, group_name, weight_version,
                                                           abort_all_requests, flush_cache))

    def begin_weight_update(self) -> dict:
        """``POST /begin_weight_update``: open a weight-update session (SGLang 0.5.23 and newer
        load weights only inside one; :mod:`gyre.rollout.client.sglang_protocol`)."""
        return self._do(op_json("POST", "/begin_weight_update", {}))

    def end_weight_update(self) -> dict:
        """``POST /end_weight_update``: close the session :meth:`begin_weight_update` opened."""
        return self._do(op_json("POST", "/end_weight_update", {}))

    def destroy_weights_update_group(self, *, group_name: str = "weight_update_group") -> dict:
        return self._do(op_destroy_weights_update_group(group_name))

    def get_weight_version(self) -> str:
        return str(self.get_model_info()["weight_version"])

    # status ---------------------------------------------------------------------

    def health(self) -> bool:
        """``GET /health`` answered 200 (``False`` on errors or no answer).  SGLang generates a token
        for it unless started with that off, as :class:`~gyre.rollout.sglang_driver.engine.SGLangEngine`
        starts it; generating, it waits 20 s on a paused or released server and answers 503."""
        try:
            return self._do(op_health("/health"))
        except EngineConnectionError:
            return False

    def health_generate(self) -> bool:
        """``GET /health_generate`` (runs a one-token generation) answered 200."""
        try:
            return self._do(op_health("/health_generate"))
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

    def clear_hicache_storage(self) -> dict:
        """Empty the storage tier of SGLang's hierarchical cache (``POST
        /hicache/storage-backend/clear``, ``/clear_hicache_storage_backend`` on an SGLang without it)."""
        return self._json_or_older("POST", "/hicache/storage-backend/clear", "/clear_hicache_storage_backend")

    def get_model_info(self) -> dict:
        """``GET /model_info`` (``/get_model_info`` on an engine without it)."""
        return self._json_or_older("GET", "/model_info", "/get_model_info")

    def get_server_info(self) -> dict:
        """``GET /server_info`` (``/get_server_info`` on an engine without it)."""
        return self._json_or_older("GET", "/server_info", "/get_server_info")

    def _json_or_older(self, method: str, path: str, older: str) -> dict:
        """``path``, or ``older`` when the engine answers 404 (an SGLang from before ``path``)."""
        try:
            return self._do(op_json(method, path))
        except EngineError as exc:
            if exc.status_code != 404:
                raise
            return self._do(op_json(method, older))


class RolloutEngine(Protocol):
    """A running engine a cell owns (:class:`~gyre.rollout.embedded.server.EngineServer`,
    :class:`~gyre.rollout.embedded.serve.EmbeddedEngineProcess` or
    :class:`~gyre.rollout.sglang_driver.engine.SGLangEngine`)."""

    @property
    def url(self) -> str: ...

    def start(self) -> "RolloutEngine": ...

    def stop(self) -> None: ...

    def client(self, timeout: float | None = 600.0) -> EngineClient: ...
