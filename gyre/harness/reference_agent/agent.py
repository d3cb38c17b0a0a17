"""The reference agent loop: main agent, automatic compaction, sub-agent delegation.

One turn: (compact first if the :class:`~.conversation.CompactionPolicy` says so) -> one chat
completion with the agent's tools -> the assistant message is appended verbatim -> each tool
call runs and its result is appended. A reply without tool calls is the final answer.

Roles (declared to the proxy by :data:`gyre.harness.reference.ReferenceHarness.roles`):
every request carries ``X-Gyre-Harness: reference``, ``X-Gyre-Role`` (``main``, ``subagent``,
``compaction``) and ``X-Gyre-Agent-Id`` (``main``, ``sub-1``, ...). The compaction request's
last user message starts with ``Context compaction:``; a sub-agent's system prompt starts
with ``You are a sub-agent``.

Sub-agents (tool ``delegate``): a fresh context (sub-agent system prompt + the task text),
the same tools minus ``delegate``, at most ``max_subagent_turns`` turns; its final answer is
the tool result. Sub-agents compact under the same policy.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from gyre.harness.reference_agent.client import ChatClient, ContextTooLong
from gyre.harness.reference_agent.conversation import (
    CompactionPolicy,
    Conversation,
    assistant_message,
    parse_tool_calls,
)
from gyre.harness.reference_agent.tools import ALL_TOOLS, TOOL_SCHEMAS, Toolbox

__all__ = ["AgentConfig", "AgentResult", "ReferenceAgent", "DEFAULT_SYSTEM_PROMPT", "SUBAGENT_SYSTEM_PROMPT"]

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent working in a workspace directory. Use the tools to inspect and change files and to "
    "run commands. When the task is done, reply with a short final answer and no tool call.")
SUBAGENT_SYSTEM_PROMPT = (
    "You are a sub-agent. Solve the sub-task you are given with the tools, then reply with a short final "
    "answer (no tool call) that reports the result.")


@dataclass(slots=True)
class AgentConfig:
    """Settings of one agent run.

    * ``tools`` -- tool names offered (subset of :data:`~.tools.ALL_TOOLS`);
    * ``max_turns`` / ``max_subagent_turns`` -- model calls of the main agent / each sub-agent
      (compaction calls not counted);
    * ``compaction`` -- the policy (threshold in tokens; 0 disables);
    * ``max_tokens`` / ``temperature`` -- sent when set;
    * ``system_prompt`` -- ``None`` for :data:`DEFAULT_SYSTEM_PROMPT`, ``""`` for none.
    """

    model: str = "gyre-policy"
    tools: Sequence[str] = ALL_TOOLS
    max_turns: int = 30
    max_subagent_turns: int = 10
    compaction: CompactionPolicy = field(default_factory=CompactionPolicy)
    max_tokens: int | None = None
    temperature: float | None = None
    system_prompt: str | None = None
    subagent_system_prompt: str = SUBAGENT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        unknown = [t for t in self.tools if t not in ALL_TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown} (known: {', '.join(ALL_TOOLS)})")
        if self.max_turns < 1 or self.max_subagent_turns < 1:
            raise ValueError("max_turns and max_subagent_turns must be >= 1")


@dataclass(slots=True)
class AgentResult:
    """``final`` answer (``None`` when the turn limit was hit), ``turns`` of the main agent,
    ``stop`` (``final`` | ``max_turns``), counters of the whole run."""

    final: str | None
    stop: str
    turns: int
    model_calls: int = 0
    compactions: int = 0
    subagents: int = 0
    tool_calls: int = 0


class ReferenceAgent:
    """Runs the loop of the module docstring against a :class:`~.client.ChatClient`.

    Args:
        transcript: a text stream receiving one JSON event per line (optional).
        clock: wall-clock seconds for the transcript (injectable).
    """

    def __init__(self, client: ChatClient, toolbox: Toolbox, config: AgentConfig, *,
                 transcript: TextIO | None = None, clock: Callable[[], float] = time.time) -> None:
        self.client, self.toolbox, self.config = client, toolbox, config
        self.transcript, self.clock = transcript, clock
        self.result = AgentResult(None, "max_turns", 0)
        self._subagents = 0

    # ------------------------------------------------------------------ plumbing

    def _event(self, event: str, **data: Any) -> None:
        if self.transcript is not None:
            self.transcript.write(json.dumps({"t": round(self.clock(), 3), "event": event, **data}) + "\n")
            self.transcript.flush()

    def _schemas(self, agent: str) -> list[dict[str, Any]]:
        names = [t for t in self.config.tools if not (t == "delegate" and agent != "main")]
        return [TOOL_SCHEMAS[t] for t in names]

    def _call(self, messages: list[dict[str, Any]], *, role: str, agent: str, tool_choice: str | None = None
              ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.config.model, "messages": messages}
        tools = self._schemas(agent)
        if tools:
            body["tools"] = tools
            if tool_choice:
                body["tool_choice"] = tool_choice
        if self.config.max_tokens is not None:
            body["max_tokens"] = self.config.max_tokens
        if self.config.temperature is not None:
            body["temperature"] = self.config.temperature
        self.result.model_calls += 1
        self._event("request", role=role, agent=agent, messages=len(messages))
        data = self.client.chat(body, headers={"X-Gyre-Harness": "reference", "X-Gyre-Role": role,
                                               "X-Gyre-Agent-Id": agent})
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        self._event("response", role=role, agent=agent, finish_reason=choice.get("finish_reason"), usage=usage,
                    content=(choice["message"].get("content") or "")[:500],
                    tool_calls=[c.get("function", {}).get("name") for c in choice["message"].get("tool_calls") or []])
        return data

    @staticmethod
    def _usage_tokens(data: dict[str, Any]) -> int | None:
        u = data.get("usage") or {}
        if "total_tokens" in u:
            return int(u["total_tokens"])
        if "prompt_tokens" in u:
            return int(u["prompt_tokens"]) + int(u.get("completion_tokens") or 0)
        return None

    # ------------------------------------------------------------------ compaction

    def compact(self, conv: Conversation, instruction: str) -> Conversation:
        """One compaction call and the continued context (see :mod:`.conversation`)."""
        before = conv.context_tokens(self.config.compaction.chars_per_token)
        data = self._call(conv.compaction_request(), role="compaction", agent=conv.agent, tool_choice="none")
        summary = (data["choices"][0]["message"].get("content") or "").strip() or "(no summary)"
        self.result.compactions += 1
        self._event("compaction", agent=conv.agent, before_tokens=before, summary_chars=len(summary))
        return conv.compacted(summary, instruction)

    # ------------------------------------------------------------------ loop

    def _loop(self, conv: Conversation, instruction: str, *, role: str, max_turns: int) -> tuple[str | None, int]:
        turns = 0
        forced = False
        while turns < max_turns:
            if forced or self.config.compaction.should_compact(conv):
                conv = self.compact(conv, instruction)
                forced = False
            try:
                data = self._call(conv.messages, role=role, agent=conv.agent)
            except ContextTooLong:
                if len(conv.messages) < 3 or conv.compactions >= self.config.compaction.max_compactions:
                    raise
                logger.warning("%s: context too long for the model; compacting", conv.agent)
                forced = True
                continue
            turns += 1
            if conv.agent == "main":
                self.result.turns = turns
            msg = data["choices"][0]["message"]
            conv.add_assistant(assistant_message(msg), self._usage_tokens(data))
            calls = parse_tool_calls(msg)
            if not calls:
                return (msg.get("content") or ""), turns
            for call in calls:
                self.result.tool_calls += 1
                if call.error is not None:
                    out = f"error: {call.error}"
                elif call.name == "delegate" and "delegate" in self.config.tools and conv.agent == "main":
                    out = self.delegate(call.args.get("task") if call.args else None)
                else:
                    out = self.toolbox.run(call.name, call.args or {})
                self._event("tool", agent=conv.agent, name=call.name, arguments=call.arguments[:500],
                            result=out[:500])
                conv.add_tool_result(call.id, out)
        return None, turns

    def delegate(self, task: Any) -> str:
        """Run a sub-agent on ``task``; returns its final answer (or why there is none)."""
        if not isinstance(task, str) or not task.strip():
            return "error: delegate needs a non-empty 'task' string"
        self._subagents += 1
        self.result.subagents += 1
        agent = f"sub-{self._subagents}"
        self._event("subagent_start", agent=agent, task=task[:500])
        conv = Conversation.start(self.config.subagent_system_prompt, task, agent=agent)
        final, turns = self._loop(conv, task, role="subagent", max_turns=self.config.max_subagent_turns)
        self._event("subagent_end", agent=agent, turns=turns, final=(final or "")[:500])
        if final is None:
            return f"sub-agent stopped after {turns} turns without a final answer"
        return final

    def run(self, instruction: str) -> AgentResult:
        """Run the main agent on ``instruction``.

        Raises:
            ModelAPIError: the model API failed for good.
        """
        system = self.config.system_prompt if self.config.system_prompt is not None else DEFAULT_SYSTEM_PROMPT
        conv = Conversation.start(system or None, instruction, agent="main")
        final, turns = self._loop(conv, instruction, role="main", max_turns=self.config.max_turns)
        self.result.final = final
        self.result.stop = "final" if final is not None else "max_turns"
        self.result.turns = turns
        self._event("end", stop=self.result.stop, final=(final or "")[:2000], turns=turns,
                    model_calls=self.result.model_calls, compactions=self.result.compactions,
                    subagents=self.result.subagents)
        return self.result
