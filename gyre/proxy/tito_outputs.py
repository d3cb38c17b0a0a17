"""The delivered outputs of one execution, indexed for restoration (part of TITO, :mod:`gyre.proxy.tito`).

A harness sends the proxy's earlier outputs back in later requests, not always as they were
returned: a tool call's arguments re-serialised, the reasoning dropped. :class:`OutputIndex`
keeps each delivered output (an :class:`~gyre.proxy.tito_input.OutputEntry`) by its tool-call
ids, its item ids and its content key, and :meth:`OutputIndex.restore` finds the output an
assistant message echoes:

* a tool call whose id the proxy returned gets its original argument text back when the
  incoming text is the same JSON value (compared canonically: key order and whitespace ignored,
  ``1``/``1.0``/``true`` kept apart);
* an assistant message recognised as an earlier output (by call ids, item ids or content, also
  without its reasoning when ``restore_reasoning``) is *identified* with it.

It is read and written on the session's thread only.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Hashable

from gyre.proxy.messages import ROLE_ASSISTANT, Message, ToolCall
from gyre.proxy.tito_input import OutputEntry, TrieNode

__all__ = ["OutputIndex", "canonical_json"]


def canonical_json(text: str) -> str | None:
    """Canonical form of a JSON text (sorted keys, no whitespace), ``None`` if not JSON."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


class OutputIndex:
    """The delivered outputs of one execution by call index, tool-call id, item id and content.

    Args:
        restore_reasoning: identify an output whose reasoning the harness dropped.
    """

    def __init__(self, restore_reasoning: bool = True) -> None:
        self.restore_reasoning = restore_reasoning
        #: call index -> the delivered output kept for restoration
        self.outputs: dict[int, OutputEntry] = {}
        self._by_call_id: dict[str, tuple[int, int]] = {}
        self._by_item_id: dict[str, int] = {}
        self._by_key: dict[Hashable, int] = {}
        self._by_key_noreason: dict[Hashable, int] = {}
        self._canon_cache: OrderedDict[str, str | None] = OrderedDict()

    def __getitem__(self, call_index: int) -> OutputEntry:
        return self.outputs[call_index]

    def add(self, entry: OutputEntry) -> None:
        """Keep delivered output ``entry`` (its message as returned, ids assigned) and index it."""
        ci, output_message = entry.call_index, entry.message
        self.outputs[ci] = entry
        for k, tc in enumerate(output_message.tool_calls):
            if tc.id:
                self._by_call_id[tc.id] = (ci, k)
        for iid in output_message.item_ids:
            self._by_item_id[iid] = ci
        key = output_message.key()
        self._by_key[key] = ci
        self._by_key_noreason[key[:2] + key[3:]] = ci

    def clear(self) -> None:
        """Forget every output (the execution is over)."""
        for d in (self.outputs, self._by_call_id, self._by_item_id, self._by_key, self._by_key_noreason,
                  self._canon_cache):
            d.clear()

    def canon(self, text: str) -> str | None:
        """:func:`canonical_json` of ``text``, from a cache of the last 4,096 texts."""
        c = self._canon_cache.get(text, False)
        if c is False:
            c = canonical_json(text)
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
            changed = False
            for i, tc in enumerate(calls):
                hit = self._by_call_id.get(tc.id) if tc.id else None
                if hit is None:
                    continue
                ci, k = hit
                cands.add(ci)
                orig = self.outputs[ci].message.tool_calls[k]
                if orig.arguments != tc.arguments and orig.name == tc.name:
                    a, b = self.canon(orig.arguments), self.canon(tc.arguments)
                    if a is not None and a == b:
                        calls[i] = ToolCall(tc.id, tc.name, orig.arguments, orig.kind, tc.item_id)
                        restored += 1
                        changed = True
            for iid in m.item_ids:
                ci = self._by_item_id.get(iid)
                if ci is not None:
                    cands.add(ci)
            if changed:
                m = Message(m.role, m.content, m.reasoning, tuple(calls), m.tool_call_id, m.is_error, m.item_ids)
            key = m.key()
            if not cands:
                ci = self._by_key.get(key)
                if ci is None and self.restore_reasoning and not m.reasoning:
                    ci = self._by_key_noreason.get(key[:2] + key[3:])
                if ci is not None:
                    cands.add(ci)
            hit_ci: int | None = None
            for ci in sorted(cands, reverse=True) if cands else ():
                if self.echoes(ci, m, key):
                    hit_ci = ci
                    break
            if hit_ci is not None:
                orig = self.outputs[hit_ci].message
                m = Message(m.role, orig.content, orig.reasoning, m.tool_calls, m.tool_call_id, m.is_error, m.item_ids)
            out.append(m)
            ident.append(hit_ci)
        return out, ident, restored

    def echoes(self, call_index: int, message: Message, key: tuple) -> bool:
        """``message`` (whose :meth:`~gyre.proxy.messages.Message.key` is ``key``) echoes output
        ``call_index``: the same key, or the same without reasoning when ``restore_reasoning``."""
        ek = self.outputs[call_index].message.key()
        return ek == key or (self.restore_reasoning and not message.reasoning and ek[:2] + ek[3:] == key[:2] + key[3:])

    def same_output_child(self, node: TrieNode, message: Message) -> int | None:
        """The call index of an output child of ``node`` that ``message`` echoes (same key, or
        the same without reasoning when ``restore_reasoning``), or ``None``."""
        key = message.key()
        for k in node.children:
            if isinstance(k, tuple) and len(k) == 2 and k[0] == "out" and k[1] in self.outputs:
                if self.echoes(k[1], message, key):
                    if all(not tc.id or self._by_call_id.get(tc.id, (None,))[0] in (None, k[1])
                           for tc in message.tool_calls):
                        return k[1]
        return None
