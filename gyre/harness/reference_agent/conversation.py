"""The reference agent's message bookkeeping and compaction policy (pure, deterministic).

:class:`Conversation` is one context: the OpenAI Chat Completions ``messages`` list exactly as
it will be sent (assistant messages kept as the server returned them, tool-call ``arguments``
byte for byte, so every request extends the previous one and the proxy reuses its tokens),
plus an estimate of its size in tokens.

:class:`CompactionPolicy` says when to compact: the agent then sends
:meth:`Conversation.compaction_request` (the same messages plus :data:`COMPACTION_PROMPT`), so
the compaction call shares the main path's prefix and appears in the trajectory tree as a branch
off it, and continues in :meth:`Conversation.compacted`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMPACTION_PROMPT",
    "COMPACTED_CONTEXT_TEMPLATE",
    "CompactionPolicy",
    "Conversation",
    "ToolCallRequest",
    "assistant_message",
    "parse_tool_calls",
]

Message = dict[str, Any]

#: The compaction request's last user message (its first words identify the role in prompts).
COMPACTION_PROMPT = (
    "Context compaction: the conversation is getting long. Write a concise summary of the work so far for "
    "yourself to continue from: the task, what has been done (files created or changed, commands run and "
    "their results), what remains, and any facts needed to finish. Reply with the summary text only; "
    "do not call tools.")

#: First user message of the context that continues after a compaction.
COMPACTED_CONTEXT_TEMPLATE = (
    "This task is being continued from an earlier context that was compacted.\n\n"
    "Summary of the earlier context:\n{summary}\n\n"
    "Original task:\n{instruction}")


def _chars(message: Mapping[str, Any]) -> int:
    n = len(message.get("content") or "") if isinstance(message.get("content"), str) else len(
        json.dumps(message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        n += len(fn.get("name") or "") + len(fn.get("arguments") or "")
    n += len(message.get("reasoning_content") or "")
    return n


@dataclass(slots=True)
class Conversation:
    """One context; ``agent`` names its owner (``main``, ``sub-1``...).

    What is known about its size:

    * ``usage_tokens`` -- ``prompt_tokens + completion_tokens`` the server reported for the last
      response (the context size at that point, in the policy's tokens);
    * ``pending_chars`` -- characters appended since (tool results, user messages).

    :meth:`context_tokens` = ``usage_tokens + ceil(pending_chars / chars_per_token)``, or
    ``ceil(total_chars / chars_per_token)`` before the first response.
    """

    messages: list[Message]
    usage_tokens: int | None = None
    pending_chars: int = 0
    total_chars: int = 0
    agent: str = "main"
    compactions: int = 0

    @classmethod
    def start(cls, system: str | None, user: str, *, agent: str = "main", compactions: int = 0) -> "Conversation":
        msgs: list[Message] = []
        if system:
            msgs.append({"role": "system", "content": system})
        msgs.append({"role": "user", "content": user})
        conv = cls(msgs, agent=agent, compactions=compactions)
        conv.total_chars = sum(_chars(m) for m in msgs)
        conv.pending_chars = conv.total_chars
        return conv

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    def _append(self, m: Message) -> None:
        self.messages.append(m)
        c = _chars(m)
        self.total_chars += c
        self.pending_chars += c

    def add_assistant(self, message: Message, usage_tokens: int | None = None) -> None:
        """Append the server's assistant message; ``usage_tokens`` resets the size estimate."""
        self.messages.append(message)
        self.total_chars += _chars(message)
        if usage_tokens is not None and usage_tokens > 0:
            self.usage_tokens = int(usage_tokens)
            self.pending_chars = 0
        else:
            self.pending_chars += _chars(message)

    def add_tool_result(self, call_id: str, content: str) -> None:
        self._append({"role": "tool", "tool_call_id": call_id, "content": content})

    def add_user(self, content: str) -> None:
        self._append({"role": "user", "content": content})

    def context_tokens(self, chars_per_token: float = 4.0) -> int:
        """Estimated context size in tokens (module docstring)."""
        if self.usage_tokens is None:
            return math.ceil(self.total_chars / chars_per_token)
        return self.usage_tokens + math.ceil(self.pending_chars / chars_per_token)

    def compaction_request(self, prompt: str = COMPACTION_PROMPT) -> list[Message]:
        """The messages of the compaction call: this context plus the compaction prompt."""
        return [*self.messages, {"role": "user", "content": prompt}]

    def compacted(self, summary: str, instruction: str,
                  template: str = COMPACTED_CONTEXT_TEMPLATE) -> "Conversation":
        """The new context after a compaction: same system prompt, one user message with the
        summary and the original instruction."""
        return Conversation.start(self.system, template.format(summary=summary.strip(), instruction=instruction),
                                  agent=self.agent, compactions=self.compactions + 1)


@dataclass(slots=True, frozen=True)
class CompactionPolicy:
    """When to compact.

    When the context passes ``threshold_tokens`` the agent sends
    :meth:`Conversation.compaction_request` -- the *same* messages plus a user message with
    :data:`COMPACTION_PROMPT` (same tools, ``tool_choice: "none"``, header ``X-Gyre-Role:
    compaction``) -- then continues in :meth:`Conversation.compacted`: a new context (same
    system prompt) whose first user message carries the summary and the original task.

    * ``threshold_tokens`` -- compact when the context exceeds this many tokens (0: never);
    * ``chars_per_token`` -- the estimate for text not yet counted by the server;
    * ``min_messages`` -- never compact a context shorter than this (system + task + one turn);
    * ``max_compactions`` -- per context owner, a guard against compaction loops.

    Raises:
        ValueError: negative threshold or non-positive ``chars_per_token``.
    """

    threshold_tokens: int = 0
    chars_per_token: float = 4.0
    min_messages: int = 4
    max_compactions: int = 20

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be >= 0, got {self.threshold_tokens}")
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")

    def should_compact(self, conv: Conversation) -> bool:
        return (self.threshold_tokens > 0 and len(conv.messages) >= self.min_messages
                and conv.compactions < self.max_compactions
                and conv.context_tokens(self.chars_per_token) > self.threshold_tokens)


@dataclass(slots=True, frozen=True)
class ToolCallRequest:
    """One tool call of an assistant message: ``arguments`` is the raw JSON text; ``args`` the
    parsed mapping, or ``None`` with ``error`` saying why it could not be parsed."""

    id: str
    name: str
    arguments: str
    args: dict[str, Any] | None
    error: str | None = None


def assistant_message(message: Mapping[str, Any]) -> Message:
    """The assistant message to keep in the context, from a response's ``choices[0].message``:
    ``role``, ``content``, ``tool_calls`` (as returned) and ``reasoning_content`` if present."""
    out: Message = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = [dict(c) for c in message["tool_calls"]]
    return out


def parse_tool_calls(message: Mapping[str, Any]) -> list[ToolCallRequest]:
    """The tool calls of an assistant message (arguments parsed; bad JSON kept as an error)."""
    out = []
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        name = str(fn.get("name") or "")
        text = fn.get("arguments")
        if isinstance(text, Mapping):  # tolerate servers that send an object
            text = json.dumps(text)
        text = text if isinstance(text, str) else ""
        args, err = None, None
        try:
            parsed = json.loads(text) if text.strip() else {}
            if isinstance(parsed, dict):
                args = parsed
            else:
                err = f"arguments must be a JSON object, got {type(parsed).__name__}"
        except json.JSONDecodeError as exc:
            err = f"arguments are not valid JSON: {exc.msg}"
        out.append(ToolCallRequest(str(call.get("id") or f"call_{i}"), name, text, args, err))
    return out
