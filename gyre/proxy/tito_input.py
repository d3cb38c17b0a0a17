"""The data of TITO input assembly: what :class:`~gyre.proxy.tito.TitoSession` keeps between
requests and what it hands to the server for one request.

* :class:`TrieNode` -- a node of an execution's *message trie*: the first level is keyed by
  tools + template kwargs, each deeper level by one message (:func:`trie_key`: its role and a
  64-bit hash of its :meth:`~gyre.proxy.messages.Message.key`, so the trie keeps no message
  text; or ``("out", call_index)`` for an output the proxy returned). A node at a cuttable
  boundary points at a stored record and an offset into its ``input ++ output`` tokens.
* :class:`OutputEntry` -- a delivered output, kept so that a later request echoing it gets
  the sampled tokens spliced back in.
* :class:`InputPlan` -- one request's input before encoding: stored token slices (with their
  provenance) and texts still to encode, in order, plus the trie nodes to create at commit
  (:class:`PendingNode`). :meth:`InputPlan.finish` turns it into a :class:`PreparedInput`:
  ``input_ids``, provenance, reuse counts and what commit needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from gyre.proxy.context_buffer import ContextBuffer, write_input
from gyre.proxy.messages import Message
from gyre.trajectory.records import Provenance

__all__ = ["OutputEntry", "TrieNode", "PendingNode", "PreparedInput", "TextRef", "InputPlan", "EXTERNAL", "POLICY",
           "trie_key"]

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
    """A request's input before encoding: token arrays (with provenance) and texts, in order;
    trie nodes to create, with their boundaries as part counts."""

    def __init__(self, request, messages, ident, restored, starts_in_reasoning, path) -> None:
        self.request, self.messages, self.ident = request, messages, ident
        self.restored, self.starts_in_reasoning, self.path = restored, starts_in_reasoning, path
        self.parts: list[tuple[Any, np.ndarray | None]] = []  # (array | TextRef, provenance | None)
        self.texts: list[str] = []
        self.pending: list[list[Any]] = []  # [key, is_output, close, cuttable, after_parts]
        self.reused = 0
        self.gen_start = -1
        #: the context buffer whose first ``keep`` tokens are the first part (see ``continue_buffer``)
        self.buffer: ContextBuffer | None = None
        self.keep = 0

    def continue_buffer(self, buffer: ContextBuffer | None, keep: int) -> None:
        """The first part added was ``buffer.ids[:keep]``: write the input after it, in place
        where nothing else was written there (:func:`~gyre.proxy.context_buffer.write_input`)."""
        self.buffer, self.keep = buffer, keep

    def text(self, text: str) -> TextRef:
        self.texts.append(text)
        return TextRef(len(self.texts) - 1)

    def add(self, ids: np.ndarray, prov: np.ndarray) -> None:
        self.parts.append((ids, prov))

    def add_ext(self, ids: np.ndarray) -> None:
        self.parts.append((ids, None))

    def add_part(self, ref: Any) -> None:
        self.parts.append((ref, None))

    def pend(self, key, is_output: bool, close: list[int], cut: bool) -> None:
        self.pending.append([key, is_output, close, cut, len(self.parts)])

    def known_len(self) -> int:
        return sum(p[0].shape[0] for p in self.parts)

    def finish(self, encoded: list[list[int]]) -> PreparedInput:
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
        pending = []
        for key, is_output, close, cut, after in self.pending:
            end = ends[after] if cut else -1  # an identified output's boundary is before its close
            pending.append(PendingNode(key, end, close, is_output))
        input_ids, input_prov, buffer, replaced = write_input(ids_parts, prov_parts, self.buffer, self.keep)
        return PreparedInput(
            input_ids=input_ids,
            input_provenance=input_prov,
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
            buffer=buffer,
            replaced=replaced,
        )
