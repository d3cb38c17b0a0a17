"""The engine interface the proxy needs, adapters, and a scripted engine for tests and benches.

Engines speak SGLang's native ``/generate`` API (``input_ids`` in, output ids with
``return_logprob`` out). The proxy needs only two operations from an engine (:class:`Engine`):

* ``generate_stream(input_ids, sampling_params, rid)`` -- ``input_ids`` an ``int32`` numpy
  array (the router passes the prompt's array uncopied); an async iterator of
  :class:`EngineChunk` deltas (new output ids, their behaviour log-probs), the last one carrying
  ``finish_reason`` (``"stop"``, ``"length"`` or ``"abort"``); an aborted request ends with
  ``finish_reason == "abort"`` after the partial output (SGLang semantics);
* ``abort(rid)`` -- cancel an in-flight request (it then ends with ``"abort"``).

Unavailability (connection refused or reset, a 5xx, 408/429) raises :class:`EngineUnavailable`,
which the router retries; a request the engine refuses as invalid (a 4xx, or an error event in
its stream, where SGLang reports a validation error after a 200) raises
:class:`EngineRejected`, which is never retried. :class:`ClientEngine` adapts Gyre's
SGLang-native client (``gyre.rollout.client.async_client.AsyncEngineClient``: its ``stream`` yields chunks with
``delta_output_ids``/``delta_logprobs``/``finish_reason.type``/``weight_version``) -- the same for
the embedded CPU engine and a real SGLang server. :class:`ScriptedEngine` emits scripted token
sequences (teacher forcing, tests, ``bench/proxy.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import orjson

from gyre.rollout.client.sglang_protocol import from_server_info

__all__ = ["EngineChunk", "Engine", "EngineUnavailable", "EngineRejected", "ClientEngine", "ScriptedEngine",
           "parse_version", "engine_rid", "request_seed"]


class EngineUnavailable(RuntimeError):
    """The engine could not be reached or could not serve the request now (the proxy retries)."""


class EngineRejected(RuntimeError):
    """The engine refused the request as invalid: the same request would be refused again, so
    the proxy does not retry it and answers the client with ``status`` (a 4xx).

    Args:
        status: the engine's HTTP status (4xx).
        message: the engine's error message.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = int(status)
        self.message = message


#: Engine statuses that mean "not now" rather than "never": retried like a refused connection.
RETRYABLE_4XX = frozenset({408, 429, 499})


def is_rejection(exc: BaseException) -> bool:
    """Whether a client exception is the engine refusing the request (a 4xx other than
    :data:`RETRYABLE_4XX`; the client's ``EngineError.status_code``, or an SGLang abort's
    ``FinishReason.status_code``)."""
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and 400 <= status < 500 and status not in RETRYABLE_4XX


@dataclass(slots=True)
class EngineChunk:
    """New output of one request: ``output_ids`` (``int`` token ids) and ``logprobs`` (natural
    log, one per id); ``finish_reason`` on the last chunk only; ``weight_version`` the policy
    version that produced these tokens (``None`` if unknown)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    weight_version: int | None = None


@runtime_checkable
class Engine(Protocol):
    """What the proxy calls on a rollout engine (see the module docstring)."""

    engine_id: str

    def generate_stream(self, input_ids: Sequence[int], sampling_params: dict[str, Any],
                        rid: str) -> AsyncIterator[EngineChunk]:
        ...

    async def abort(self, rid: str) -> None:
        ...


def parse_version(v: Any) -> int | None:
    """An integer policy version from an engine's ``weight_version`` (``"3"``, ``"v3"``, ``3``)."""
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    s = str(v).strip().lstrip("vV")
    try:
        return int(s)
    except ValueError:
        return None


def request_seed(rid: str) -> int:
    """A sampling seed of a request id: stable across runs, distinct between ids (63 bits)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "big") >> 1


#: Ends every request id :func:`engine_rid` writes; inside an id it is escaped.
RID_END = "#"
_RID_ESCAPE = "\\"


def engine_rid(rid: str) -> str:
    """The id a request of ``rid`` has on its engine: ``rid`` with :data:`RID_END` and the escape
    character escaped, then :data:`RID_END` (``"E-1"`` -> ``"E-1#"``).

    SGLang's ``/abort_request`` aborts every request whose id *starts with* the one given, and
    Gyre's ids are not prefix-free (``E-1`` is a prefix of ``E-12`` and of its retry ``E-1.r1``).
    These ids are: the only unescaped :data:`RID_END` is the last character, so one such id
    cannot be a prefix of another.  The embedded engine matches ids exactly, and sees the same id
    in the request and in its abort."""
    if RID_END in rid or _RID_ESCAPE in rid:
        rid = rid.replace(_RID_ESCAPE, _RID_ESCAPE * 2).replace(RID_END, _RID_ESCAPE + RID_END)
    return rid + RID_END


class ClientEngine:
    """Adapter for an SGLang-native async client (``gyre.rollout.client.async_client.AsyncEngineClient``).

    Every request id goes to the engine as :func:`engine_rid` writes it (in the request and in its
    abort), so aborting one request on SGLang never aborts another whose id it begins.

    Args:
        client: object with ``stream(input_ids, sampling_params, *, rid, return_logprob)`` (an
            async iterator of chunks with ``delta_output_ids``, ``delta_logprobs``,
            ``finish_reason`` (``.type``) and ``weight_version``) and ``abort(rid)``.
        engine_id: the route name of this engine.
        seed_each_request: give every request without a ``sampling_seed`` one of its own
            (:func:`request_seed` of its rid).  ``None`` (the default): do so when the engine is
            an SGLang server, as the client's ``get_server_info()`` reports (asked before the first
            request, and again while it fails; a request sent while it fails is seeded).  An SGLang
            server in deterministic inference mode (however that mode was switched on) samples
            every unseeded request with one fixed seed, so a group's identical prompts would all
            get the same output; out of that mode it ignores the seed.  A client without
            ``get_server_info`` is not seeded.
        key_by_weight_version: send every request with ``extra_key`` ``weights-<version>``, the
            engine's weight version as its ``get_weight_version()`` answers just before the request
            (``None``, the default: when the engine is an SGLang server).  SGLang reuses a cached
            prefix only for a request with the same key, in its prefix cache and its shared KV
            store, so a prefix computed under earlier weights is not reused after a push that did
            not flush them.  A request sent just before a push (one waiting through its pause) still
            carries the earlier version's key.
    """

    def __init__(self, client: Any, engine_id: str, *, seed_each_request: bool | None = None,
                 key_by_weight_version: bool | None = None) -> None:
        self.client = client
        self.engine_id = engine_id
        self.seed_each_request = seed_each_request
        self.key_by_weight_version = key_by_weight_version
        #: the engine's weight version as last asked (the ``extra_key`` of its requests)
        self.served_version: str | None = None
        self._sglang: bool | None = None

    async def _is_sglang(self) -> bool | None:
        """Whether the engine is an SGLang server (asked once of ``get_server_info``); ``None``
        while it gives no answer (asked again next time)."""
        if self._sglang is None:
            ask = getattr(self.client, "get_server_info", None)
            if ask is None:
                self._sglang = False
                return False
            try:
                info = await ask()
            except Exception as exc:
                if isinstance(exc, asyncio.CancelledError):
                    raise
                status = getattr(exc, "status_code", None)
                if not (isinstance(status, int) and 400 <= status < 500):
                    return None
                info = None  # refused: no SGLang (which serves /server_info)
            self._sglang = from_server_info(info).is_sglang
        return self._sglang

    async def _seeds(self) -> bool:
        """Whether this engine's requests get a seed of their own (see the class docstring)."""
        if self.seed_each_request is None:
            sglang = await self._is_sglang()
            if sglang is None:
                return True  # no answer now: seed this request, ask again next time
            self.seed_each_request = sglang
        return self.seed_each_request

    async def _extra_key(self) -> str | None:
        """The request's ``extra_key``: ``weights-<version>``, the version the engine reports just
        before the request (see the class docstring); the last one it reported when it gives no
        answer now; ``None`` when requests are not keyed."""
        if self.key_by_weight_version is None:
            sglang = await self._is_sglang()
            if sglang is not None:
                self.key_by_weight_version = sglang
        if self.key_by_weight_version:
            try:
                self.served_version = str(await self.client.get_weight_version())
            except Exception as exc:
                if isinstance(exc, asyncio.CancelledError):
                    raise
        return None if self.served_version is None else f"weights-{self.served_version}"

    async def generate_stream(self, input_ids: Sequence[int], sampling_params: dict[str, Any],
                              rid: str) -> AsyncIterator[EngineChunk]:
        if sampling_params.get("sampling_seed") is None and await self._seeds():
            sampling_params = {**sampling_params, "sampling_seed": request_seed(rid)}
        key = await self._extra_key()
        try:
            stream = self.client.stream(input_ids, dict(sampling_params), rid=engine_rid(rid), return_logprob=True,
                                        **({} if key is None else {"extra_key": key}))
            async for ch in stream:
                ids = list(ch.delta_output_ids or [])
                lps = list(ch.delta_logprobs) if ch.delta_logprobs is not None else [0.0] * len(ids)
                fr = ch.finish_reason.type if ch.finish_reason is not None else None
                if fr == "abort" and is_rejection(ch.finish_reason):  # e.g. SGLang's too-long prompt
                    raise EngineRejected(ch.finish_reason.status_code, ch.finish_reason.message or "request refused")
                yield EngineChunk(ids, lps, fr, parse_version(ch.weight_version))
                if fr is not None:
                    return
        except Exception as exc:  # the client's EngineError/EngineConnectionError and anything else it raises
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit, EngineRejected)):
                raise
            if isinstance(exc, orjson.JSONEncodeError):  # the request cannot be written: no engine would take it
                raise EngineRejected(400, f"the request cannot be encoded as JSON for the engine: {exc}") from exc
            if is_rejection(exc):
                raise EngineRejected(exc.status_code, str(getattr(exc, "message", exc))) from exc
            raise EngineUnavailable(f"{self.engine_id}: {type(exc).__name__}: {exc}") from exc
        raise EngineUnavailable(f"{self.engine_id}: stream ended without a finish reason")

    async def abort(self, rid: str) -> None:
        try:
            await self.client.abort(engine_rid(rid))
        except Exception as exc:  # best effort: a dead engine aborts nothing
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def export_kv(self, input_ids: Sequence[int], transport: str = "http") -> tuple[int, bytes | dict | None]:
        """The client's ``export_kv`` (embedded engine; errors propagate)."""
        return await self.client.export_kv(input_ids, transport)

    async def import_kv(self, payload: bytes | dict) -> dict:
        """The client's ``import_kv`` (errors propagate)."""
        return await self.client.import_kv(payload)

    async def release_kv(self, pin: int) -> bool:
        """The client's ``release_kv`` (errors propagate)."""
        return await self.client.release_kv(pin)


@dataclass
class ScriptedEngine:
    """An in-process engine that emits scripted outputs (tests, teacher forcing, benchmarks).

    Args:
        engine_id: route name.
        script: ``(input_ids, sampling_params) -> output ids`` (the whole output; the EOS id is
            appended by the callable when wanted); a plain list is used for every request.
        chunk: ids per streamed chunk.
        delay_s: sleep per chunk (seconds), to make requests overlap.
        logprob: the behaviour log-prob reported for every token.
        weight_version: reported policy version.

    ``abort(rid)`` (or :meth:`abort_all`) ends an in-flight request with ``"abort"`` after the
    ids emitted so far; ``fail_next`` makes the next ``n`` requests raise
    :class:`EngineUnavailable` before emitting anything. ``max_new_tokens`` is honoured
    (``"length"``). ``calls`` records ``(rid, input_ids)``.
    """

    engine_id: str
    script: Callable[[list[int], dict[str, Any]], list[int]] | list[int] = field(default_factory=list)
    chunk: int = 4
    delay_s: float = 0.0
    logprob: float = -0.25
    weight_version: int | None = 0
    fail_next: int = 0
    calls: list[tuple[str, list[int]]] = field(default_factory=list)
    _aborted: set[str] = field(default_factory=set)
    _live: set[str] = field(default_factory=set)

    async def generate_stream(self, input_ids: Sequence[int], sampling_params: dict[str, Any],
                              rid: str) -> AsyncIterator[EngineChunk]:
        ids_in = np.asarray(input_ids).tolist()
        self.calls.append((rid, ids_in))
        if self.fail_next > 0:
            self.fail_next -= 1
            raise EngineUnavailable(f"{self.engine_id}: injected failure")
        out = list(self.script(ids_in, sampling_params) if callable(self.script) else self.script)
        cap = int(sampling_params.get("max_new_tokens", len(out)))
        finish = "stop"
        if len(out) > cap:
            out, finish = out[:cap], "length"
        self._live.add(rid)
        try:
            i = 0
            while True:
                if rid in self._aborted:
                    self._aborted.discard(rid)
                    yield EngineChunk([], [], "abort", self.weight_version)
                    return
                part = out[i:i + self.chunk]
                i += len(part)
                done = i >= len(out)
                yield EngineChunk(part, [self.logprob] * len(part), finish if done else None, self.weight_version)
                if done:
                    return
                await asyncio.sleep(self.delay_s)
        finally:
            self._live.discard(rid)

    async def abort(self, rid: str) -> None:
        if rid in self._live:
            self._aborted.add(rid)

    def abort_all(self) -> None:
        """Abort every in-flight request."""
        self._aborted |= self._live
