"""Role classification and harness metadata (gyre/proxy/roles.py)."""

from __future__ import annotations

import json

from gyre.proxy.messages import ChatRequest, Message
from gyre.proxy.roles import classify_role, detect_harness, harness_metadata

CC = {"User-Agent": "claude-cli/2.1.332 (external, sdk-cli)", "X-Claude-Code-Session-Id": "s1"}
TOOLS = [{"type": "function", "function": {"name": "Bash"}}]


def req(*msgs, tools=TOOLS):
    return ChatRequest("anthropic", list(msgs), tools=list(tools))


def test_claude_code_rules():
    main = req(Message("system", "x-"), Message("user", "MAIN_TASK"))
    assert detect_harness(CC) == "claude-code" and classify_role(main, CC) == "main"
    assert classify_role(main, {**CC, "x-claude-code-agent-id": "a1"}) == "subagent"
    comp = req(Message("user", "task"), Message("tool", "r"),
               Message("user", "CRITICAL: Respond with TEXT ONLY. ... Your task is to create a detailed summary of the conversation so far"))
    assert classify_role(comp, CC) == "compaction"
    assert classify_role(req(Message("user", "Write a title"), tools=[]), CC) == "auxiliary"
    md = harness_metadata({**CC, "x-claude-code-agent-id": "a1"})
    assert md["harness"] == "claude-code" and md["thread"] == "a1" and md["headers"]["x-claude-code-session-id"] == "s1"


def test_codex_rules():
    meta = {"thread_id": "t2", "window_number": 1, "request_kind": "turn", "thread_source": "subagent"}
    h = {"originator": "codex_exec", "thread-id": "t2", "x-codex-turn-metadata": json.dumps(meta)}
    r = ChatRequest("responses", [Message("user", "SUBAGENT_TASK")], tools=TOOLS)
    assert detect_harness(h) == "codex" and classify_role(r, h) == "subagent"
    assert harness_metadata(h)["thread"] == "t2:1"
    h2 = dict(h, **{"x-codex-turn-metadata": json.dumps(dict(meta, request_kind="compaction", thread_source="user"))})
    assert classify_role(ChatRequest("responses", [Message("user", "x")], tools=[]), h2) == "compaction"
    h3 = dict(h, **{"x-codex-turn-metadata": json.dumps(dict(meta, thread_source="user"))})
    assert classify_role(ChatRequest("responses", [Message("user", "x")], tools=TOOLS), h3) == "main"


def test_generic_and_explicit():
    text_agent = ChatRequest("chat", [Message("user", "solve")], tools=[])
    assert classify_role(text_agent, {"x-stainless-lang": "python"}) == "main"  # mini-swe-agent text-based
    assert classify_role(text_agent, {"x-gyre-role": "evaluator"}) == "evaluator"
    comp = ChatRequest("chat", [Message("user", "You are performing a CONTEXT CHECKPOINT COMPACTION.")])
    assert classify_role(comp, {}) == "compaction"
