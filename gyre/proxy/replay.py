"""Replay of recorded harness request logs through the proxy's pure core (no HTTP, no model).

Each logged model request (a JSON line with ``method``, ``path``, ``headers``, ``body`` and
``response.message``) goes through what the server does -- normalisation and response shaping
(:mod:`~gyre.proxy.api`), role classification (:mod:`~gyre.proxy.roles`), restoration and TITO
assembly (:class:`~gyre.proxy.tito.TitoSession`), output parsing (:mod:`~gyre.proxy.parse`) --
with a *teacher-forced* engine that "samples" the logged reply rendered in the model's format.
Ids the proxy hands out are the logged ones (:class:`ReplayIds`), so the harness's next logged
request refers to them. Attempts that got no complete reply (``injected`` failures,
``count_tokens``, probes) are skipped. :func:`replay_records` / :func:`replay_trace` return a
:class:`ReplayResult` with checks independent of the proxy's own normaliser.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from gyre.proxy.api import MODEL_PATHS, make_builder, normalize, reply_message
from gyre.proxy.api.common import IdFactory
from gyre.proxy.parse import OutputParser
from gyre.proxy.render import ChatRenderer
from gyre.proxy.roles import classify_role, harness_metadata
from gyre.proxy.tito import TitoSession
from gyre.trajectory.records import RequestRecord

__all__ = ["ReplayIds", "ReplayResult", "replay_trace", "replay_records"]


class ReplayIds(IdFactory):
    """Hands out the ids of a logged reply, in order (falls back to random ids)."""

    def __init__(self, api: str, message: dict[str, Any]) -> None:
        self.api = api
        self.msg_id = message.get("id")
        kinds = ("call", "sig", "reasoning", "message", "function_call", "custom_tool_call")
        self.queues: dict[str, deque[str]] = {k: deque() for k in kinds}
        if api == "anthropic":
            for b in message.get("content") or []:
                if b.get("type") == "tool_use":
                    self.queues["call"].append(b["id"])
                elif b.get("type") == "thinking" and b.get("signature"):
                    self.queues["sig"].append(b["signature"])
        elif api == "chat":
            msg = (message.get("choices") or [{}])[0].get("message") or {}
            for tc in msg.get("tool_calls") or []:
                self.queues["call"].append(tc["id"])
        else:
            for it in message.get("output") or []:
                t = it.get("type")
                if t in ("function_call", "custom_tool_call"):
                    self.queues["call"].append(it.get("call_id", ""))
                if t in self.queues and it.get("id"):
                    self.queues[t].append(it["id"])

    def _pop(self, q: str) -> str | None:
        d = self.queues[q]
        return d.popleft() if d else None

    def message_id(self, api: str) -> str:
        return self.msg_id or super().message_id(api)

    def tool_call_id(self, api: str, index: int) -> str:
        return self._pop("call") or super().tool_call_id(api, index)

    def item_id(self, kind: str, index: int) -> str:
        return self._pop(kind) or super().item_id(kind, index)

    def signature(self) -> str:
        return self._pop("sig") or super().signature()


# ----------------------------------------------------------------------------- loose API-level view
_DROP_KEYS = {"cache_control", "status", "output_config", "id"}
_BILLING = "x-anthropic-billing-header:"


def _loose(v: Any, key: str | None = None) -> Any:
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if x is None or k in _DROP_KEYS:
                continue
            out[k] = _loose(x, k)
        return out
    if isinstance(v, list):
        return [_loose(x) for x in v]
    if isinstance(v, str):
        if key == "arguments":
            try:
                return ("json", json.loads(v))
            except ValueError:
                return v
        if key == "content":
            return [{"type": "text", "text": v}]
    return v


def _loose_view(api: str, body: dict[str, Any], reply: dict[str, Any] | None) -> tuple[Any, list[Any]]:
    """``(context, history)``: what must be equal, and the message list that must extend."""
    if api == "anthropic":
        system = body.get("system")
        if isinstance(system, list):
            system = [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(_BILLING))]
        ctx = _loose({"system": system, "tools": body.get("tools")})
        hist = _loose(body.get("messages") or [])
        if reply is not None:
            hist = hist + [_loose({"role": "assistant", "content": reply.get("content") or []})]
    elif api == "chat":
        ctx = _loose({"tools": body.get("tools")})
        hist = _loose(body.get("messages") or [])
        if reply is not None:
            m = dict((reply.get("choices") or [{}])[0].get("message") or {})
            if m.get("content") is None:
                m["content"] = ""
            hist = hist + [_loose(m)]
    else:
        ctx = _loose({"instructions": body.get("instructions"), "tools": body.get("tools")})
        inp = body.get("input")
        hist = [_loose({"role": "user", "content": inp})] if isinstance(inp, str) else _loose(inp or [])
        if reply is not None:
            hist = hist + _loose(reply.get("output") or [])
    for m in hist:  # an empty text content equals no content
        if isinstance(m, dict) and m.get("content") == [{"type": "text", "text": ""}]:
            m["content"] = []
    return ctx, hist


# ----------------------------------------------------------------------------- replay
@dataclass
class ReplayResult:
    """Outcome of a replay; ``tree`` is the execution's tree.

    Checks:

    * ``mismatches`` -- requests whose logged messages extend an earlier request's messages +
      its reply (compared loosely at the API level: ``cache_control``/``status``/null fields
      dropped, ``"str"`` = ``[{"type": "text", "text": "str"}]``, tool arguments compared as
      parsed JSON, Claude Code's billing block ignored; same tools), but whose ``input_ids`` do
      not start with that earlier record's ``input_ids ++ output_ids``;
    * ``duplicates`` -- delivered records sharing ``input_ids`` and ``output_ids``;
    * ``format_mismatches`` -- replies whose parse differs from the logged reply;
    * ``render_mismatches`` (``check_render``) -- requests whose assembled ``input_ids`` differ
      from a full re-render of the restored messages;
    * per request: tokens, tokens reused verbatim, tree match length, expected parent.
    """

    records: int = 0
    skipped: int = 0
    leaves: int = 0
    leaves_by_role: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0
    duplicates: int = 0
    format_mismatches: int = 0
    render_mismatches: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    tree: Any = None
    session: Any = None

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable summary (``tools/replay_trace.py --json``)."""
        return {
            "records": self.records,
            "skipped": self.skipped,
            "leaves": self.leaves,
            "leaves_by_role": self.leaves_by_role,
            "mismatches": self.mismatches,
            "duplicates": self.duplicates,
            "format_mismatches": self.format_mismatches,
            "render_mismatches": self.render_mismatches,
            "requests": self.requests,
        }


def _is_model_call(line: dict[str, Any]) -> bool:
    return (
        line.get("method") == "POST"
        and line.get("path") in MODEL_PATHS
        and not line.get("injected")
        and isinstance(line.get("body"), dict)
        and isinstance((line.get("response") or {}).get("message"), dict)
        and (line.get("response") or {}).get("status") == 200
    )


def replay_records(
    lines: Iterable[dict[str, Any]],
    renderer: ChatRenderer,
    *,
    execution_id: str = "replay",
    append=None,
    check_render: bool = False,
) -> ReplayResult:
    """Replay parsed trace lines (dicts of the trace format) into one execution.

    Args:
        lines: trace records in log order.
        renderer: the model's chat renderer (tokenizer + template).
        execution_id: id of the replayed execution.
        append: optional durable-storage callback (e.g. ``TrajectoryStore.append``).
        check_render: also count ``render_mismatches``: requests whose ``input_ids`` differ from
            encoding a full re-render of the restored messages (with a teacher-forced engine the
            two agree; a diagnostic, O(context) per request).
    """
    session = TitoSession(execution_id, renderer, append=append)
    res = ReplayResult(tree=session.tree, session=session)
    done: list[tuple[Any, list[Any], RequestRecord]] = []  # (ctx, history+reply, record)
    seen: Counter[tuple[bytes, bytes]] = Counter()
    for line in lines:
        if not _is_model_call(line):
            res.skipped += 1
            continue
        api = MODEL_PATHS[line["path"]]
        body = line["body"]
        headers = line.get("headers") or {}
        reply = line["response"]["message"]
        req = normalize(api, body)
        role = classify_role(req, headers)
        meta = harness_metadata(headers)
        meta["api"] = api
        meta["seq"] = line.get("seq")
        prep = session.prepare(req)
        if check_render and not _renders_the_same(renderer, req, prep):
            res.render_mismatches += 1
        out_ids, out_msg, same_format = _teacher_forced(renderer, api, req, prep, reply)
        if not same_format:
            res.format_mismatches += 1
        rec = session.commit(
            prep,
            output_ids=out_ids,
            output_logprobs=np.zeros(len(out_ids), np.float32),
            finish_reason="stop",
            output_message=out_msg,
            role=role,
            delivered=True,
            engine_id="teacher-forced",
            metadata=meta,
        )
        info = session.tree.record_info(rec.call_index)
        # expected parent: the latest earlier call whose messages + reply this request extends
        ctx, hist = _loose_view(api, body, None)
        parent = next((prec for pctx, phist, prec in reversed(done)
                       if pctx == ctx and len(phist) <= len(hist) and hist[: len(phist)] == phist), None)
        ok = parent is None or _extends(rec, parent)
        if not ok:
            res.mismatches += 1
        key = (rec.input_ids.tobytes(), rec.output_ids.tobytes())
        seen[key] += 1
        if seen[key] > 1:
            res.duplicates += 1
        done.append((ctx, _loose_view(api, body, reply)[1], rec))
        res.records += 1
        res.requests.append(_request_summary(line, api, role, meta, rec, prep, info, parent, ok))
    tree = session.tree
    leaves = tree.leaves()
    res.leaves = len(leaves)
    res.leaves_by_role = dict(sorted(Counter(tree.role(n) for n in leaves).items()))
    return res


def _request_summary(line: dict[str, Any], api: str, role: str, meta: dict[str, Any], rec: RequestRecord, prep,
                     info, parent: RequestRecord | None, ok: bool) -> dict[str, Any]:
    """One entry of :attr:`ReplayResult.requests`."""
    return {
        "seq": line.get("seq"),
        "api": api,
        "role": role,
        "thread": meta.get("thread"),
        "input_tokens": rec.num_input_tokens,
        "output_tokens": rec.num_output_tokens,
        "reused_tokens": prep.reused_tokens,
        "rendered_tokens": prep.rendered_tokens,
        "tree_matched_tokens": info.matched_tokens,
        "restored_tool_calls": prep.restored_calls,
        "identified_outputs": sum(1 for x in prep.identified if x is not None),
        "expected_parent_seq": parent.metadata.get("seq") if parent is not None else None,
        "extends_expected_parent": ok if parent is not None else None,
    }


def _renders_the_same(renderer: ChatRenderer, req, prep) -> bool:
    """Whether the prepared ``input_ids`` equal the encoding of a full re-render of the restored
    messages (with the generation prompt)."""
    full = renderer.encode(renderer.render(
        [m.template_dict() for m in prep.messages], req.tools,
        add_generation_prompt=True, template_kwargs=req.template_kwargs))
    return full == prep.input_ids.tolist()


def _teacher_forced(renderer: ChatRenderer, api: str, req, prep, reply: dict[str, Any]):
    """A teacher-forced engine's output for a call: ``(output ids, output message, same format)``:
    the logged reply in the model's format, encoded, parsed and built into the API's response as a
    generation would be; ``same format``: the built message equals the logged reply."""
    want = reply_message(api, reply)
    out_text = renderer.assistant_output_text(want, req.template_kwargs)
    out_ids = renderer.encode(out_text)
    parser = OutputParser(renderer.decode, renderer.stop_ids, req.tool_kinds,
                          starts_in_reasoning=prep.starts_in_reasoning)
    builder = make_builder(req, int(prep.input_ids.shape[0]), ReplayIds(api, reply))
    builder.start()
    for ev in parser.feed(out_ids):
        builder.on_event(ev)
    for ev in parser.finish("stop"):
        builder.on_event(ev)
    builder.finish("stop", len(out_ids))
    out_msg = builder.output_message()
    return out_ids, out_msg, out_msg.key() == want.key()


def _extends(rec: RequestRecord, parent: RequestRecord) -> bool:
    """Whether ``rec``'s input starts with ``parent``'s input and output."""
    plen = parent.num_input_tokens + parent.num_output_tokens
    return rec.num_input_tokens >= plen and bool(
        np.array_equal(rec.input_ids[: parent.num_input_tokens], parent.input_ids)
        and np.array_equal(rec.input_ids[parent.num_input_tokens: plen], parent.output_ids)
    )


def replay_trace(
    path: str | Path,
    renderer: ChatRenderer,
    *,
    execution_id: str | None = None,
    append=None,
    check_render: bool = False,
) -> ReplayResult:
    """Replay one trace file (JSON lines); see :func:`replay_records`.

    Raises:
        ValueError: a line is not valid JSON.
    """
    path = Path(path)
    lines = []
    with open(path, encoding="utf-8") as f:
        for i, raw in enumerate(f, 1):
            raw = raw.strip()
            if not raw:
                continue
            try:
                lines.append(json.loads(raw))
            except ValueError as exc:
                raise ValueError(f"{path}:{i}: not JSON: {exc}") from None
    eid = execution_id or "".join(c if c.isalnum() or c in "._-" else "_" for c in path.stem) or "replay"
    return replay_records(lines, renderer, execution_id=eid, append=append, check_render=check_render)
