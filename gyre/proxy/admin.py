"""Executions and the admin side of the proxy: everything that is not a model API.

An execution is one run of a harness on one task. The main job (or ``tools/serve_rollout.py``)
registers it, hands its API key to the harness, and closes it when the harness is done.
:class:`ExecutionAdmin` holds the registry and serves both the Python methods and the
``/gyre/*`` HTTP routes (registration, close, routes, inspection); ``ProxyConfig.admin_token``,
when set, is required as ``Authorization: Bearer`` on ``/gyre/*``. The Python methods are safe
to call from any thread: they run on the server's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request

from gyre.proxy.commits import CallCommitter
from gyre.proxy.request_body import read_json
from gyre.proxy.engines import Engine
from gyre.proxy.errors import ProxyError
from gyre.proxy.gc_policy import CollectorPolicy, HeapTrimmer
from gyre.proxy.retries import RecentCalls, RetryMemory
from gyre.proxy.render import ChatRenderer
from gyre.proxy.router import RouteError, Router
from gyre.proxy.tito import TitoSession
from gyre.trajectory.records import EXECUTION_ID_RE

__all__ = ["Execution", "ExecutionCounters", "ExecutionAdmin"]


@dataclass(slots=True)
class ExecutionCounters:
    """Per-execution counters for the scheduler and metrics (cumulative; tokens, calls)."""

    calls: int = 0
    delivered: int = 0
    undelivered: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    reused_tokens: int = 0
    rendered_tokens: int = 0
    retries: int = 0
    reroutes: int = 0
    failed: int = 0
    rejected: int = 0
    restored_tool_calls: int = 0
    malformed_tool_calls: int = 0
    inflight: int = 0
    joined_retries: int = 0


@dataclass
class Execution:
    """A registered execution: its key, harness, TITO session and counters."""

    execution_id: str
    api_key: str
    session: TitoSession
    task_id: str | None = None
    harness: str | None = None
    role_rules: Any = None
    closed: bool = False
    counters: ExecutionCounters = field(default_factory=ExecutionCounters)
    #: the last few model calls, which a client retry may join (:mod:`gyre.proxy.retries`)
    recent_calls: RecentCalls = field(default_factory=RecentCalls)
    created: float = field(default_factory=time.time)
    file_closed: Any = None  # a future: the record file closed, once the execution is finalised
    uncommitted: int = 0  # model calls started and not yet recorded
    commit_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ExecutionAdmin:
    """The execution registry and admin API of :class:`~gyre.proxy.server.ProxyServer` (a base
    class of it). The server provides the attributes below.

    * :meth:`register_execution` / ``POST /gyre/executions`` ``{"task_id", "harness",
      "execution_id"?, "engine_id"?, "api_key"?}`` -> ``{"execution_id", "api_key",
      "engine_id"}``: a TITO session, a key and a route to an engine (least loaded by default);
    * :meth:`close_execution` / ``POST /gyre/executions/{id}/close``: the key stops working
      (401), calls in flight still finish and are recorded, then the route and the record file
      are closed;
    * routes: :meth:`set_route` / ``POST /gyre/routes``, :meth:`reroute_engine`,
      :meth:`abort_engine`;
    * inspection: :meth:`counters`, :meth:`tree`, ``GET /gyre/executions[/{id}]``,
      ``GET /gyre/stats[?since=N]`` (per-call CPU stage times, those recorded at index N on;
      ``stages_recorded``: how many ever; ``process_cpu_s``: the process's CPU seconds, all
      threads, at nanosecond resolution; ``retry_memory``: the bytes and calls kept for client
      retries, :meth:`~gyre.proxy.retries.RetryMemory.snapshot`), ``GET /health``."""

    router: Router
    renderer: ChatRenderer
    config: Any  # ProxyConfig
    committer: CallCommitter  # records the calls; keeps the per-call stage times
    retry_memory: RetryMemory  # the answers kept for client retries, all executions
    #: role rules of registrations that name none (a proxy worker serving one run's harness)
    default_role_rules: Any = None

    def __init__(self) -> None:
        #: registered executions by id (closed ones included)
        self.executions: dict[str, Execution] = {}
        #: the event loop that serves the app, once serving started (``None`` before)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._by_key: dict[str, Execution] = {}
        self._rr = 0

    def execution_for_key(self, key: str) -> Execution | None:
        """The execution whose API key is ``key`` while it is open (closing drops the key)."""
        return self._by_key.get(key)

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run ``fn`` on the server loop (directly when not serving or already on it)."""
        loop = self.loop
        if loop is None or not loop.is_running():
            return fn(*args, **kw)
        try:
            if asyncio.get_running_loop() is loop:
                return fn(*args, **kw)
        except RuntimeError:
            pass

        async def _run():
            return fn(*args, **kw)

        return asyncio.run_coroutine_threadsafe(_run(), loop).result()

    def url_for(self, execution_id: str) -> str:
        """The URL the harness of ``execution_id`` calls: this server's."""
        return self.url

    def add_engine(self, engine: Engine) -> None:
        """Register an engine with the router."""
        self._call(self.router.add_engine, engine)

    def register_execution(
        self,
        execution_id: str | None = None,
        *,
        task_id: str | None = None,
        harness: str | None = None,
        engine_id: str | None = None,
        api_key: str | None = None,
        role_rules: Any = None,
    ) -> Execution:
        """Register an execution and pin it to ``engine_id`` (default: the least loaded engine).

        ``harness`` (``"claude-code"``, ``"codex"``, ...) selects the built-in role rules
        (:mod:`gyre.proxy.roles`); ``role_rules`` -- any object with ``classify(headers, body) ->
        role``, e.g. a harness adapter's ``gyre.harness.roles.RoleRules`` -- replaces them; a call
        with ``x-gyre-role: evaluator`` (Gyre's judge) is role ``evaluator`` either way. Returns
        the :class:`Execution`; give its ``api_key`` to the harness.

        Raises:
            ValueError: bad or duplicate execution id, or no engine to route to.
        """
        return self._call(self._register, execution_id, task_id, harness, engine_id, api_key, role_rules)

    def _register(self, execution_id, task_id, harness, engine_id, api_key, role_rules=None) -> Execution:
        eid = execution_id or f"exec-{secrets.token_hex(6)}"
        if not EXECUTION_ID_RE.match(eid):
            raise ValueError(f"bad execution id {eid!r}")
        if eid in self.executions:
            raise ValueError(f"execution {eid!r} already registered")
        if engine_id is None:
            engine_id = self._least_loaded()
        if engine_id not in self.router.engines:
            raise ValueError(f"unknown engine {engine_id!r}")
        key = api_key or f"gyre-{secrets.token_urlsafe(24)}"
        if key in self._by_key:
            raise ValueError("api key already in use")
        session = TitoSession(eid, self.renderer, restore_reasoning=self.config.restore_reasoning)
        ex = Execution(eid, key, session, task_id=task_id, harness=harness,
                       role_rules=role_rules if role_rules is not None else self.default_role_rules,
                       recent_calls=RecentCalls(memory=self.retry_memory))
        self.executions[eid] = ex
        self._by_key[key] = ex
        self.router.set_route(eid, engine_id)
        return ex

    def _least_loaded(self) -> str:
        if not self.router.engines:
            raise ValueError("no engine registered")
        load: dict[str, int] = {e: 0 for e in self.router.engines}
        for eid, r in self.router.routes.items():
            ex = self.executions.get(eid)
            if r in load and ex is not None and not ex.closed:
                load[r] += 1
        best = min(load.values())
        cands = [e for e in load if load[e] == best]
        self._rr += 1
        return cands[self._rr % len(cands)]

    def close_execution(self, execution_id: str) -> ExecutionCounters:
        """Close an execution: its key stops working (401), its route is dropped, its record
        file is closed. Calls in flight still finish and are recorded.

        Raises:
            KeyError: unknown execution.
        """
        return self._call(self._close, execution_id)

    def _close(self, execution_id: str) -> ExecutionCounters:
        ex = self.executions[execution_id]
        if not ex.closed:
            ex.closed = True
            self._by_key.pop(ex.api_key, None)
            if ex.counters.inflight == 0:
                self._finalise(ex)
        return ex.counters

    def finalise_if_idle(self, ex: Execution) -> None:
        """Finalise ``ex`` (:meth:`_finalise`) when it is closed with no generation in flight; the
        server calls it after each committed call."""
        if ex.closed and ex.counters.inflight == 0:
            self._finalise(ex)

    def _finalise(self, ex: Execution) -> None:
        """Closed, no generation in flight: drop the route, close the record file."""
        self.router.drop_route(ex.execution_id)
        closed = self.committer.close_execution(ex.execution_id)
        if closed is not None:
            ex.file_closed = closed
        self.release_if_finished(ex)

    def release_if_finished(self, ex: Execution) -> None:
        """Closed, every call committed, the record file closed: when a store holds the records,
        release the session (message trie, tree) so that memory does not grow with every
        execution the proxy has served; :meth:`tree` then reads the record file. Called when a
        model call ends and when the execution is finalised; otherwise nothing happens."""
        if not ex.closed or ex.uncommitted or ex.file_closed is None or ex.session.tree is None:
            return
        ex.recent_calls.clear()
        ex.session.release()
        ex.session.tree = None

    def _tree_of(self, ex: Execution, timeout: float = 60.0):
        """The live tree, or the one read from the record file of a released execution."""
        if ex.session.tree is not None:
            return ex.session.tree
        from gyre.trajectory.store import load_tree

        ex.file_closed.result(timeout)
        return load_tree(self.store.path(ex.execution_id))

    def set_route(self, execution_id: str, engine_id: str) -> None:
        """Pin an execution to another engine (retries of in-flight requests follow it)."""
        self._call(self.router.set_route, execution_id, engine_id)

    def reroute_engine(self, source: str, destination: str) -> list[str]:
        """Move every execution routed to ``source`` to ``destination``; return their ids."""
        return self._call(self.router.reroute_engine, source, destination)

    def abort_engine(self, engine_id: str) -> int:
        """Abort the requests in flight on ``engine_id`` (they retry on their current routes)."""
        loop = self.loop
        if loop is not None and loop.is_running():
            try:
                if asyncio.get_running_loop() is loop:
                    raise RuntimeError("use `await server.router.abort_engine(...)` on the server loop")
            except RuntimeError as exc:
                if "server loop" in str(exc):
                    raise
            return asyncio.run_coroutine_threadsafe(self.router.abort_engine(engine_id), loop).result()
        return asyncio.run(self.router.abort_engine(engine_id))

    def counters(self, execution_id: str) -> dict[str, int]:
        """A copy of the execution's :class:`ExecutionCounters` as a dict."""
        return self._call(lambda: asdict(self.executions[execution_id].counters))

    def tree(self, execution_id: str):
        """The execution's :class:`~gyre.trajectory.tree.TrajectoryTree`: the live one (read it on
        the server loop or after the execution's calls finished), or, once the execution is
        closed with nothing in flight and a store holds its records, the one rebuilt from its
        record file (bit-identical)."""
        return self._tree_of(self.executions[execution_id])

    def _known(self, execution_id: str) -> Execution:
        """The registered execution ``execution_id``; 404 in the API's error shape otherwise."""
        e = self.executions.get(execution_id)
        if e is None:
            raise ProxyError(404, f"unknown execution {execution_id!r}")
        return e

    def _check_admin(self, request: Request) -> None:
        tok = self.config.admin_token
        if tok is None:
            return
        auth = request.headers.get("authorization", "")
        if not secrets.compare_digest(auth, f"Bearer {tok}"):
            raise ProxyError(401, "admin token required")

    def _register_body(self, body: Any) -> dict[str, Any]:
        """``POST /gyre/executions``: register the execution ``body`` describes; 400 for a bad
        body, 409 for an id or key already in use."""
        if not isinstance(body, dict):
            raise ProxyError(400, "body must be an object")
        for k in ("task_id", "harness", "execution_id", "engine_id", "api_key"):
            if body.get(k) is not None and not isinstance(body[k], str):
                raise ProxyError(400, f"{k} must be a string", param=k)
        try:
            ex = self._register(body.get("execution_id"), body.get("task_id"), body.get("harness"),
                                body.get("engine_id"), body.get("api_key"))
        except ValueError as exc:
            raise ProxyError(409 if "already" in str(exc) else 400, str(exc)) from None
        return {"execution_id": ex.execution_id, "api_key": ex.api_key,
                "engine_id": self.router.routes.get(ex.execution_id)}

    def _stats_body(self, since: str) -> dict[str, Any]:
        """``GET /gyre/stats?since=N``: the stage times recorded at index N on (those still
        kept), the collector's, heap's and retry memory's snapshots, the process's CPU time."""
        try:
            since = int(since)
        except ValueError:
            raise ProxyError(400, f"since must be an integer, got {since!r}") from None
        total, times = self.committer.stages_recorded, self.committer.stage_times
        new = min(len(times), max(0, total - since))  # entries recorded at index >= since, if still kept
        return {"stages_recorded": total, "stage_times": list(itertools.islice(times, len(times) - new, None)),
                "gc": CollectorPolicy.install().snapshot(), "heap": HeapTrimmer.install().snapshot(),
                "retry_memory": self.retry_memory.snapshot(),
                "process_cpu_s": time.process_time()}

    def add_admin_routes(self, app: FastAPI) -> None:
        """Register ``/health`` and the ``/gyre/*`` routes on ``app``."""

        @app.get("/health")
        async def health():
            return {"status": "ok", "executions": sum(not e.closed for e in self.executions.values()),
                    "engines": sorted(self.router.engines)}

        @app.post("/gyre/executions")
        async def register(request: Request):
            self._check_admin(request)
            return self._register_body(await read_json(request))

        @app.post("/gyre/executions/{execution_id}/close")
        async def close(request: Request, execution_id: str):
            self._check_admin(request)
            self._known(execution_id)
            return {"execution_id": execution_id, "counters": asdict(self._close(execution_id))}

        @app.get("/gyre/executions")
        async def list_executions(request: Request):
            self._check_admin(request)
            return {"executions": [{"execution_id": e.execution_id, "task_id": e.task_id, "harness": e.harness,
                                    "closed": e.closed, "engine_id": self.router.routes.get(e.execution_id),
                                    "counters": asdict(e.counters)} for e in self.executions.values()]}

        @app.get("/gyre/executions/{execution_id}")
        async def get_execution(request: Request, execution_id: str):
            self._check_admin(request)
            e = self._known(execution_id)
            return {"execution_id": e.execution_id, "task_id": e.task_id, "harness": e.harness, "closed": e.closed,
                    "engine_id": self.router.routes.get(e.execution_id), "counters": asdict(e.counters),
                    "records": e.counters.calls,
                    "leaves": len(e.session.tree.leaves()) if e.session.tree is not None else None}

        @app.get("/gyre/executions/{execution_id}/tree")
        async def tree_digest(request: Request, execution_id: str):
            self._check_admin(request)
            e = self._known(execution_id)
            tree = await asyncio.to_thread(self._tree_of, e)  # its records are all in its record file
            return {"execution_id": execution_id, "records": len(tree.records), "entries": tree.num_entries,
                    "digest": tree.digest()}

        @app.post("/gyre/engines/{engine_id}/abort")
        async def abort_engine(request: Request, engine_id: str):
            self._check_admin(request)
            return {"engine_id": engine_id, "aborted": await self.router.abort_engine(engine_id)}

        @app.get("/gyre/stats")
        async def stats(request: Request):
            self._check_admin(request)
            return self._stats_body(request.query_params.get("since", "0"))

        @app.post("/gyre/routes")
        async def set_route(request: Request):
            self._check_admin(request)
            body = await read_json(request)
            if not isinstance(body, dict) or not isinstance(body.get("execution_id"), str) \
                    or not isinstance(body.get("engine_id"), str):
                raise ProxyError(400, "body must be {\"execution_id\": str, \"engine_id\": str}")
            self._known(body["execution_id"])
            try:
                self.router.set_route(body["execution_id"], body["engine_id"])
            except RouteError as exc:
                raise ProxyError(400, str(exc)) from None
            return {"execution_id": body["execution_id"], "engine_id": body["engine_id"]}
