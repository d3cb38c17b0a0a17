"""Token-in/token-out (TITO) assembly on an execution's trajectory tree, with restoration of
the proxy's own outputs.

One :class:`TitoSession` per execution. For each request it restores the harness's echoes of
earlier outputs (:mod:`gyre.proxy.tito_outputs`), matches the messages against the execution's message trie
(:mod:`gyre.proxy.tito_input`) down to the deepest cuttable boundary, and assembles
``input_ids`` from the stored tokens plus the new messages rendered at message boundaries
(:mod:`gyre.proxy.render`). :meth:`TitoSession.commit` stores the resulting
:class:`~gyre.trajectory.records.RequestRecord` durably first, then inserts it into the tree.

Threads. A session's state is read and written on one thread (the server's event loop); the
caller serialises commits per execution. :meth:`TitoSession.prepare_async` reads the state before
its first await: restore, match, and the stored tokens up to the deepest cuttable boundary matched
(a :class:`~gyre.proxy.tito_input.MatchedRequest`). Then the new messages are rendered and encoded
(:func:`~gyre.proxy.tito_input.draft_input`), in a worker thread when there are many of them; that
work reads only the :class:`~gyre.proxy.tito_input.MatchedRequest`, never the session. After the
last await the input is assembled on the loop: written after the stored tokens into the thread's
context buffer, in place where no other input claimed the space meanwhile. Only when the new
messages did not render after that boundary (the renderer backed off to an earlier one) are stored
tokens read again there. A commit that runs meanwhile cannot invalidate the match: trie nodes only
gain children, a node's ``end`` never changes once set, and a node's ``ref`` only moves to a later
record that holds the same tokens up to ``end``.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from gyre.proxy.context_buffer import ContextBuffer, write_input
from gyre.proxy.messages import ChatRequest, Message
from gyre.proxy.render import ChatRenderer
from gyre.proxy.tito_input import (InputPlan, MatchedRequest, OutputEntry, PreparedInput, TrieNode, draft_input,
                                   trie_key)
from gyre.proxy.tito_outputs import OutputIndex
from gyre.trajectory.records import RequestRecord
from gyre.trajectory.tree import TrajectoryTree

__all__ = ["TitoSession", "TitoStats"]

_NO_IDS = np.zeros(0, np.int32)
# New text longer than this is encoded in the proxy's thread pool rather than on the event loop:
# the tokenizer releases the GIL, so the loop goes on with other calls and the encoding can run on
# another core. The hop to the pool has a cost of its own, so short text stays on the loop
# (docs/proxy.md gives the hop's and a 1,024-character encoding's times).
INLINE_ENCODE_MAX_CHARS = 1024
# A request with more new messages than this is rendered (and encoded) in the thread pool: a
# message costs the template two or three calls, so the event loop renders at most a few template
# calls' worth of any request (docs/proxy.md, "Many new messages in one call").
INLINE_RENDER_MAX_MESSAGES = 16
_Recent = tuple[np.ndarray, np.ndarray, np.ndarray, int, "ContextBuffer | None"]


@dataclass(slots=True)
class TitoStats:
    """Per-execution TITO counters (tokens; calls)."""

    calls: int = 0
    reused_tokens: int = 0
    rendered_tokens: int = 0
    restored_tool_calls: int = 0
    identified_outputs: int = 0


class TitoSession:
    """TITO state of one execution. For each request it

    1. **restores** (:meth:`restore`, :mod:`gyre.proxy.tito_outputs`): a tool call whose id the
       proxy returned gets its original argument text back when the incoming text is the same
       JSON value (compared canonically: key order and whitespace ignored, ``1``/``1.0``/``true``
       kept apart); an assistant
       message recognised as an earlier output (by call ids, item ids or content, also without
       its reasoning when ``restore_reasoning``) is *identified* with it;
    2. **matches** the messages against the execution's message trie down to the deepest
       cuttable boundary;
    3. **assembles** ``input_ids``: the stored tokens up to that boundary, verbatim, then the
       new messages rendered at message boundaries, each identified output spliced in as its
       original generation prompt + sampled ids + close, then the generation prompt.

    :meth:`commit` builds the :class:`~gyre.trajectory.records.RequestRecord`, hands it to
    durable storage first, then inserts it into the tree and the trie and, if delivered, keeps
    the output for restoration.

    Args:
        execution_id: the execution (a valid :data:`~gyre.trajectory.records.EXECUTION_ID_RE`).
        renderer: the model's :class:`~gyre.proxy.render.ChatRenderer`.
        tree: the execution's tree (a new one if ``None``).
        append: durable-storage callback, called with each record *before* it enters the tree
            (e.g. ``TrajectoryStore.append``).
        restore_reasoning: identify an output whose reasoning the harness dropped (and splice
            the original tokens, reasoning included).
        recent_records: how many records' token arrays to keep for O(1) prefix slicing (older
            ones are read back from the tree). They are the records' own arrays (shared with
            the record store's writer and the tree's insert index), and a record whose whole input
            a new one continues leaves the cache: one thread keeps one record's arrays here.
        first_call_index: call index of the first record (continuing a stored execution).
        undelivered_kept: how many of the last undelivered records keep what
            :meth:`mark_delivered` needs to restore their output (the trie node of their
            request, their generation prompt and output ids).
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
        undelivered_kept: int = 4,
    ) -> None:
        self.execution_id = execution_id
        self.renderer = renderer
        self.tree = tree if tree is not None else TrajectoryTree(execution_id)
        self.append = append
        self.restore_reasoning = restore_reasoning
        self.stats = TitoStats()
        self._root = TrieNode(None, None)
        self._next_call = int(first_call_index)
        #: call index -> (input_ids, input_provenance, output_ids, output provenance value,
        #: the context buffer input_ids is a prefix of, or None)
        self._recent: OrderedDict[int, _Recent] = OrderedDict()
        self._recent_max = max(1, int(recent_records))
        #: the delivered outputs, for restoration
        self.outputs = OutputIndex(restore_reasoning)
        #: call index -> what :meth:`mark_delivered` needs, for the last undelivered records
        self._undelivered: OrderedDict[int, tuple] = OrderedDict()
        self._undelivered_max = max(0, int(undelivered_kept))
        self._gen_cache: dict[str, tuple[str, bool]] = {}

    # ------------------------------------------------------------------ restoration
    def restore(self, messages: list[Message]) -> tuple[list[Message], list[int | None], int]:
        """Restore the proxy's earlier outputs in ``messages``
        (:meth:`OutputIndex.restore <gyre.proxy.tito_outputs.OutputIndex.restore>`).

        Returns ``(messages, identified, restored_calls)``: the restored list (same length),
        per message the call index of the identified output or ``None``, and how many tool
        calls got their original argument text back.
        """
        return self.outputs.restore(messages)

    # ------------------------------------------------------------------ tokens of stored records
    def _record_prefix(self, call_index: int,
                       n: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], ContextBuffer | None]:
        """The first ``n`` tokens of record ``call_index``'s ``input ++ output``, with their
        provenance, as one or two ``(ids, provenance)`` pieces (views where possible), and the
        context buffer whose prefix the first piece is when it is the record's whole input."""
        arr = self._recent.get(call_index)
        if arr is not None:
            self._recent.move_to_end(call_index)
        else:  # read back from the tree into a buffer the next input can continue in place
            nid = self.tree.record_node(call_index)
            path_ids, path_prov, buffer, _ = write_input([self.tree.path_tokens(nid)], [self.tree.path_provenance(nid)])
            buffer.copied_from = self.tree.view_base(nid)
            arr = (path_ids, path_prov, _NO_IDS, 0, buffer)
            self._remember(call_index, arr)
        ids, prov, out, out_prov, buffer = arr
        m = ids.shape[0]
        if n < m:
            return [(ids[:n], prov[:n])], None
        if n == m:
            return [(ids, prov)], buffer
        k = n - m
        return [(ids, prov), (out[:k], np.full(k, out_prov, np.int8))], buffer

    def _remember(self, call_index: int, arr: _Recent) -> None:
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

    def _encode(self, plan: InputPlan, max_prompt_tokens: int | None) -> list[np.ndarray]:
        """The tokens of ``plan``'s texts (:meth:`~gyre.proxy.render.ChatRenderer.encode_prompt`),
        stopping with :class:`~gyre.proxy.piece_encode.PromptTooLong` once the input is over
        ``max_prompt_tokens``."""
        plan.raise_if_over()
        fixed = plan.fixed_tokens() if max_prompt_tokens is not None else 0
        return self.renderer.encode_prompt(plan.texts, max_prompt_tokens, fixed)

    def prepare(self, request: ChatRequest, max_prompt_tokens: int | None = None) -> PreparedInput:
        """Restore, match and assemble the engine input of ``request`` (no state changes).
        With ``max_prompt_tokens``, an input longer than that raises
        :class:`~gyre.proxy.piece_encode.PromptTooLong` (a 400) as soon as its encoding shows it.

        ``timings`` of the result: ``match_s`` (restoration + trie walk) and ``render_s``
        (rendering + encoding of the new messages, assembly), seconds.

        Raises:
            gyre.proxy.render.RenderError: the template cannot render the messages at all.
        """
        t0 = time.perf_counter()
        matched = self._match(request)
        t1 = time.perf_counter()
        plan = draft_input(self.renderer, matched, max_prompt_tokens)
        plan.join(self._encode(plan, max_prompt_tokens))
        prep = self._complete(plan, matched)
        prep.timings = {"match_s": t1 - t0, "render_s": time.perf_counter() - t1}
        return prep

    async def prepare_async(self, request: ChatRequest, executor: Any = None,
                            max_prompt_tokens: int | None = None) -> PreparedInput:
        """:meth:`prepare` with the long work in ``executor`` (a thread pool): a request with more
        than ``INLINE_RENDER_MAX_MESSAGES`` new messages is rendered and encoded there; otherwise
        only the encoding of new text longer than ``INLINE_ENCODE_MAX_CHARS`` is (the tokenizer
        releases the GIL, so tool outputs neither block the event loop nor stay on its core).
        Restoration, matching and the reading of the stored prefix happen before the first await,
        the assembly after the last one (see the module docstring), so the result is the same as
        :meth:`prepare` at the first step's moment.
        """
        import asyncio

        t0 = time.perf_counter()
        matched = self._match(request)
        t1 = time.perf_counter()
        loop = asyncio.get_running_loop()
        if matched.new_messages() > INLINE_RENDER_MAX_MESSAGES:
            plan, encode_s = await loop.run_in_executor(executor, self._draft_and_encode, matched,
                                                        max_prompt_tokens)
        else:
            plan = draft_input(self.renderer, matched, max_prompt_tokens)
            t2 = time.perf_counter()
            if plan.texts and sum(len(t) for t in plan.texts) > INLINE_ENCODE_MAX_CHARS:
                enc = await loop.run_in_executor(executor, self._encode, plan, max_prompt_tokens)
            else:
                enc = self._encode(plan, max_prompt_tokens)
            encode_s = time.perf_counter() - t2
            plan.join(enc)
        prep = self._complete(plan, matched)
        prep.timings = {"match_s": t1 - t0, "render_s": time.perf_counter() - t1, "encode_s": encode_s}
        return prep

    def _draft_and_encode(self, matched: MatchedRequest, max_prompt_tokens: int | None = None
                          ) -> tuple[InputPlan, float]:
        """:func:`~gyre.proxy.tito_input.draft_input`, the encoding of its texts and
        :meth:`~gyre.proxy.tito_input.InputPlan.join` (in a worker thread: reads only ``matched``
        and the renderer): ``(plan, encoding seconds)``."""
        plan = draft_input(self.renderer, matched, max_prompt_tokens)
        t = time.perf_counter()
        enc = self._encode(plan, max_prompt_tokens)
        encode_s = time.perf_counter() - t
        plan.join(enc)
        return plan, encode_s

    def _match(self, request: ChatRequest) -> MatchedRequest:
        """Restore and match ``request`` against the session's state (on the state's thread)."""
        messages, ident, restored = self.restore(request.messages)
        header = self.header_key(request)
        keys, path = self._walk(header, messages, ident)
        _, starts_in_reasoning = self._gen_prompt(request.template_kwargs)
        outputs = {ci: self.outputs[ci] for ci in ident if ci is not None}
        m = MatchedRequest(request, messages, ident, keys, path, [nd.end for nd in path], outputs, header,
                           restored, starts_in_reasoning)
        depth = m.deepest_cut()
        if depth > 0:
            m.prefix = (depth, *self._record_prefix(path[depth - 1].ref, m.ends[depth - 1]))
        return m

    def _complete(self, plan: InputPlan, matched: MatchedRequest) -> PreparedInput:
        """Put the stored tokens up to the plan's anchor before its joined new ones and assemble
        the input (on the state's thread)."""
        if plan.path:
            anchor = plan.path[-1]
            if matched.prefix is not None and matched.prefix[0] == len(plan.path):
                _, pieces, buffer = matched.prefix
            else:
                pieces, buffer = self._record_prefix(anchor.ref, plan.anchor_end)
            plan.set_prefix(pieces, anchor.close, buffer)
        return plan.finish()

    def _walk(self, header: Hashable, messages: list[Message], ident: list[int | None]) -> tuple[list, list]:
        """Match the messages against the trie: ``(keys, path)``. An output identified by its
        content alone may be another output with the same content (an agent that says the same
        thing twice); where the trie continues with such a sibling output instead, that one is
        taken (``messages`` and ``ident`` are updated in place)."""
        keys: list[Hashable] = [("out", ci) if ci is not None else trie_key(m) for m, ci in zip(messages, ident)]
        path: list[TrieNode] = []
        node = self._root.children.get(header)
        if node is not None:
            path.append(node)
            for i, k in enumerate(keys):
                nxt = node.children.get(k)
                if nxt is None and ident[i] is not None:
                    alt = self.outputs.same_output_child(node, messages[i])
                    if alt is not None:
                        orig, m = self.outputs[alt].message, messages[i]
                        messages[i] = Message(m.role, orig.content, orig.reasoning, m.tool_calls, m.tool_call_id,
                                              m.is_error, m.item_ids)
                        ident[i], keys[i] = alt, ("out", alt)
                        nxt = node.children[keys[i]]
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
        return keys, path

    # ------------------------------------------------------------------ commit
    def release(self) -> None:
        """Drop the message trie, the output index and the caches (the execution is over): the
        trie's parent/child links are cut so that reference counting frees it at once, without
        waiting for a full collection of the cyclic garbage collector. ``tree`` is kept."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.children = {}
            node.parent = None
        self._root = TrieNode(None, None)
        for d in (self._recent, self._undelivered, self._gen_cache):
            d.clear()
        self.outputs.clear()

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
        shared = prepared.buffer is not None and rec.input_ids is prepared.input_ids
        self.tree.insert(rec, share_input=shared, replaces=prepared.replaced if shared else None)
        if shared:
            prepared.buffer.copied_from = None  # the tree moved what it could
        self._next_call += 1
        st = self.stats
        st.calls += 1
        st.reused_tokens += prepared.reused_tokens
        st.rendered_tokens += prepared.rendered_tokens
        st.restored_tool_calls += prepared.restored_calls
        st.identified_outputs += sum(1 for x in prepared.identified if x is not None)
        out_ids = rec.output_ids
        # a record whose whole input this one continues (same thread) leaves the cache
        base = self._recent.get(prepared.path[-1].ref) if prepared.path else None
        if base is not None and prepared.path[-1].end >= base[0].shape[0]:
            del self._recent[prepared.path[-1].ref]
        self._remember(ci, (rec.input_ids, rec.input_provenance, out_ids, rec.output_provenance_value(),
                            prepared.buffer if shared else None))
        # trie: the matched path now (also) lives in this record
        node = self._root
        for nd in prepared.path:
            nd.ref = ci
            node = nd
        for p in prepared.pending:
            child = node.children.get(p.key)
            if child is None:
                child = TrieNode(p.key, node)
                child.end = p.end
                child.close = p.close
                child.is_output = p.is_output
                node.children[p.key] = child
            if child.end == p.end or child.end < 0:
                child.end = p.end
                child.ref = ci
            node = child
        if delivered and output_message is None:
            return
        gs = prepared.gen_start if prepared.gen_start >= 0 else rec.num_input_tokens
        stop_end = out_ids.shape[0] > 0 and int(out_ids[-1]) in self.renderer.stop_ids
        close = list(self.renderer.after_eos_ids) if stop_end else list(self.renderer.close_ids)
        late = (node, rec.num_input_tokens, rec.input_ids[gs:].copy(), out_ids.copy(), close,
                rec.output_provenance_value())
        if delivered:
            self._keep_output(ci, late, output_message)
        else:  # a client retry may still receive it (mark_delivered)
            self._undelivered[ci] = late
            while len(self._undelivered) > self._undelivered_max:
                self._undelivered.popitem(last=False)

    def mark_delivered(self, call_index: int, output_message: Message) -> None:
        """The answer of record ``call_index``, committed undelivered, reached the harness after
        all (``output_message``: as returned, ids assigned): the tree marks the record delivered
        (:meth:`~gyre.trajectory.tree.TrajectoryTree.mark_delivered`), and the output is kept for
        restoration as a delivered one is, so that the next request echoing it extends it. The
        caller has made the mark durable first. The last ``undelivered_kept`` undelivered
        records can be restored so; an older one is only marked in the tree.

        Raises:
            KeyError: no record ``call_index``; ValueError: it is delivered already.
        """
        self.tree.mark_delivered(call_index)
        late = self._undelivered.pop(call_index, None)
        if late is not None:
            self._keep_output(call_index, late, output_message)

    def _keep_output(self, ci: int, late: tuple, output_message: Message) -> None:
        """Keep delivered output ``ci`` for restoration: the output index and its trie node
        (a child of the trie node of its request's last message)."""
        node, n_in, open_ids, out_ids, close, out_prov = late
        self.outputs.add(OutputEntry(ci, output_message, open_ids, out_ids, close, out_prov))
        out_node = node.children.get(("out", ci))
        if out_node is None:
            out_node = TrieNode(("out", ci), node)
            node.children[("out", ci)] = out_node
        out_node.end = n_in + out_ids.shape[0]
        out_node.ref = ci
        out_node.close = close
        out_node.is_output = True
