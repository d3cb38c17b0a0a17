"""``POST /generate`` of the embedded engine: one JSON answer, or SSE ``data: {...}`` chunks then
``data: [DONE]``.

Streams are incremental by default (``incremental_streaming_output``), cumulative otherwise; text
that could still become a stop string, or an incomplete UTF-8 character, is held back until it
cannot.  A client that goes away has its requests aborted.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from gyre.rollout.api.sglang_api import (
    IncrementalDetokenizer,
    SeqOutput,
    SeqSpec,
    build_meta_info,
    final_text,
    logprob_triples,
    parse_generate,
    top_logprob_triples,
)
from gyre.rollout.embedded.routes.common import EngineRoutes, error, read_json


class _Acc:
    """Accumulated output of one sequence on the HTTP side."""

    __slots__ = ("spec", "ids", "logprobs", "tops", "last", "sent_text", "sent_ids", "detok")

    def __init__(self, spec: SeqSpec, decode: Callable[[list[int], bool], str] | None = None):
        self.spec = spec
        self.detok = IncrementalDetokenizer(decode, spec.params.skip_special_tokens) if decode else None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list = []
        self.last: SeqOutput | None = None
        self.sent_text = ""
        self.sent_ids = 0

    def absorb(self, out: SeqOutput) -> None:
        self.ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs:
            self.tops.extend(out.new_top_logprobs)
        self.last = out

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished


class GenerateRoutes(EngineRoutes):
    """``/generate`` and the answer bodies it builds."""

    def meta_for(self, acc: _Acc, ids: list[int], lps: list[float], tops: list, finish) -> dict[str, Any]:
        engine = self.engine
        out, spec = acc.last, acc.spec
        tt = engine.token_text if spec.return_text_in_logprobs else None
        return build_meta_info(
            rid=spec.rid, finish_reason=finish, prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
            weight_version=out.weight_version,
            output_token_logprobs=logprob_triples(lps, ids, tt) if spec.return_logprob else None,
            output_top_logprobs=top_logprob_triples(tops, tt) if spec.top_logprobs_num and spec.return_logprob
            else None,
            e2e_latency=out.e2e_latency)

    def final_dict(self, acc: _Acc) -> dict[str, Any]:
        engine = self.engine
        finish = acc.last.finish_reason
        text = final_text(acc.ids, finish, acc.spec.params, engine.decode if engine.tokenizer else None)
        return {"text": text, "output_ids": list(acc.ids),
                "meta_info": self.meta_for(acc, acc.ids, acc.logprobs, acc.tops, finish)}

    def visible_text(self, acc: _Acc) -> str:
        """Text so far, holding back what may still turn into a stop string or a partial char."""
        engine = self.engine
        if acc.finished:
            return final_text(acc.ids, acc.last.finish_reason, acc.spec.params,
                              engine.decode if engine.tokenizer else None)
        if acc.detok is None:
            return ""
        text = acc.detok.text(acc.ids)
        if acc.spec.params.stop:
            hold = max(len(s) for s in acc.spec.params.stop) - 1
            text = text[: max(len(acc.sent_text), len(text) - hold)] if hold else text
        return text

    def chunk_dict(self, acc: _Acc) -> dict[str, Any]:
        text = self.visible_text(acc)
        finish = acc.last.finish_reason
        if self.cfg.incremental_streaming_output:
            k = acc.sent_ids
            start = len(acc.sent_text) if text.startswith(acc.sent_text) else 0
            body = {"text": text[start:], "output_ids": acc.ids[k:],
                    "meta_info": self.meta_for(acc, acc.ids[k:], acc.logprobs[k:], acc.tops[k:], finish)}
        else:
            body = {"text": text, "output_ids": list(acc.ids),
                    "meta_info": self.meta_for(acc, acc.ids, acc.logprobs, acc.tops, finish)}
        body["index"] = acc.spec.index
        acc.sent_text, acc.sent_ids = text, len(acc.ids)
        return body

    def abort_later(self, rids: list[str], why: str) -> None:
        for rid in rids:
            self.engine.call(lambda core, r=rid: core.abort(r, message=why))

    async def generate(self, request: Request):
        engine = self.engine
        body = await read_json(request)
        req = parse_generate(body, vocab_size=engine.runner.vocab_size, context_len=engine.runner.context_len,
                             tokenize=engine.tokenize if engine.tokenizer is not None else None)
        specs = req.expand()
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(out: SeqOutput) -> None:
            loop.call_soon_threadsafe(q.put_nowait, out)

        await self.run(lambda core: core.add(specs, sink))
        accs = {s.index: _Acc(s, engine.decode if (req.stream and engine.tokenizer is not None) else None)
                for s in specs}
        if req.stream:
            return StreamingResponse(self._events(accs, q), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        pending = set(accs)
        while pending:
            try:
                out = await asyncio.wait_for(q.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.abort_later([accs[i].spec.rid for i in pending], "client disconnected")
                    return error("client disconnected", 499)
                continue
            accs[out.index].absorb(out)
            if out.finished:
                pending.discard(out.index)
        results = [self.final_dict(accs[i]) for i in sorted(accs)]
        return results[0] if req.single else results

    async def _events(self, accs: dict[int, _Acc], q: asyncio.Queue):
        """The SSE lines of a streamed ``/generate``; sequences not finished when the stream is
        closed early are aborted."""
        pending = set(accs)
        try:
            while pending:
                out = await q.get()
                acc = accs[out.index]
                acc.absorb(out)
                if out.finished:
                    pending.discard(out.index)
                yield f"data: {json.dumps(self.chunk_dict(acc))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if pending:
                self.abort_later([accs[i].spec.rid for i in pending], "client disconnected")
