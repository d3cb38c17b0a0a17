"""Token-in/token-out assembly on an execution's trajectory tree, with tool-call restoration.

Source: DESIGN.md §3.1 (TITO, tool-call restoration), §3.2 (trees); BACKENDS.md
"Chat-template facts the proxy must respect"; paper §5.1.

One :class:`TitoSession` per execution. For each request it:

1. **restores** the proxy's own earlier outputs (:meth:`TitoSession.restore`): every tool call
   whose id the proxy returned gets its *original* argument text back when the incoming one is
   the same JSON value (compared parsed, canonically: key order and whitespace ignored, ``1``
   vs ``1.0`` vs ``true`` distinguished); the incoming id is kept. An assistant message that
   is one of the proxy's outputs -- recognised by its call ids, item ids (Responses reasoning/
   message ids, Anthropic thinking signatures) or its content -- is *identified* with that
   output, also when the harness dropped its reasoning (``restore_reasoning``).
2. **matches** the restored message list against a *message trie* of everything already
   tokenised in this execution (keys: tools + template kwargs, then :meth:`Message.key` per
   message; identified outputs are keyed by their call). Trie nodes at cuttable boundaries
   (:mod:`gyre.proxy.render`) point into a stored record's ``input ++ output`` tokens.
3. **assembles** ``input_ids`` = stored tokens up to the deepest cuttable match (verbatim,
   never re-tokenised) + the template's text after a sampled EOS (``"\\n"``, provenance
   external) + the *new* messages rendered at message boundaries, where each identified output
   is spliced in as its original generation prompt + sampled ids + close (so a
   post-compaction context carrying an earlier reply keeps the model's own tokens) + the
   generation prompt.

:meth:`TitoSession.commit` turns the engine result into a
:class:`~gyre.trajectory.records.RequestRecord`, appends it to durable storage (``append``
callback) *first*, then inserts it into the :class:`~gyre.trajectory.tree.TrajectoryTree` and
the trie, and caches the output for later restoration (delivered outputs only: an output the
harness never received cannot come back).

Cost per request: O(messages) dict/hash work (C-speed comparisons of message text) plus
rendering/encoding of the new messages only; the reused prefix is one array slice.

Not thread-safe: the caller serialises :meth:`prepare`/:meth:`commit` per execution (the
generation in between may overlap with other calls of the same execution).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np

from gyre.proxy.messages import ROLE_ASSISTANT, ChatRequest, Message, ToolCall
from gyre.proxy.render import ChatRenderer, RenderError
from gyre.trajectory.records import Provenance, RequestRecord
from gyre.trajectory.tree import TrajectoryTree

__all__ = ["TitoSession", "PreparedInput", "OutputEntry", "TitoStats"]

_EXT = int(Provenance.EXTERNAL)
_POL = int(Provenance.POLICY)


def _canonical_json(text: str) -> str | None:
    """Canonical form of a JSON text (sorted keys, no whitespace), ``None`` if not JSON."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


@dataclass(slots=True)
class OutputEntry:
    """A delivered output the proxy returned, cached for restoration and splicing.

    ``open_ids`` -- the generation prompt tokens of that call (``int32``); ``output_ids`` --
    sampled ids; ``close_ids`` -- template tokens that follow it in a continued history
    (``"\\n"`` after a sampled EOS, else EOS + ``"\\n"``); ``output_provenance`` -- ``POLICY``
    (``EVALUATOR`` for evaluator calls).
    """

    call_index: int
    message: Message
    open_ids: np.ndarray
    output_ids: np.ndarray
    close_ids: list[int]
    output_provenance: int = _POL


class _Node:
    """Message-trie node. ``end`` >= 0: a cuttable boundary after ``end`` tokens of record
    ``ref``'s ``input ++ output`` path (-1: not cuttable); ``close``: tokens appended when a
    history continues after this node (output nodes only)."""

    __slots__ = ("key", "parent", "children", "ref", "end", "close", "message", "is_output")

    def __init__(self, key: Hashable, parent: "_Node | None", message: Message | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, _Node] = {}
        self.ref = -1
        self.end = -1
        self.close: list[int] = []
        self.message = message
        self.is_output = False


@dataclass(slots=True)
class _Pending:
    """A trie node to create at commit: key, message, end offset (-1 = not cuttable), close."""

    key: Hashable
    message: Message
    end: int
    close: list[int]
    is_output: bool


@dataclass(slots=True)
class PreparedInput:
    """What :meth:`TitoSession.prepare` assembled for one request.

    * ``input_ids`` -- ``int32[n]`` tokens for the engine; ``input_provenance`` -- ``int8[n]``.
    * ``reused_tokens`` -- leading tokens taken verbatim from stored records (incl. spliced
      outputs); ``rendered_tokens`` -- tokens produced by rendering + encoding this time.
    * ``messages`` -- the restored messages; ``identified`` -- per message, the call index of
      the proxy output it was identified with (or ``None``).
    * ``restored_calls`` -- tool calls whose argument text was restored from the cache.
    * ``starts_in_reasoning`` -- the generation prompt opens a ``<think>`` block.
    """

    input_ids: np.ndarray
    input_provenance: np.ndarray
    reused_tokens: int
    rendered_tokens: int
    messages: list[Message]
    identified: list[int | None]
    restored_calls: int
    starts_in_reasoning: bool
    gen_start: int
    path: list[_Node] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    tool_kinds: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


class _TextRef:
    """Placeholder for a text whose tokens are encoded later (index into ``_Plan.texts``)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Plan:
    """A request's input before encoding: token arrays (with provenance) and texts, in order;
    trie nodes to create, with their boundaries as part counts."""

    def __init__(self, request, messages, ident, restored, starts_in_reasoning, path) -> None:
        self.request, self.messages, self.ident = request, messages, ident
        self.restored, self.starts_in_reasoning, self.path = restored, starts_in_reasoning, path
        self.parts: list[tuple[Any, np.ndarray | None]] = []  # (array | _TextRef, provenance | None)
        self.texts: list[str] = []
        self.pending: list[list[Any]] = []  # [key, message, is_output, close, cuttable, after_parts]
        self.reused = 0
        self.gen_start = -1

    def text(self, text: str) -> _TextRef:
        self.texts.append(text)
        return _TextRef(len(self.texts) - 1)

    def add(self, ids: np.ndarray, prov: np.ndarray) -> None:
        self.parts.append((ids, prov))

    def add_ext(self, ids: np.ndarray) -> None:
        self.parts.append((ids, None))

    def add_part(self, ref: Any) -> None:
        self.parts.append((ref, None))

    def pend(self, key, message, is_output: bool, close: list[int], cut: bool) -> None:
        self.pending.append([key, message, is_output, close, cut, len(self.parts)])

    def known_len(self) -> int:
        return sum(p[0].shape[0] for p in self.parts)

    def finish(self, encoded: list[list[int]]) -> PreparedInput:
        ids_parts: list[np.ndarray] = []
        prov_parts: list[np.ndarray] = []
        ends = [0]
        rendered = 0
        for obj, prov in self.parts:
            if isinstance(obj, _TextRef):
                arr = np.asarray(encoded[obj.index], np.int32)
                rendered += arr.shape[0]
            else:
                arr = obj
            ids_parts.append(arr)
            prov_parts.append(prov if prov is not None else np.full(arr.shape[0], _EXT, np.int8))
            ends.append(ends[-1] + arr.shape[0])
        pending = []
        for key, message, is_output, close, cut, after in self.pending:
            end = ends[after] if cut else -1  # an identified output's boundary is before its close
            pending.append(_Pending(key, message, end, close, is_output))
        input_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
        input_prov = np.concatenate(prov_parts) if prov_parts else np.zeros(0, np.int8)
        return PreparedInput(
            input_ids=input_ids.astype(np.int32, copy=False),
            input_provenance=input_prov.astype(np.int8, copy=False),
            reused_tokens=self.reused,
            rendered_tokens=rendered,
            messages=self.messages,
            identified=self.ident,
            restored_calls=self.restored,
            starts_in_reasoning=self.starts_in_reasoning,
            gen_start=ends[self.gen_start] if self.gen_start >= 0 else -1,
            path=self.path,
            pending=pending,
            tool_kinds=dict(self.request.tool_kinds),
        )


@dataclass(slots=True)
class TitoStats:
    """Per-execution TITO counters (tokens; calls)."""

    calls: int = 0
    reused_tokens: int = 0
    rendered_tokens: int = 0
    restored_tool_calls: int = 0
    identified_outputs: int = 0


class TitoSession:
    """TITO state of one execution (see the module docstring).

    Args:
        execution_id: the execution (a valid :data:`~gyre.trajectory.records.EXECUTION_ID_RE`).
        renderer: the model's :class:`~gyre.proxy.render.ChatRenderer`.
        tree: the execution's tree (a new one if ``None``).
        append: durable-storage callback, called with each record *before* it enters the tree
            (e.g. ``TrajectoryStore.append``).
        restore_reasoning: identify an output whose reasoning the harness dropped (and splice
            the original tokens, reasoning included).
        recent_records: how many records' token arrays to keep for O(1) prefix slicing (older
            ones are read back from the tree).
        first_call_index: call index of the first record (continuing a stored execution).
    """

    def __init__(
        self,
        execution_id: str,
        renderer: ChatRenderer,
        *,
        tree: TrajectoryTree | None = None,
        append: Callable[[RequestRecord], Any] | None = None,
        restore_reasoning: bool = True,
        recent_records: int = 2,
        first_call_index: int = 0,
    ) -> None:
        self.execution_id = execution_id
        self.renderer = renderer
        self.tree = tree if tree is not None else TrajectoryTree(execution_id)
        self.append = append
        self.restore_reasoning = restore_reasoning
        self.stats = TitoStats()
        self._root = _Node(None, None, None)
        self._next_call = int(first_call_index)
        self._recent: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._recent_max = max(1, int(recent_records))
        self._outputs: dict[int, OutputEntry] = {}
        self._by_call_id: dict[str, tuple[int, int]] = {}
        self._by_item_id: dict[str, int] = {}
        self._by_key: dict[Hashable, int] = {}
        self._by_key_noreason: dict[Hashable, int] = {}
        self._gen_cache: dict[str, tuple[str, bool]] = {}
        self._canon_cache: OrderedDict[str, str | None] = OrderedDict()

    # ------------------------------------------------------------------ restoration
    def _canon(self, text: str) -> str | None:
        c = self._canon_cache.get(text, False)
        if c is False:
            c = _canonical_json(text)
            self._canon_cache[text] = c
            if len(self._canon_cache) > 4096:
                self._canon_cache.popitem(last=False)
        return c  # type: ignore[return-value]

    def restore(self, messages: list[Message]) -> tuple[list[Message], list[int | None], int]:
        """Restore the proxy's earlier outputs in ``messages`` (see the module docstring).

        Returns ``(messages, identified, restored_calls)``: the restored list (same length),
        per message the call index of the identified output or ``None``, and how many tool
        calls got their original argument text back.
        """
        out: list[Message] = []
        ident: list[int | None] = []
        restored = 0
        for m in messages:
            if m.role != ROLE_ASSISTANT:
                out.append(m)
                ident.append(None)
                continue
            calls = list(m.tool_calls)
            cands: set[int] = set()
            for i, tc in enumerate(calls):
                hit = self._by_call_id.get(tc.id) if tc.id else None
                if hit is None:
                    continue
                ci, k = hit
                cands.add(ci)
                orig = self._outputs[ci].message.tool_calls[k]
                if orig.arguments != tc.arguments and orig.name == tc.name:
                    a, b = self._canon(orig.arguments), self._canon(tc.arguments)
                    if a is not None and a == b:
                        calls[i] = ToolCall(tc.id, tc.name, orig.arguments, orig.kind, tc.item_id)
                        restored += 1
            for iid in m.item_ids:
                ci = self._by_item_id.get(iid)
                if ci is not None:
                    cands.add(ci)
            if restored or calls != list(m.tool_calls):
                m = Message(m.role, m.content, m.reasoning, tuple(calls), m.tool_call_id, m.is_error, m.item_ids)
            key = m.key()
            if not cands:
                ci = self._by_key.get(key)
                if ci is None and self.restore_reasoning and not m.reasoning:
                    ci = self._by_key_noreason.get(key[:2] + key[3:])
                if ci is not None:
                    cands.add(ci)
            hit_ci: int | None = None
            for ci in sorted(cands, reverse=True):
                ek = self._outputs[ci].message.key()
                if ek == key or (
                    self.restore_reasoning and not m.reasoning and ek[:2] + ek[3:] == key[:2] + key[3:]
                ):
                    hit_ci = ci
                    break
            if hit_ci is not None:
                orig = self._outputs[hit_ci].message
                m = Message(m.role, orig.content, orig.reasoning, m.tool_calls, m.tool_call_id, m.is_error, m.item_ids)
            out.append(m)
            ident.append(hit_ci)
        return out, ident, restored

    # ------------------------------------------------------------------ tokens of stored records
    def _record_arrays(self, call_index: int) -> tuple[np.ndarray, np.ndarray]:
        arr = self._recent.get(call_index)
        if arr is not None:
            self._recent.move_to_end(call_index)
            return arr
        nid = self.tree.record_node(call_index)
        arr = (self.tree.path_tokens(nid), self.tree.path_provenance(nid))
        self._remember(call_index, arr)
        return arr

    def _remember(self, call_index: int, arr: tuple[np.ndarray, np.ndarray]) -> None:
        self._recent[call_index] = arr
        self._recent.move_to_end(call_index)
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)

    def _gen_prompt(self, kwargs: dict[str, Any]) -> tuple[str, bool]:
        k = json.dumps(kwargs, sort_keys=True, default=str)
        g = self._gen_cache.get(k)
        if g is None:
            text = self.renderer.generation_prompt(kwargs)
            g = (text, text.rstrip().endswith("<think>"))
            self._gen_cache[k] = g
        return g

    # ------------------------------------------------------------------ prepare
    @staticmethod
    def header_key(request: ChatRequest) -> Hashable:
        """Trie key of what precedes the first message: tools and template kwargs."""
        return (
            "hdr",
            json.dumps(request.tools, sort_keys=True, ensure_ascii=False, default=str),
            json.dumps(request.template_kwargs, sort_keys=True, default=str),
        )

    def prepare(self, request: ChatRequest) -> PreparedInput:
        """Restore, match and assemble the engine input of ``request`` (no state changes).

        ``timings`` of the result: ``match_s`` (restoration + trie walk) and ``render_s``
        (rendering + encoding of the new messages, assembly), seconds.

        Raises:
            gyre.proxy.render.RenderError: the template cannot render the messages at all.
        """
        t0 = time.perf_counter()
        plan, t1 = self._plan_request(request)
        prep = plan.finish(self._encode_texts(plan.texts))
        prep.timings = {"match_s": t1 - t0, "render_s": time.perf_counter() - t1}
        return prep

    async def prepare_async(self, request: ChatRequest, executor: Any = None) -> PreparedInput:
        """:meth:`prepare` with the encoding of new text run in ``executor`` (a thread pool: the
        tokenizer releases the GIL, so long tool outputs neither block the event loop nor stay
        on one core). Restoration, matching and rendering happen before the first await, so the
        result is the same as :meth:`prepare` at that moment.
        """
        import asyncio

        t0 = time.perf_counter()
        plan, t1 = self._plan_request(request)
        t2 = time.perf_counter()
        if plan.texts and sum(len(t) for t in plan.texts) > 4096:
            enc = await asyncio.get_running_loop().run_in_executor(executor, self._encode_texts, plan.texts)
        else:
            enc = self._encode_texts(plan.texts)
        t3 = time.perf_counter()
        prep = plan.finish(enc)
        prep.timings = {"match_s": t1 - t0, "render_s": time.perf_counter() - t1, "encode_s": t3 - t2}
        return prep

    def _plan_request(self, request: ChatRequest):
        """Restore, match and render ``request``: ``(plan, time after matching)``."""
        messages, ident, restored = self.restore(request.messages)
        keys, path = self._walk(request, messages, ident)
        _, starts_in_reasoning = self._gen_prompt(request.template_kwargs)
        t1 = time.perf_counter()
        return self._plan(request, messages, ident, keys, path, restored, starts_in_reasoning), t1

    def _walk(self, request: ChatRequest, messages: list[Message], ident: list[int | None]) -> tuple[list, list]:
        keys: list[Hashable] = [("out", ci) if ci is not None else m.key() for m, ci in zip(messages, ident)]
        path: list[_Node] = []
        node = self._root.children.get(self.header_key(request))
        if node is not None:
            path.append(node)
            for k in keys:
                nxt = node.children.get(k)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
        return keys, path

    def _plan(self, request, messages, ident, keys, path, restored, starts_in_reasoning) -> "_Plan":
        """Back off to the deepest cuttable boundary that the continuation renders after."""
        depth = len(path)
        while True:
            while depth > 0 and path[depth - 1].end < 0:
                depth -= 1
            try:
                return self._assemble(request, messages, ident, keys, path, depth, restored, starts_in_reasoning)
            except RenderError:
                if depth == 0:
                    raise
                depth -= 1

    def _assemble(
        self,
        request: ChatRequest,
        messages: list[Message],
        ident: list[int | None],
        keys: list[Hashable],
        path: list[_Node],
        depth: int,
        restored: int,
        starts_in_reasoning: bool,
    ) -> "_Plan":
        """Plan the input of a request: stored token arrays and texts still to encode, in order.

        Raises:
            RenderError: the continuation does not render after ``path[depth - 1]``.
        """
        plan = _Plan(request, messages, ident, restored, starts_in_reasoning, path[:depth])
        if depth > 0:
            anchor = path[depth - 1]
            toks, prov = self._record_arrays(anchor.ref)
            plan.add(toks[: anchor.end], prov[: anchor.end])
            if anchor.close:
                plan.add_ext(np.asarray(anchor.close, np.int32))
        plan.reused = plan.known_len()
        # path[0] is the header node, path[k] the node of messages[k - 1]: with depth d >= 1
        # messages[d - 1:] are new; depth 0 (no header either) renders everything.
        first_new = max(0, depth - 1)
        prev: Message | None = path[depth - 1].message if depth > 0 else None
        tools = request.tools
        if depth == 0:
            plan.pend(self.header_key(request), None, False, [], cut=True)  # type: ignore[arg-type]
        n = len(messages)
        i = first_new
        kw = request.template_kwargs
        while True:
            j = i  # next identified output at or after i
            while j < n and ident[j] is None:
                j += 1
            run = messages[i:j]
            last = j >= n
            if run or last:
                d = self.renderer.render_delta(prev, run, tools if prev is None else None, add_generation_prompt=last,
                                               template_kwargs=kw, encode=plan.text)
                for seg in d.segments:
                    plan.add_part(seg.ids)
                    for mi in range(seg.first, seg.last + 1):
                        k = i + mi
                        plan.pend(keys[k], messages[k], False, [], cut=mi == seg.last)
                if last:
                    plan.gen_start = len(plan.parts)
                    if isinstance(d.gen_ids, _TextRef):
                        plan.add_part(d.gen_ids)
                    if d.gen_in_last and plan.pending:
                        plan.pending[-1][4] = False
                    break
                if run:
                    prev = run[-1]
            e = self._outputs[ident[j]]  # type: ignore[index]  # splice the identified output
            plan.add_ext(e.open_ids)
            plan.add(e.output_ids, np.full(e.output_ids.shape[0], e.output_provenance, np.int8))
            plan.pend(keys[j], messages[j], True, list(e.close_ids), cut=True)
            if e.close_ids:
                plan.add_ext(np.asarray(e.close_ids, np.int32))
            prev = e.message
            i = j + 1
        return plan

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (the tokenizer's batch encoder releases the GIL)."""
        fast = self.renderer._fast
        if fast is not None and len(texts) > 1:
            return [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)]
        return [self.renderer.encode(t) for t in texts]

    # ------------------------------------------------------------------ commit
    def next_call_index(self) -> int:
        """Call index the next committed record will get."""
        return self._next_call

    def build_record(
        self,
        prepared: PreparedInput,
        *,
        output_ids: Any,
        output_logprobs: Any,
        finish_reason: str,
        role: str,
        delivered: bool = True,
        policy_version: int = 0,
        engine_id: str = "",
        timings: dict[str, float] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> RequestRecord:
        """The :class:`~gyre.trajectory.records.RequestRecord` of a finished call, with the next
        call index (no state change until :meth:`insert`).

        Raises:
            ValueError: from :class:`~gyre.trajectory.records.RequestRecord` validation.
        """
        return RequestRecord(
            execution_id=self.execution_id,
            call_index=self._next_call,
            role=role,
            input_ids=prepared.input_ids,
            output_ids=np.asarray(output_ids, np.int32),
            output_logprobs=np.asarray(output_logprobs, np.float32),
            input_provenance=prepared.input_provenance,
            policy_version=policy_version,
            engine_id=engine_id,
            delivered=delivered,
            timings=dict(timings or {}),
            finish_reason=finish_reason,
            metadata=dict(metadata or {}),
        )

    def commit(
        self,
        prepared: PreparedInput,
        *,
        output_ids: Any,
        output_logprobs: Any,
        finish_reason: str,
        output_message: Message | None,
        role: str,
        delivered: bool = True,
        policy_version: int = 0,
        engine_id: str = "",
        timings: dict[str, float] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> RequestRecord:
        """Record one finished call: :meth:`build_record`, append it to durable storage (the
        ``append`` callback), then :meth:`insert` it.

        ``output_message`` is the output as returned to the harness (ids assigned); ``None``
        or ``delivered=False`` keeps it out of the restoration cache.

        Raises:
            ValueError: from :class:`~gyre.trajectory.records.RequestRecord` validation.
        """
        rec = self.build_record(
            prepared, output_ids=output_ids, output_logprobs=output_logprobs, finish_reason=finish_reason, role=role,
            delivered=delivered, policy_version=policy_version, engine_id=engine_id, timings=timings,
            metadata=metadata)
        if self.append is not None:
            self.append(rec)
        self.insert(prepared, rec, output_message)
        return rec

    def insert(self, prepared: PreparedInput, rec: RequestRecord, output_message: Message | None) -> None:
        """Insert a record built by :meth:`build_record` (and already made durable) into the
        tree, the message trie and, if delivered, the restoration cache.

        Raises:
            ValueError: ``rec`` is not the next call of this execution.
        """
        if rec.call_index != self._next_call:
            raise ValueError(f"record {rec.call_index} is not the next call ({self._next_call})")
        ci = rec.call_index
        delivered = rec.delivered
        self.tree.insert(rec)
        self._next_call += 1
        st = self.stats
        st.calls += 1
        st.reused_tokens += prepared.reused_tokens
        st.rendered_tokens += prepared.rendered_tokens
        st.restored_tool_calls += prepared.restored_calls
        st.identified_outputs += sum(1 for x in prepared.identified if x is not None)
        out_ids = rec.output_ids
        full = np.concatenate([rec.input_ids, out_ids])
        prov = np.concatenate([rec.input_provenance, rec.output_provenance()])
        self._remember(ci, (full, prov))
        # trie: the matched path now (also) lives in this record
        node = self._root
        for nd in prepared.path:
            nd.ref = ci
            node = nd
        for p in prepared.pending:
            child = node.children.get(p.key)
            if child is None:
                child = _Node(p.key, node, p.message)
                child.end = p.end
                child.close = p.close
                child.is_output = p.is_output
                node.children[p.key] = child
            if child.end == p.end or child.end < 0:
                child.end = p.end
                child.ref = ci
            node = child
        if delivered and output_message is not None:
            gs = prepared.gen_start if prepared.gen_start >= 0 else rec.num_input_tokens
            stop_end = out_ids.shape[0] > 0 and int(out_ids[-1]) in self._stop_ids()
            close = list(self.renderer.after_eos_ids) if stop_end else list(self.renderer.close_ids)
            e = OutputEntry(
                ci, output_message, rec.input_ids[gs:].copy(), out_ids.copy(), close, rec.output_provenance_value()
            )
            self._outputs[ci] = e
            for k, tc in enumerate(output_message.tool_calls):
                if tc.id:
                    self._by_call_id[tc.id] = (ci, k)
            for iid in output_message.item_ids:
                self._by_item_id[iid] = ci
            key = output_message.key()
            self._by_key[key] = ci
            self._by_key_noreason[key[:2] + key[3:]] = ci
            out_node = node.children.get(("out", ci))
            if out_node is None:
                out_node = _Node(("out", ci), node, output_message)
                node.children[("out", ci)] = out_node
            out_node.end = full.shape[0]
            out_node.ref = ci
            out_node.close = close
            out_node.is_output = True

    def _stop_ids(self) -> frozenset[int]:
        ids = {self.renderer.eos_id}
        tok = self.renderer.tokenizer
        pad = getattr(tok, "pad_token_id", None)
        if pad is not None:
            ids.add(int(pad))
        return frozenset(ids)
