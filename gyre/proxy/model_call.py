"""One model call in the proxy, and the answer a client retry of it receives.

:class:`ModelCall` runs one generation (the router's chunks through the output parser into the
API's response builder) and hands its answer to whoever consumes it: the request that started
it, and any *client retry* that joined it (:mod:`gyre.proxy.retries` finds them). A streamed
call serialises each SSE event once, to the bytes that go on the wire, and keeps them in order
(``history``) so that a consumer attaching late gets all of them; the request that started the
call reads a queue. A non-streamed call keeps no events: its body is built once at the end.

Once its record is committed the call keeps only its answer, compactly: the SSE bytes joined into
one and zlib-compressed (level 1; the per-event JSON framing is most of a stream's bytes) with the
closing events' bytes, or the non-streamed body's bytes, plus the output message when the record
was committed undelivered (:meth:`ModelCall.nbytes` counts them). The parser, the builder, the
per-event history, the request and the call's events are released.

Delivery: a call is *delivered* once a consumer received the whole answer; it is *undelivered*
once the generation ended with nobody attached (the client left and no retry joined before the
end), or when nobody took the answer within ``delivery_timeout_s``. The record is committed once,
with the outcome known then. A consumer that receives the whole answer later (a client retry
after an undelivered commit) marks the record delivered (:meth:`ProxyServer.mark_delivered
<gyre.proxy.server.ProxyServer.mark_delivered>`): a logical call has exactly one record, and it
is delivered as soon as any consumer got the answer whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from typing import TYPE_CHECKING, Any

from sse_starlette import ServerSentEvent
from starlette.responses import JSONResponse

from gyre.proxy.api.common import ResponseBuilder, Sse
from gyre.proxy.engines import EngineRejected
from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ChatRequest, Message
from gyre.proxy.parse import OutputParser
from gyre.proxy.router import Attempt, GenerationFailed, RouteError

if TYPE_CHECKING:  # pragma: no cover
    from gyre.proxy.admin import Execution
    from gyre.proxy.server import ProxyServer

__all__ = ["ModelCall", "END", "CALL_OVERHEAD_BYTES"]

logger = logging.getLogger(__name__)

#: Queue sentinel: the generation ended.
END = object()

#: Bytes a committed call holds besides its answer (the object, its futures and events, its
#: entries in the recent-call maps), counted by :meth:`ModelCall.nbytes`; tests/proxy check it
#: against tracemalloc.
CALL_OVERHEAD_BYTES = 2048


class _Set:
    """Stands for an :class:`asyncio.Event` that is set, once a committed call drops its own."""

    __slots__ = ()

    @staticmethod
    def is_set() -> bool:
        return True

    @staticmethod
    async def wait() -> bool:
        return True


_SET = _Set()


def sse_bytes(item: Sse) -> bytes:
    """One SSE event as the bytes sent on the wire."""
    name, data = item
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(payload, event=name, sep="\n").encode()


def _message_nbytes(m: Message) -> int:
    n = len(m.content.encode()) + len((m.reasoning or "").encode())
    n += sum(len(tc.arguments.encode()) + len(tc.name) + len(tc.id or "") for tc in m.tool_calls)
    return n + sum(len(i) for i in m.item_ids)


class ModelCall:
    """One model call: generation task, parser, response builder, answer and consumers."""

    __slots__ = ("server", "ex", "req", "prep", "role", "meta", "sampling", "builder", "parser", "stream", "queue",
                 "history", "_grew", "out_ids", "logprobs", "finish", "attempts", "error", "delivered", "t0",
                 "t_first", "rid", "closing", "answer", "output_message", "recorded", "call_index", "_commit_task",
                 "committed", "_mark_task", "engine_answered", "done", "attached", "joins", "digest", "_nbytes",
                 "__weakref__")

    def __init__(self, server: "ProxyServer", ex: "Execution", req: ChatRequest, prep, role: str,
                 meta: dict[str, Any], sampling: dict[str, Any], builder: ResponseBuilder) -> None:
        self.server, self.ex, self.req, self.prep, self.role, self.meta = server, ex, req, prep, role, meta
        self.sampling = sampling
        self.builder: ResponseBuilder | None = builder
        r = server.renderer
        self.parser: OutputParser | None = OutputParser(r.decode, server.stop_ids, req.tool_kinds,
                                                        starts_in_reasoning=prep.starts_in_reasoning)
        self.stream = bool(req.stream)
        #: the starting request's SSE bytes, then END (streamed calls)
        self.queue: asyncio.Queue | None = asyncio.Queue() if self.stream else None
        #: every SSE event's bytes so far (streamed calls, until committed)
        self.history: list[bytes] | None = [] if self.stream else None
        self._grew = asyncio.Event()
        self.out_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish = "stop"
        self.attempts: list[Attempt] = []
        self.error: ProxyError | None = None
        #: the delivery outcome the record is committed with
        self.delivered: asyncio.Future = asyncio.get_running_loop().create_future()
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.rid = f"{ex.execution_id}-{server.next_rid()}"
        #: the closing events' bytes (streamed), known when the generation ends
        self.closing = b""
        #: the answer's bytes: all SSE events but the closing ones, or the non-streamed body
        self.answer: bytes | None = None
        #: the output as returned (kept after the commit only while the record is undelivered)
        self.output_message: Message | None = None
        #: whether the record says delivered (None: not recorded, or its commit failed)
        self.recorded: bool | None = None
        self.call_index: int | None = None
        self._commit_task: asyncio.Future | None = None
        self.committed = False  #: the commit (and the compaction) finished
        self._mark_task: asyncio.Future | None = None
        #: set at the engine's first output chunk, or when generation ends (output or error)
        self.engine_answered = asyncio.Event()
        #: set when the generation ended (output or error)
        self.done = asyncio.Event()
        #: consumers waiting for or receiving the answer (the starting request is the first)
        self.attached = 1
        #: client retries that joined this call
        self.joins = 0
        #: the request digest the call is kept under among its execution's recent calls
        self.digest = b""
        self._nbytes = 0

    def _put(self, events: list[Sse]) -> None:
        if self.history is None or not events:  # non-streamed: the builder keeps what the body needs
            return
        for e in events:
            b = sse_bytes(e)
            self.queue.put_nowait(b)
            self.history.append(b)
        if self.joins:  # wake joined retries (none on almost every call)
            self._grew.set()
            self._grew = asyncio.Event()

    async def run(self) -> None:
        self.ex.uncommitted += 1
        try:
            await self._run()
        finally:
            self.ex.uncommitted -= 1
            self.server.release_if_finished(self.ex)

    async def _run(self) -> None:
        ex, server = self.ex, self.server
        ex.counters.inflight += 1
        try:
            self._put(self.builder.start())
            async for ch in server.router.generate(ex.execution_id, self.prep.input_ids, self.sampling,
                                                   rid=self.rid, attempts=self.attempts):
                self.engine_answered.set()
                if ch.output_ids:
                    if self.t_first is None:
                        self.t_first = time.perf_counter()
                    self.out_ids.extend(ch.output_ids)
                    self.logprobs.extend(ch.logprobs)
                    for ev in self.parser.feed(ch.output_ids):
                        self._put(self.builder.on_event(ev))
                if ch.finish_reason is not None:
                    self.finish = ch.finish_reason
            for ev in self.parser.finish(self.finish):
                self._put(self.builder.on_event(ev))
            # closing events go out only after the record is committed (see sse())
            final = self.builder.finish(self.finish, len(self.out_ids))
            if self.stream:
                self.closing = b"".join(sse_bytes(e) for e in final)
        except EngineRejected as exc:  # the engine refused the request: the client's error, no retry
            self.error = ProxyError(exc.status, f"the engine refused the request: {exc.message}")
            ex.counters.rejected += 1
        except (GenerationFailed, RouteError) as exc:
            status = 529 if self.req.api == "anthropic" else 503
            self.error = ProxyError(status, f"generation failed: {exc}")
            ex.counters.failed += 1
        except Exception as exc:  # never leave the stream hanging
            logger.exception("model call %s failed", self.rid)
            self.error = ProxyError(500, f"internal error: {type(exc).__name__}")
            ex.counters.failed += 1
        finally:
            ex.counters.inflight -= 1
            if self.queue is not None:
                self.queue.put_nowait(END)
            self.engine_answered.set()
            self.done.set()
            self._grew.set()
            if self.attached == 0:  # the client left and no retry joined: nobody to deliver to
                self.set_delivered(False)
        if self.error is not None:  # a retry of a failed call generates again
            ex.recent_calls.drop(self)
            return
        try:
            delivered = await asyncio.wait_for(asyncio.shield(self.delivered), server.config.delivery_timeout_s)
        except asyncio.TimeoutError:
            delivered = False
        await self.commit_once(bool(delivered))

    async def commit_once(self, delivered: bool) -> None:
        """Record the call (once; later callers wait for the first): store, then tree, then the
        restoration cache; then keep only the answer (:meth:`_compact`). The commit is not
        cancelled with its caller."""
        if self.committed:
            return
        if self._commit_task is None:
            self._commit_task = asyncio.ensure_future(self._commit(delivered))
        await asyncio.shield(self._commit_task)

    async def _commit(self, delivered: bool) -> None:
        if self.answer is None and not self.stream:
            self.body()
        await self.server.commit(self, delivered)
        self._compact()

    def _compact(self) -> None:
        """Release everything but the answer; count what is kept for retries."""
        if self.stream:
            self.answer = zlib.compress(b"".join(self.history), 1)
        if self.recorded is False:
            self.output_message = self.builder.output_message()
        self.history = self.queue = None  # a consumer still reading keeps its own reference
        self.builder = self.parser = self.prep = None
        self.out_ids = self.logprobs = self.attempts = self.meta = self.sampling = self.req = None
        self._grew, self.engine_answered, self.done = None, _SET, _SET  # all were set when generation ended
        self._commit_task, self.committed = None, True
        self._nbytes = len(self.answer) + len(self.closing) + CALL_OVERHEAD_BYTES
        if self.output_message is not None:
            self._nbytes += _message_nbytes(self.output_message)
        self.ex.recent_calls.keep(self)

    def nbytes(self) -> int:
        """Bytes the call holds for retries once committed (0 before): its answer, the
        undelivered output message, and ``CALL_OVERHEAD_BYTES``."""
        return self._nbytes

    def body(self) -> bytes:
        """The non-streamed answer: the response body's bytes (built once)."""
        if self.answer is None:
            self.answer = JSONResponse(self.builder.body()).body
        return self.answer

    async def deliver(self) -> None:
        """A consumer received the whole answer (the closing events of a stream excepted): the
        record is committed delivered, or, committed undelivered already, marked delivered."""
        self.set_delivered(True)
        await self.commit_once(True)
        if self.recorded is False:
            if self._mark_task is None:
                self._mark_task = asyncio.ensure_future(self.server.mark_delivered(self))
            await asyncio.shield(self._mark_task)

    def set_delivered(self, value: bool) -> None:
        if not self.delivered.done():
            self.delivered.set_result(value)

    def settled(self) -> bool | None:
        """Whether the answer reached a consumer whole: the record's state once committed, the
        outcome it will be committed with before; ``None`` while not known yet."""
        if self.recorded is not None:
            return self.recorded
        return self.delivered.result() if self.delivered.done() else None

    def detach(self) -> None:
        """A consumer left without the whole answer; with nobody left after the generation
        ended, the call is undelivered."""
        self.attached -= 1
        if self.attached <= 0 and self.done.is_set():
            self.set_delivered(False)

    def join(self) -> None:
        """A client retry attaches to this call."""
        self.attached += 1
        self.joins += 1

    async def follow(self):
        """Every event so far, then each new one until the generation ends (a joined retry)."""
        history = self.history
        i = 0
        while True:
            while i < len(history):
                yield history[i]
                i += 1
            if self.done.is_set():
                return
            await self._grew.wait()

    async def sse(self, joined: bool = False):
        """The SSE byte stream (an async generator for ``EventSourceResponse``).

        Every event but the closing ones is sent first; the record is then committed as
        delivered -- the client is still connected and has everything but the closing events --
        (or marked delivered, :meth:`deliver`) and only then do the closing events go out, so a
        harness that reacts to the end of a stream always finds its previous call recorded. A
        client that disconnects earlier detaches (:meth:`detach`). ``joined``: a client retry's
        stream: the kept answer, or the events so far and then each new one.
        """
        whole = False
        queue = self.queue
        try:
            if joined or queue is None:  # a retry, or a start after the call was committed
                if self.answer is not None:  # committed: one write
                    yield zlib.decompress(self.answer)
                else:
                    async for item in self.follow():
                        yield item
            else:
                while True:
                    item = await queue.get()
                    if item is END:
                        break
                    yield item
            if self.error is not None:
                yield sse_bytes(self.builder.error_event(self.error))
                return
            await self.deliver()
            whole = True
            if self.closing:
                yield self.closing
        finally:
            if not whole:
                self.detach()
