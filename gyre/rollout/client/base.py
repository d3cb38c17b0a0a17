"""What both engine clients share: the base class (the engine's address, timeouts, the streaming
mode asked once, the check that keeps an embedded-engine weight payload from a real SGLang server),
the connection pool's limits, the bodies of a KV export and import (:mod:`gyre.rollout.embedded.kv_transfer`)
and the payloads of a tensor weight update."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import httpx

from gyre.rollout.client.messages import (
    EngineConnectionError,
    EngineError,
    GenerateResult,
    SamplingLike,
    json_content,
    raise_for_status,
    sample_count,
)
from gyre.rollout.client.sglang_protocol import from_server_info
from gyre.rollout.weights import serialize_named_tensors


#: Connection pool of either client: 256 connections, 64 of them kept alive.
HTTP_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=64)


class ClientBase:
    """The engine's ``base_url`` and timeouts, the streaming mode (asked once), the result of a
    generate as one result or ``n``, and the refusal of an embedded-engine weight payload to SGLang."""

    def __init__(self, base_url: str, timeout: float | None):
        self.base_url = base_url.rstrip("/")
        self.timeout = httpx.Timeout(timeout, connect=10.0)
        self._incremental: bool | None = None

    @staticmethod
    def _pick(results: list[GenerateResult], sampling_params: SamplingLike) -> GenerateResult | list[GenerateResult]:
        return results[0] if sample_count(sampling_params) == 1 and len(results) == 1 else results

    def _connection_error(self, path: str, exc: Exception) -> EngineConnectionError:
        return EngineConnectionError(f"{self.base_url}{path}: {type(exc).__name__}: {exc}")

    _protocol = None

    def _refuse_sglang(self, server_info) -> None:
        """Raise before an embedded-format weight payload reaches a real SGLang server (asked once;
        a server without ``/server_info`` is no SGLang)."""
        if self._protocol is None:
            try:
                info = server_info()
            except EngineError:
                info = None
            self._protocol = from_server_info(info)
        self._check_not_sglang()

    async def _refuse_sglang_async(self) -> None:
        if self._protocol is None:
            try:
                info = await self.get_server_info()
            except EngineError:
                info = None
            self._protocol = from_server_info(info)
        self._check_not_sglang()

    def _check_not_sglang(self) -> None:
        if self._protocol.is_sglang:
            raise ValueError(f"{self.base_url} is an SGLang server: it takes weights in SGLang's own serialization "
                             f"(gyre.rollout.sglang_driver.weights.SGLangTensorClient), not the embedded engine's")


_OCTETS = {"content-type": "application/octet-stream"}


def export_kv_result(resp: httpx.Response) -> tuple[int, bytes | dict | None]:
    raise_for_status(resp)
    if resp.headers.get("content-type", "").startswith("application/json"):
        body = resp.json()
        return int(body["cached_tokens"]), body.get("mooncake")
    return int(resp.headers["X-Cached-Tokens"]), resp.content


def import_kv_body(payload: bytes | dict) -> dict:
    """``content`` and ``headers`` of an import: a Mooncake handle as JSON, staged bytes as they are."""
    if isinstance(payload, dict):
        return json_content({"mooncake": payload})
    return {"content": payload, "headers": _OCTETS}


def tensor_payloads(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None,
                    serialized_named_tensors: Sequence[str] | None) -> Sequence[str]:
    """The ``serialized_named_tensors`` of a tensor weight update: as given, or ``named_tensors``
    as one payload in the embedded engine's format (:func:`gyre.rollout.weights.serialize_named_tensors`).

    Raises:
        ValueError: not exactly one of ``named_tensors`` / ``serialized_named_tensors``.
    """
    if (named_tensors is None) == (serialized_named_tensors is None):
        raise ValueError("give exactly one of named_tensors or serialized_named_tensors")
    if named_tensors is not None:
        return [serialize_named_tensors(named_tensors)]
    return serialized_named_tensors
