"""Routing of executions to engines and transparent retry of aborted/failed generations.

Each execution is pinned to one engine; the route can change at any time, and a request
cancelled by a role transition is retried at the new destination while the harness sees one
normal response. :class:`Router` holds the engines and the route table (execution -> engine id). The scheduler
changes routes with :meth:`Router.set_route` / :meth:`Router.reroute_engine` and cancels
outstanding requests on a source engine with :meth:`Router.abort_engine`.

:meth:`Router.generate` streams one generation for an execution. When the engine ends a request
with ``"abort"`` (role transition, pause) or fails (:class:`~gyre.proxy.engines.EngineUnavailable`),
it re-issues it on the execution's *current* route, continuing from what was already generated:
the new request's input is ``input_ids ++ output so far`` and its ``max_new_tokens`` and
``min_new_tokens`` are reduced by the tokens already produced (the remaining minimum is
``max(0, min_new_tokens - produced)``; SGLang-native continuation). The destination engine
recomputes the KV cache of that input, unless ``kv_migration`` is on and both engines move KV
payloads (``export_kv`` / ``import_kv``, the embedded engine's :mod:`gyre.rollout.embedded.kv_transfer`):
then the retry first copies the KV of the longest prefix the source still holds into the
destination's prefix cache, and :meth:`Router.abort_engine` returns only once the aborted
requests' copies are done (or ``migration_timeout_s`` passed), so the source may release its
memory afterwards. The same copy follows every other route change: :meth:`Router.abort_engine`
also copies the context of each idle execution that engine served last and that is routed
elsewhere now, and an execution's next call on a new route first copies from the engine that
served it last (a move for load balance, a standalone engine taking over). Bytes go engine to
engine over Mooncake (``kv_transport="mooncake"``: the source pins a staged payload, the
destination reads it, the source releases it) or through the proxy (``"http"``, also the fallback
when Mooncake fails). A copy that fails costs nothing but the recompute. A request the engine refuses
(:class:`~gyre.proxy.engines.EngineRejected`, a 4xx) is not retried: the error goes to the
caller at once. The caller sees one uninterrupted stream; each
:class:`Attempt` is reported for the record's metadata. Retries wait with exponential backoff
(``retry_backoff_s`` doubling up to ``retry_backoff_max_s``) while the route stays on a failing
engine, and give up after ``retry_timeout_s`` seconds (:class:`GenerationFailed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

import numpy as np

from gyre.proxy.engines import Engine, EngineChunk, EngineRejected, EngineUnavailable

__all__ = ["Router", "Attempt", "GenerationFailed", "RouteError"]

logger = logging.getLogger(__name__)


class RouteError(KeyError):
    """Unknown engine or execution in a routing call."""


class GenerationFailed(RuntimeError):
    """No engine completed the generation within the retry budget."""


@dataclass(slots=True)
class Attempt:
    """One engine request of a generation: ``engine_id``, ``rid``, output ``tokens`` it
    contributed, how it ended (``stop``/``length``/``abort``/``error``/``rejected``), its policy
    version, and the input tokens whose KV was migrated to it."""

    engine_id: str
    rid: str
    tokens: int = 0
    outcome: str = ""
    weight_version: int | None = None
    migrated_tokens: int = 0  # KV of the input copied from the previous engine before this attempt


@dataclass
class _Counts:
    retries: int = 0
    reroutes: int = 0


def _attempt_params(sampling_params: dict[str, Any], produced: int, max_new: int, min_new: int) -> dict[str, Any]:
    """The sampling parameters of an attempt after ``produced`` tokens: the output limits less
    what earlier attempts produced (at least one token more; ``min_new_tokens`` within the limit)."""
    params = dict(sampling_params)
    params["max_new_tokens"] = max(1, max_new - produced)
    if "min_new_tokens" in params:
        params["min_new_tokens"] = min(max(0, min_new - produced), params["max_new_tokens"])
    return params


def _join(prompt: np.ndarray, produced: list[int]) -> np.ndarray:
    """The input of a retry: the prompt and what earlier attempts produced (the prompt itself,
    uncopied, when they produced nothing)."""
    if not produced:
        return prompt
    return np.concatenate([prompt, np.asarray(produced, dtype=np.int32)])


class Router:
    """Engines, routes and retrying generation (see the module docstring).

    Args:
        retry_timeout_s: give up retrying a generation after this many seconds.
        retry_backoff_s / retry_backoff_max_s: wait between attempts on the same engine
            (doubling); an attempt on a *new* route starts immediately.
        on_retry: optional callback ``(execution_id, attempt, rerouted)`` after each retry.
        kv_migration: copy the KV of a rerouted request's input from the source engine to the
            destination before retrying there, and an execution's context on any route change
            (module docstring); ``migration_timeout_s`` bounds each copy.
        kv_transport: ``"mooncake"`` (engine to engine, falling back to ``"http"``) or ``"http"``.
    """

    def __init__(
        self,
        *,
        retry_timeout_s: float = 600.0,
        retry_backoff_s: float = 0.05,
        retry_backoff_max_s: float = 2.0,
        on_retry: Callable[[str, Attempt, bool], None] | None = None,
        kv_migration: bool = False,
        migration_timeout_s: float = 30.0,
        kv_transport: str = "mooncake",
    ) -> None:
        if kv_transport not in ("mooncake", "http"):
            raise ValueError(f"kv_transport must be 'mooncake' or 'http', not {kv_transport!r}")
        self.engines: dict[str, Engine] = {}
        self.routes: dict[str, str] = {}
        self.retry_timeout_s = float(retry_timeout_s)
        self.retry_backoff_s = float(retry_backoff_s)
        self.retry_backoff_max_s = float(retry_backoff_max_s)
        self.on_retry = on_retry
        self._inflight: dict[str, dict[str, str]] = {}  # engine_id -> {rid: execution_id}
        self._route_changed: dict[str, asyncio.Event] = {}
        self._ids = itertools.count()
        self.kv_migration = bool(kv_migration)
        self.migration_timeout_s = float(migration_timeout_s)
        self._handoff: dict[str, asyncio.Event] = {}  # rid -> set once its retry no longer needs the source
        self.kv_transport = kv_transport
        # with kv_migration: execution -> (engine that served its last call, the tokens it holds)
        self._held: dict[str, tuple[str, np.ndarray]] = {}
        self.migration_stats = {"copies": 0, "tokens": 0, "bytes": 0, "seconds": 0.0, "failed": 0}

    # ------------------------------------------------------------------ engines and routes
    def add_engine(self, engine: Engine) -> None:
        """Register (or replace) an engine under ``engine.engine_id``."""
        self.engines[engine.engine_id] = engine
        self._inflight.setdefault(engine.engine_id, {})

    def remove_engine(self, engine_id: str) -> None:
        """Forget an engine (routes to it must be moved first; requests on it will retry)."""
        self.engines.pop(engine_id, None)

    def set_route(self, execution_id: str, engine_id: str) -> None:
        """Pin ``execution_id`` to ``engine_id`` (takes effect for the next engine request,
        including retries of requests in flight).

        Raises:
            RouteError: unknown engine.
        """
        if engine_id not in self.engines:
            raise RouteError(f"unknown engine {engine_id!r}")
        old = self.routes.get(execution_id)
        self.routes[execution_id] = engine_id
        if old != engine_id:
            ev = self._route_changed.get(execution_id)
            if ev is not None:
                ev.set()

    def route(self, execution_id: str) -> str:
        """The engine id ``execution_id`` is pinned to.

        Raises:
            RouteError: no route.
        """
        try:
            return self.routes[execution_id]
        except KeyError:
            raise RouteError(f"execution {execution_id!r} has no route") from None

    def drop_route(self, execution_id: str) -> None:
        """Forget the route of a closed execution."""
        self.routes.pop(execution_id, None)
        self._route_changed.pop(execution_id, None)
        self._held.pop(execution_id, None)

    def reroute_engine(self, source: str, destination: str) -> list[str]:
        """Move every execution routed to ``source`` to ``destination``; return their ids."""
        moved = [e for e, r in self.routes.items() if r == source]
        for e in moved:
            self.set_route(e, destination)
        return moved

    def inflight(self, engine_id: str) -> dict[str, str]:
        """``{rid: execution_id}`` of requests currently running on ``engine_id``."""
        return dict(self._inflight.get(engine_id, {}))

    async def abort_engine(self, engine_id: str) -> int:
        """Abort every request in flight on ``engine_id`` (they retry on their current route);
        return how many were aborted.  With ``kv_migration`` it returns once the retries and the
        idle executions this engine served last have copied their KV off it (module docstring)."""
        eng = self.engines.get(engine_id)
        aborted = dict(self._inflight.get(engine_id, {}))
        rids = list(aborted)
        if eng is None:
            return 0
        await asyncio.gather(*(eng.abort(r) for r in rids), return_exceptions=True)
        waits = [asyncio.ensure_future(ev.wait()) for r in rids if (ev := self._handoff.get(r)) is not None]
        if self.kv_migration:  # the retries of aborted requests copy their own KV
            busy = {e for inflight in self._inflight.values() for e in inflight.values()} | set(aborted.values())
            idle = [e for e, (src, _) in self._held.items()
                    if src == engine_id and e not in busy and self.routes.get(e, engine_id) != engine_id]
            waits += [asyncio.ensure_future(self._migrate_held(e)) for e in idle]
        if waits:  # the copies off the source finish first
            await asyncio.wait(waits, timeout=self.migration_timeout_s)
            for w in waits:
                w.cancel()
        return len(rids)

    async def _migrate_held(self, execution_id: str) -> None:
        """Copy what the engine that served ``execution_id`` last holds of it to its current route."""
        held = self._held.get(execution_id)
        destination = self.routes.get(execution_id)
        if held is None or destination is None or held[0] == destination:
            return
        await self._migrate(held[0], destination, held[1])
        if self._held.get(execution_id) is held:
            self._held[execution_id] = (destination, held[1])

    async def _migrate(self, source: str, destination: str, token_ids: np.ndarray) -> int:
        """Copy the KV of the longest prefix of ``token_ids`` that ``source`` holds into
        ``destination``'s prefix cache; returns the tokens copied (0: nothing held, no support,
        or the copy failed -- the destination then recomputes)."""
        src, dst = self.engines.get(source), self.engines.get(destination)
        if not (hasattr(src, "export_kv") and hasattr(dst, "import_kv")):
            return 0
        for transport in dict.fromkeys((self.kv_transport, "http")):
            t0 = time.monotonic()
            try:
                m, moved = await asyncio.wait_for(self._copy(src, dst, token_ids, transport),
                                                  self.migration_timeout_s)
            except Exception as exc:  # a failed copy degrades to the other transport, then to recompute
                if isinstance(exc, asyncio.CancelledError):
                    raise
                self.migration_stats["failed"] += 1
                logger.warning("KV copy %s -> %s over %s failed: %s: %s", source, destination, transport,
                               type(exc).__name__, exc)
                continue
            if m:
                st = self.migration_stats
                st["copies"] += 1
                st["tokens"] += m
                st["bytes"] += moved
                st["seconds"] += time.monotonic() - t0
            return m
        return 0

    @staticmethod
    async def _copy(src, dst, token_ids: np.ndarray, transport: str) -> tuple[int, int]:
        """One export/import of ``token_ids``'s held prefix; ``(tokens, bytes)`` moved."""
        m, payload = await src.export_kv(token_ids, transport)
        if not m:
            return 0, 0
        try:
            reply = await dst.import_kv(payload)
        finally:
            if isinstance(payload, dict):  # a Mooncake handle: the source may drop its pin now
                try:
                    await src.release_kv(payload["pin"])
                except Exception as exc:  # the pin expires on its own
                    if isinstance(exc, asyncio.CancelledError):
                        raise
        return m, int(reply.get("bytes", len(payload) if isinstance(payload, bytes) else 0))

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        execution_id: str,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        attempts: list[Attempt] | None = None,
    ) -> AsyncIterator[EngineChunk]:
        """Stream one generation for ``execution_id``, retrying transparently (module docstring).

        Yields :class:`~gyre.proxy.engines.EngineChunk` deltas; the last has ``finish_reason``
        ``"stop"`` or ``"length"`` (never ``"abort"``). ``attempts`` (if given) receives one
        :class:`Attempt` per engine request.

        Raises:
            RouteError: the execution has no route.
            GenerationFailed: the retry budget ran out.
            EngineRejected: the engine refused the request (outcome ``"rejected"``; no retry).
        """
        base = rid or f"gyre-{next(self._ids)}"
        tries = attempts if attempts is not None else []
        first = len(tries)
        try:
            ids = np.asarray(input_ids, dtype=np.int32)
            async for ch in self._attempts(execution_id, ids, sampling_params, base, tries):
                yield ch
        finally:  # nothing of this generation needs any engine any more
            for att in tries[first:]:
                if (ev := self._handoff.pop(att.rid, None)) is not None:
                    ev.set()

    async def _attempts(self, execution_id: str, prompt: np.ndarray, sampling_params: dict[str, Any], base: str,
                        tries: list[Attempt]) -> AsyncIterator[EngineChunk]:
        produced: list[int] = []
        max_new = int(sampling_params.get("max_new_tokens", 1 << 30))
        min_new = int(sampling_params.get("min_new_tokens") or 0)
        deadline = time.monotonic() + self.retry_timeout_s
        backoff = self.retry_backoff_s
        last_engine: str | None = None
        k = 0
        while True:
            engine_id = self.route(execution_id)
            engine = self.engines.get(engine_id)
            rerouted = last_engine is not None and engine_id != last_engine
            if k > 0:
                if self.on_retry is not None:
                    self.on_retry(execution_id, tries[-1], rerouted)
                if not rerouted:
                    await self._wait_retry(execution_id, backoff, deadline)
                    backoff = min(backoff * 2, self.retry_backoff_max_s)
                    engine_id = self.route(execution_id)
                    engine = self.engines.get(engine_id)
                else:
                    backoff = self.retry_backoff_s
            migrated = 0
            if self.kv_migration and engine is not None:
                if k > 0 and rerouted:
                    migrated = await self._migrate(last_engine, engine_id, _join(prompt, produced))
                elif k == 0 and (held := self._held.get(execution_id)) is not None and held[0] != engine_id:
                    migrated = await self._migrate(held[0], engine_id, prompt)  # the route moved since the last call
            if k > 0 and (prev := self._handoff.pop(tries[-1].rid, None)) is not None:
                prev.set()  # the source is no longer needed by this generation
            if time.monotonic() > deadline and k > 0:
                raise GenerationFailed(f"execution {execution_id}: no engine finished the request "
                                       f"within {self.retry_timeout_s:.0f} s ({k} attempts)")
            sub_rid = base if k == 0 else f"{base}.r{k}"
            att = Attempt(engine_id, sub_rid, migrated_tokens=migrated)
            tries.append(att)
            if self.kv_migration:  # abort_engine waits on it until this attempt's retry copied its KV
                self._handoff[sub_rid] = asyncio.Event()
            last_engine = engine_id
            k += 1
            if engine is None:
                att.outcome = "error"
                continue
            params = _attempt_params(sampling_params, len(produced), max_new, min_new)
            async with contextlib.aclosing(self._stream_attempt(engine, att, execution_id, prompt, produced,
                                                                params)) as chunks:
                async for ch in chunks:  # closed with this generation (its bookkeeping runs at once)
                    yield ch
            if att.outcome in ("stop", "length"):
                return
            if len(produced) >= max_new:  # aborted exactly at the cap: a normal length finish
                yield EngineChunk([], [], "length", att.weight_version)
                return

    async def _stream_attempt(self, engine: Engine, att: Attempt, execution_id: str, prompt: np.ndarray,
                              produced: list[int], params: dict[str, Any]) -> AsyncIterator[EngineChunk]:
        """One attempt on ``engine``: its chunks, the tokens appended to ``produced``; ends with the
        attempt's outcome in ``att.outcome`` (its finish reason, ``"abort"``, or ``"error"`` when
        the engine failed or the stream ended without a finish). An engine's refusal is raised."""
        engine_id, sub_rid = att.engine_id, att.rid
        inflight = self._inflight.setdefault(engine_id, {})
        inflight[sub_rid] = execution_id
        finish: str | None = None
        try:
            async for ch in engine.generate_stream(_join(prompt, produced), params, sub_rid):
                if ch.weight_version is not None:
                    att.weight_version = ch.weight_version
                if ch.output_ids:
                    produced.extend(ch.output_ids)
                    att.tokens += len(ch.output_ids)
                if ch.finish_reason == "abort":
                    finish = "abort"
                    if ch.output_ids:
                        yield EngineChunk(list(ch.output_ids), list(ch.logprobs), None, ch.weight_version)
                    break
                yield ch
                if ch.finish_reason is not None:
                    finish = ch.finish_reason
                    break
        except EngineRejected:
            att.outcome = "rejected"
            raise
        except EngineUnavailable as exc:
            logger.warning("engine %s failed request %s: %s", engine_id, sub_rid, exc)
            finish = "error"
        finally:
            inflight.pop(sub_rid, None)
            if self.kv_migration:
                self._held[execution_id] = (engine_id, _join(prompt, produced))
        att.outcome = finish or "error"

    async def _wait_retry(self, execution_id: str, delay: float, deadline: float) -> None:
        """Sleep ``delay`` seconds, or less if the execution's route changes meanwhile."""
        ev = self._route_changed.setdefault(execution_id, asyncio.Event())
        ev.clear()
        timeout = max(0.0, min(delay, deadline - time.monotonic()))
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass
