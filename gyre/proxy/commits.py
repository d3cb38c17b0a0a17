"""Committing model calls: each finished call's record, stored and then inserted into its tree.

:class:`CallCommitter` builds a call's :class:`~gyre.trajectory.records.RequestRecord` (attempts,
weight version, timings, metadata), appends it to the record store on the
:class:`~gyre.proxy.recorder.RecordSink`'s writer thread (fsync off the event loop), then inserts
it into the execution's tree and restoration cache, and counts it. A record committed undelivered
whose answer a client retry later receives is marked delivered the same way (store, then tree).
Both hold the execution's ``commit_lock``: a commit awaits the store between building the record
and inserting it, so without the lock two calls of one execution could reach the tree in another
order than the store.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from gyre.proxy.recorder import RecordSink

if TYPE_CHECKING:  # pragma: no cover
    from gyre.proxy.admin import Execution
    from gyre.proxy.model_call import ModelCall

__all__ = ["CallCommitter", "record_metadata", "record_version"]

logger = logging.getLogger(__name__)


def record_version(call: "ModelCall") -> int | None:
    """The weight version a call's record carries: the oldest among the attempts that produced
    tokens, else the last one an attempt reported (``None``: none did)."""
    versions = [a.weight_version for a in call.attempts if a.weight_version is not None and a.tokens > 0]
    if versions:
        return min(versions)
    return next((a.weight_version for a in reversed(call.attempts) if a.weight_version is not None), None)


def record_metadata(call: "ModelCall") -> dict[str, Any]:
    """The record metadata of a finished call: the call's own (role, harness, caps) plus its rid,
    model, attempts (one segment each), retries, reused tokens, malformed tool calls, stream."""
    segs = [{"engine_id": a.engine_id, "rid": a.rid, "tokens": a.tokens, "outcome": a.outcome,
             "weight_version": a.weight_version, **({"migrated_tokens": a.migrated_tokens}
                                                    if a.migrated_tokens else {})} for a in call.attempts]
    meta = dict(call.meta)
    meta.update({"rid": call.rid, "model": call.req.model, "attempts": segs,
                 "retries": max(0, len(call.attempts) - 1), "reused_tokens": call.prep.reused_tokens,
                 "malformed_tool_calls": call.parser.result().malformed, "stream": call.req.stream})
    return meta


def _count(ex: "Execution", call: "ModelCall", delivered: bool) -> None:
    c = ex.counters
    c.calls += 1
    c.delivered += int(delivered)
    c.undelivered += int(not delivered)
    c.input_tokens += int(call.prep.input_ids.shape[0])
    c.output_tokens += len(call.out_ids)
    c.reused_tokens += call.prep.reused_tokens
    c.rendered_tokens += call.prep.rendered_tokens
    c.restored_tool_calls += call.prep.restored_calls
    c.malformed_tool_calls += call.parser.result().malformed


class CallCommitter:
    """Commits the calls of every execution of one proxy.

    Args:
        sink: the record store's writer (``None``: records live only in the in-memory trees).
        policy_version: the version a record carries when no engine reported one.

    Attributes:
        stage_times: per-call CPU stage times (seconds): parse_s, normalize_s, match_s, render_s,
            record_s, with input_tokens and rendered_tokens (the last 100k; ``GET /gyre/stats``).
        stages_recorded: stage-time entries ever appended.
    """

    def __init__(self, sink: RecordSink | None, policy_version: int = 0) -> None:
        self.sink = sink
        self.policy_version = policy_version
        self.stage_times: collections.deque[dict[str, float]] = collections.deque(maxlen=100_000)
        self.stages_recorded = 0

    async def commit(self, call: "ModelCall", delivered: bool) -> bool:
        """Build the record, append it to the store, then insert it into the tree; set
        ``call.recorded`` and ``call.call_index``, count the call and return True. A failure is
        logged and leaves the call unrecorded (``call.recorded`` stays ``None``): False."""
        ex = call.ex
        version = record_version(call)
        meta = record_metadata(call)
        t_end = time.perf_counter()
        timings = {"total_s": t_end - call.t0, **call.prep.timings}
        if call.t_first is not None:
            timings["first_token_s"] = call.t_first - call.t0
        out_msg = call.builder.output_message() if delivered else None
        async with ex.commit_lock:
            t_rec = time.perf_counter()
            session = ex.session
            try:
                rec = session.build_record(
                    call.prep, output_ids=call.out_ids, output_logprobs=call.logprobs, finish_reason=call.finish,
                    role=call.role, delivered=delivered,
                    policy_version=version if version is not None else self.policy_version,
                    engine_id=call.attempts[-1].engine_id if call.attempts else "", timings=timings, metadata=meta)
                if self.sink is not None:
                    await asyncio.wrap_future(self.sink.submit(rec))
                session.insert(call.prep, rec, out_msg)
            except Exception:
                logger.exception("could not record call %s of %s", call.rid, ex.execution_id)
                return False
            call.recorded, call.call_index = delivered, rec.call_index
        st = dict(call.prep.timings)
        st["record_s"] = time.perf_counter() - t_rec
        st["input_tokens"] = int(call.prep.input_ids.shape[0])
        st["rendered_tokens"] = call.prep.rendered_tokens
        self.stage_times.append(st)
        self.stages_recorded += 1
        _count(ex, call, delivered)
        return True

    async def mark_delivered(self, call: "ModelCall") -> None:
        """The answer of ``call``, committed undelivered, reached a client whole (a retry got
        it): the delivery mark is stored, then applied to the tree and the restoration cache
        (:meth:`~gyre.proxy.tito.TitoSession.mark_delivered`)."""
        ex = call.ex
        async with ex.commit_lock:
            if call.recorded is not False or ex.session.tree is None:
                return
            try:
                if self.sink is not None:
                    await asyncio.wrap_future(self.sink.mark_delivered(ex.execution_id, call.call_index))
                ex.session.mark_delivered(call.call_index, call.output_message)
            except Exception:
                logger.exception("could not mark call %s of %s delivered", call.rid, ex.execution_id)
                return
            call.recorded, call.output_message = True, None
            ex.counters.delivered += 1
            ex.counters.undelivered -= 1

    def close_execution(self, execution_id: str) -> Any:
        """Close the execution's record file; a future done once closed (``None``: no store)."""
        return self.sink.close_execution(execution_id) if self.sink is not None else None

    def close(self) -> None:
        """Close the store's open files (the writer thread ends)."""
        if self.sink is not None:
            self.sink.close()
