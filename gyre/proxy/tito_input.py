"""The data of TITO input assembly: what :class:`~gyre.proxy.tito.TitoSession` keeps between
requests and what it hands to the server for one request.

* :class:`TrieNode` -- a node of an execution's *message trie*: the first level is keyed by
  tools + template kwargs, each deeper level by one message (:func:`trie_key`: its role and a
  64-bit hash of its :meth:`~gyre.proxy.messages.Message.key`, so the trie keeps no message
  text; or ``("out", call_index)`` for an output the proxy returned). A node at a cuttable
  boundary points at a stored record and an offset into its ``input ++ output`` tokens.
* :class:`OutputEntry` -- a delivered output, kept so that a later request echoing it gets
  the sampled tokens spliced back in.
* :class:`MatchedRequest` -- what the session read from its state for one request (restored
  messages, the matched trie path, the identified outputs): all :func:`draft_input` needs.
* :func:`draft_input` -- the pure part of assembly: backs off to the deepest cuttable boundary the
  new messages render after and renders them (:mod:`gyre.proxy.render`). It reads nothing but its
  :class:`MatchedRequest` and the renderer, so it may run off the event loop. Given the prompt's
  token limit, it does not copy out a text whose piece bound alone proves the input too long
  (:meth:`InputPlan.text_span`); encoding that plan then refuses it at once.
* :class:`InputPlan` -- one request's input before encoding: the new messages' texts still to
  encode and the spliced outputs' token arrays (with their provenance), in order, plus the trie
  nodes to create at commit (:class:`PendingNode`). :meth:`InputPlan.join` joins the new tokens
  into one array (pure), :meth:`InputPlan.set_prefix` puts the stored tokens before them, and
  :meth:`InputPlan.finish` turns it into a :class:`PreparedInput`: ``input_ids``, provenance,
  reuse counts and what commit needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from gyre.proxy.context_buffer import ContextBuffer, write_input
from gyre.proxy.messages import ChatRequest, Message
from gyre.proxy.piece_encode import PieceEncoder, PromptTooLong
from gyre.proxy.render import ChatRenderer, RenderError
from gyre.trajectory.records import Provenance

__all__ = ["OutputEntry", "TrieNode", "PendingNode", "PreparedInput", "TextRef", "InputPlan", "MatchedRequest",
           "draft_input", "EXTERNAL", "POLICY", "trie_key"]

#: Provenance values (``int8``) of template tokens and of sampled tokens.
EXTERNAL = int(Provenance.EXTERNAL)
POLICY = int(Provenance.POLICY)


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
    output_provenance: int = POLICY


def trie_key(message: Message) -> Hashable:
    """Trie key of a message the proxy did not return: ``(role, len(content), hash(key))``.

    Two messages with equal :meth:`~gyre.proxy.messages.Message.key` (same rendering) get the
    same trie key. Two different ones at the same trie position share one only on a 64-bit
    hash collision (about 2**-64 per pair; the hash is the process's, never stored).
    """
    return (message.role, len(message.content), hash(message.key()))


class TrieNode:
    """Message-trie node. ``end`` >= 0: a cuttable boundary after ``end`` tokens of record
    ``ref``'s ``input ++ output`` path (-1: not cuttable); ``close``: tokens appended when a
    history continues after this node (output nodes only)."""

    __slots__ = ("key", "parent", "children", "ref", "end", "close", "is_output")

    def __init__(self, key: Hashable, parent: "TrieNode | None") -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, TrieNode] = {}
        self.ref = -1
        self.end = -1
        self.close: list[int] = []
        self.is_output = False


@dataclass(slots=True)
class PendingNode:
    """A trie node to create at commit: key, end offset (-1 = not cuttable), close."""

    key: Hashable
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
    * ``buffer`` -- the :class:`~gyre.proxy.context_buffer.ContextBuffer` whose prefix
      ``input_ids`` is; ``replaced`` -- the array its first tokens were copied from (a full
      buffer, or the tree's views when the record was read back from it), whose views the tree
      may move to ``buffer``; else ``None``.
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
    path: list[TrieNode] = field(default_factory=list)
    pending: list[PendingNode] = field(default_factory=list)
    tool_kinds: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    buffer: ContextBuffer | None = None
    replaced: np.ndarray | None = None


class TextRef:
    """Placeholder for a text whose tokens are encoded later (index into ``InputPlan.texts``)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class InputPlan:
    """A request's input before encoding: the stored prefix (:meth:`set_prefix`), then token arrays
    (with provenance) and texts, in order; trie nodes to create, with their boundaries as part
    counts. ``path`` is the matched trie path down to the anchor (the boundary the new messages
    render after), ``anchor_end`` the anchor's token offset when it was matched."""

    def __init__(self, request, messages, ident, restored, starts_in_reasoning, path, anchor_end: int = 0,
                 pieces: PieceEncoder | None = None, max_tokens: int | None = None) -> None:
        self.request, self.messages, self.ident = request, messages, ident
        self.restored, self.starts_in_reasoning, self.path = restored, starts_in_reasoning, path
        self.anchor_end = anchor_end
        #: stored tokens before ``parts`` (``set_prefix``)
        self.prefix: list[tuple[np.ndarray, np.ndarray | None]] = []
        self.parts: list[tuple[Any, np.ndarray | None]] = []  # (array | TextRef, provenance | None)
        self.texts: list[str] = []
        self.pending: list[list[Any]] = []  # [key, is_output, close, cuttable, after_parts]
        self.reused = 0
        self.gen_start = -1
        #: with both, :meth:`text_span` looks for a text that alone makes the input longer than
        #: ``max_tokens`` (:meth:`~gyre.proxy.piece_encode.PieceEncoder.over_by_bound`)
        self.pieces, self.max_tokens = pieces, max_tokens
        #: tokens the input certainly has, more than ``max_tokens``, once :meth:`text_span` found
        #: them (0: not found)
        self.over = 0
        # set by ``join``
        self.rendered = 0
        self.new_ids, self.new_prov = np.zeros(0, np.int32), np.zeros(0, np.int8)
        self.nodes: list[PendingNode] = []
        self.gen_end = -1
        #: the context buffer whose first ``keep`` tokens are the first prefix piece (see ``set_prefix``)
        self.buffer: ContextBuffer | None = None
        self.keep = 0

    def set_prefix(self, pieces: list[tuple[np.ndarray, np.ndarray]], close: list[int],
                   buffer: ContextBuffer | None) -> None:
        """The stored tokens the input starts with: ``pieces`` (``(ids, provenance)``) of a stored
        record, then the template's ``close`` tokens (``EXTERNAL``). With ``buffer``, the first
        piece is ``buffer.ids[:n]``: the input is written after it, in place where nothing else was
        written there (:func:`~gyre.proxy.context_buffer.write_input`)."""
        self.prefix = list(pieces)
        if buffer is not None:
            self.buffer, self.keep = buffer, int(pieces[0][0].shape[0])
        if close:
            self.prefix.append((np.asarray(close, np.int32), None))
        self.reused = sum(int(p[0].shape[0]) for p in self.prefix)

    def text(self, text: str) -> TextRef:
        self.texts.append(text)
        return TextRef(len(self.texts) - 1)

    def text_span(self, text: str, start: int, end: int) -> TextRef:
        """:meth:`text` of ``text[start:end]``, read in place first when the plan has ``pieces`` and
        ``max_tokens``: where a piece of it has more tokens than ``max_tokens`` less the fixed
        tokens so far, by the bound the encoder checks before encoding that piece, encoding the
        complete plan raises :class:`~gyre.proxy.piece_encode.PromptTooLong` there or before; then
        :attr:`over` is set, and this text and every later one are kept as ``""``, never encoded."""
        if (self.pieces is not None and self.max_tokens is not None and not self.over
                and end - start > 2 * self.pieces.piece_chars):  # a shorter text has no piece to bound
            fixed = self.fixed_tokens()
            found = self.pieces.over_by_bound(text, self.max_tokens - fixed, start, end)
            if found:
                self.over = fixed + found
        return self.text("" if self.over else text[start:end])

    def raise_if_over(self) -> None:
        """Raise :class:`~gyre.proxy.piece_encode.PromptTooLong` (a 400) when :meth:`text_span` found
        the input longer than ``max_tokens``: the verdict encoding the plan would reach."""
        if self.over:
            raise PromptTooLong(self.over, self.max_tokens)

    def add(self, ids: np.ndarray, prov: np.ndarray) -> None:
        self.parts.append((ids, prov))

    def add_ext(self, ids: np.ndarray) -> None:
        self.parts.append((ids, None))

    def add_part(self, ref: Any) -> None:
        self.parts.append((ref, None))

    def pend(self, key, is_output: bool, close: list[int], cut: bool) -> None:
        self.pending.append([key, is_output, close, cut, len(self.parts)])

    def fixed_tokens(self) -> int:
        """Tokens of the input that are not in :attr:`texts`: the stored tokens up to the anchor,
        the anchor's close and the spliced token arrays."""
        stored = self.anchor_end + len(self.path[-1].close) if self.path else 0
        return stored + sum(int(obj.shape[0]) for obj, _ in self.parts if not isinstance(obj, TextRef))

    def join(self, encoded: list[Any]) -> None:
        """Join the parts after the prefix into one token array and one provenance array
        (``encoded[i]``: the tokens of ``texts[i]``), with the trie nodes to create, their ends
        counted from the first new token. Pure (reads only the plan): may run in a worker thread."""
        ids_parts: list[np.ndarray] = []
        prov_parts: list[np.ndarray] = []
        ends = [0]
        rendered = 0
        for obj, prov in self.parts:
            if isinstance(obj, TextRef):
                arr = np.asarray(encoded[obj.index], np.int32)
                rendered += arr.shape[0]
            else:
                arr = obj
            ids_parts.append(arr)
            prov_parts.append(prov if prov is not None else np.full(arr.shape[0], EXTERNAL, np.int8))
            ends.append(ends[-1] + arr.shape[0])
        self.rendered = rendered
        self.new_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
        self.new_prov = np.concatenate(prov_parts) if prov_parts else np.zeros(0, np.int8)
        # an identified output's boundary is before its close; -1: not cuttable
        self.nodes = [PendingNode(key, ends[after] if cut else -1, close, is_output)
                      for key, is_output, close, cut, after in self.pending]
        self.gen_end = ends[self.gen_start] if self.gen_start >= 0 else -1

    def finish(self) -> PreparedInput:
        """The input: the prefix, then the joined new tokens (:meth:`join` first)."""
        off = self.reused
        for node in self.nodes:
            if node.end >= 0:
                node.end += off
        ids_parts = [p[0] for p in self.prefix] + [self.new_ids]
        prov_parts = [p[1] if p[1] is not None else np.full(p[0].shape[0], EXTERNAL, np.int8)
                      for p in self.prefix] + [self.new_prov]
        input_ids, input_prov, buffer, replaced = write_input(ids_parts, prov_parts, self.buffer, self.keep)
        return PreparedInput(
            input_ids=input_ids,
            input_provenance=input_prov,
            reused_tokens=self.reused,
            rendered_tokens=self.rendered,
            messages=self.messages,
            identified=self.ident,
            restored_calls=self.restored,
            starts_in_reasoning=self.starts_in_reasoning,
            gen_start=off + self.gen_end if self.gen_end >= 0 else -1,
            path=self.path,
            pending=self.nodes,
            tool_kinds=dict(self.request.tool_kinds),
            buffer=buffer,
            replaced=replaced,
        )


@dataclass(slots=True)
class MatchedRequest:
    """One request as matched against an execution's state (``TitoSession``'s restore and trie
    walk, on the event loop): the restored ``messages``, per message the identified output's call
    index (``ident``) and trie key (``keys``), the matched trie ``path`` (header node first) with
    each node's ``end`` when matched (``ends``), the identified ``outputs``, the ``header`` key,
    the count of ``restored`` tool calls and whether the generation prompt opens a think block;
    ``prefix``: the stored tokens up to the deepest cuttable node, read when matched
    (``(depth, [(ids, provenance)...], context buffer or None)``), or ``None``.
    Nothing here is changed by a later commit: ``ends`` are copies, stored tokens, outputs and
    messages are never modified once made."""

    request: ChatRequest
    messages: list[Message]
    ident: list[int | None]
    keys: list[Hashable]
    path: list[TrieNode]
    ends: list[int]
    outputs: dict[int, OutputEntry]
    header: Hashable
    restored: int
    starts_in_reasoning: bool
    prefix: tuple | None = None

    def new_messages(self) -> int:
        """Messages after the deepest matched node: the fewest the request renders."""
        return len(self.messages) - max(0, len(self.path) - 1)

    def deepest_cut(self) -> int:
        """The depth of the deepest cuttable matched node (0: none)."""
        depth = len(self.path)
        while depth > 0 and self.ends[depth - 1] < 0:
            depth -= 1
        return depth


def draft_input(renderer: ChatRenderer, m: MatchedRequest, max_tokens: int | None = None) -> InputPlan:
    """Plan the input of a matched request after its deepest cuttable boundary that the new
    messages render after, backing off one boundary at a time where they do not. The plan's
    texts are not encoded and its stored prefix is not set (:meth:`InputPlan.set_prefix`).
    With ``max_tokens`` (the limit its encoding will be given), a plan whose text alone proves
    the input longer has :attr:`InputPlan.over` set instead of that text (:meth:`InputPlan.text_span`).

    Pure: reads only ``m`` and ``renderer``, so it may run in a worker thread.

    Raises:
        RenderError: the template cannot render the messages even from the start.
    """
    depth = m.deepest_cut()
    while True:
        while depth > 0 and m.ends[depth - 1] < 0:
            depth -= 1
        try:
            return _draft_at(renderer, m, depth, max_tokens)
        except RenderError:
            if depth == 0:
                raise
            depth -= 1


def _draft_at(renderer: ChatRenderer, m: MatchedRequest, depth: int, max_tokens: int | None = None) -> InputPlan:
    """The plan for ``m`` with the new messages rendered after ``m.path[depth - 1]``.

    Raises:
        RenderError: the continuation does not render after that node.
    """
    messages, ident, keys, request = m.messages, m.ident, m.keys, m.request
    plan = InputPlan(request, messages, ident, m.restored, m.starts_in_reasoning, m.path[:depth],
                     m.ends[depth - 1] if depth > 0 else 0, renderer.pieces, max_tokens)
    # path[0] is the header node, path[k] the node of messages[k - 1]: with depth d >= 1
    # messages[d - 1:] are new; depth 0 (no header either) renders everything.
    first_new = max(0, depth - 1)
    # the message before the first new one (path[depth - 1] is its node; same key, same rendering)
    prev: Message | None = None
    if depth > 1:
        ci = ident[depth - 2]
        prev = messages[depth - 2] if ci is None else m.outputs[ci].message
    if depth == 0:
        plan.pend(m.header, False, [], cut=True)
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
            d = renderer.render_delta(prev, run, request.tools if prev is None else None, add_generation_prompt=last,
                                      template_kwargs=kw, encode=plan.text, encode_span=plan.text_span)
            for seg in d.segments:
                plan.add_part(seg.ids)
                for mi in range(seg.first, seg.last + 1):
                    plan.pend(keys[i + mi], False, [], cut=mi == seg.last)
            if last:
                plan.gen_start = len(plan.parts)
                if isinstance(d.gen_ids, TextRef):
                    plan.add_part(d.gen_ids)
                if d.gen_in_last and plan.pending:
                    plan.pending[-1][3] = False
                break
            if run:
                prev = run[-1]
        e = m.outputs[ident[j]]  # type: ignore[index]  # splice the identified output
        plan.add_ext(e.open_ids)
        plan.add(e.output_ids, np.full(e.output_ids.shape[0], e.output_provenance, np.int8))
        plan.pend(keys[j], True, list(e.close_ids), cut=True)
        if e.close_ids:
            plan.add_ext(np.asarray(e.close_ids, np.int32))
        prev = e.message
        i = j + 1
    return plan
