"""Role classification of model calls from harness headers and prompts, and harness metadata.

:func:`detect_harness` tells Claude Code, Codex and other clients apart from their headers;
:func:`classify_role` gives a call its role (``main``/``subagent``/``compaction``/
``auxiliary``/``evaluator``): an explicit ``x-gyre-role`` header first, then per-harness
rules, then a generic fallback; first match wins. :func:`harness_metadata` keeps the
harness-specific headers (session, sub-agent and window ids) in record metadata, with the
*thread* (``metadata["thread"]``) naming the conversation a call belongs to: Claude Code's
agent id, Codex's ``thread-id`` + window number, else ``"main"``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from gyre.proxy.messages import ROLE_USER, ChatRequest

__all__ = ["classify_role", "harness_metadata", "detect_harness", "COMPACTION_PATTERNS"]

#: Prompts by which harnesses ask for a summary of the conversation (compaction).
COMPACTION_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"create a detailed summary of the conversation", re.I),
    re.compile(r"CONTEXT CHECKPOINT COMPACTION"),
    re.compile(r"CRITICAL: Respond with TEXT ONLY", re.I),
)
_ROLES = ("main", "subagent", "compaction", "auxiliary", "evaluator")
#: Headers copied into record metadata (lower-case names).
KEPT_HEADERS = (
    "user-agent",
    "x-app",
    "x-claude-code-session-id",
    "x-claude-code-agent-id",
    "anthropic-beta",
    "x-stainless-retry-count",
    "originator",
    "session-id",
    "thread-id",
    "x-client-request-id",
    "x-codex-window-id",
    "x-codex-parent-thread-id",
    "x-openai-subagent",
    "x-codex-turn-metadata",
    "x-gyre-role",
)


def _h(headers: Mapping[str, str], name: str) -> str | None:
    v = headers.get(name)
    if v is None:
        for k, val in headers.items():
            if k.lower() == name:
                return val
    return v


def detect_harness(headers: Mapping[str, str]) -> str:
    """``"claude-code"``, ``"codex"``, ``"openai-python"`` or ``"generic"`` from request headers."""
    ua = (_h(headers, "user-agent") or "").lower()
    if ua.startswith("claude-cli") or _h(headers, "x-claude-code-session-id") is not None:
        return "claude-code"
    orig = (_h(headers, "originator") or "").lower()
    if orig.startswith("codex") or _h(headers, "x-codex-turn-metadata") is not None or ua.startswith("codex"):
        return "codex"
    if _h(headers, "x-stainless-lang") == "python" or ua.startswith(("openai/python", "anthropic/python")):
        return "openai-python"
    return "generic"


def _turn_metadata(headers: Mapping[str, str]) -> dict[str, Any]:
    raw = _h(headers, "x-codex-turn-metadata")
    if not raw:
        return {}
    try:
        v = json.loads(raw)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def _last_user_text(request: ChatRequest) -> str:
    for m in reversed(request.messages):
        if m.role == ROLE_USER:
            return m.content
        if m.role == "assistant":
            break
    return ""


def _is_compaction(request: ChatRequest) -> bool:
    text = _last_user_text(request)
    return bool(text) and any(p.search(text) for p in COMPACTION_PATTERNS)


def classify_role(request: ChatRequest, headers: Mapping[str, str], harness: str | None = None) -> str:
    """The role of a call; ``harness`` overrides detection. First match wins:

    1. An explicit ``x-gyre-role`` header (``main``/``subagent``/``compaction``/``auxiliary``/
       ``evaluator``), e.g. from Gyre's own agentic judge.
    2. **Claude Code** (``User-Agent: claude-cli/...`` or ``x-app: cli``): compaction when the
       last user text carries the summarisation prompt ("Your task is to create a detailed
       summary of the conversation so far", "CRITICAL: Respond with TEXT ONLY"); sub-agent when
       the ``x-claude-code-agent-id`` header is present (or the billing block says
       ``cc_is_subagent=true``); auxiliary when no tools are offered; else main.
    3. **Codex CLI** (``originator: codex_*`` or ``x-codex-turn-metadata``): compaction when the
       turn metadata's ``request_kind`` is ``compaction`` (or the prompt is the "CONTEXT
       CHECKPOINT COMPACTION" handoff); sub-agent when ``thread_source`` is ``subagent`` or
       ``x-openai-subagent`` is set; auxiliary when no tools are offered; else main.
    4. **Generic** (mini-swe-agent and any other harness): compaction when the last user
       message carries a known compaction prompt; else main (no-tools calls stay ``main``:
       text-based agents such as mini-swe-agent's ``litellm_textbased`` offer no tools).
    """
    explicit = (_h(headers, "x-gyre-role") or "").strip().lower()
    if explicit in _ROLES:
        return explicit
    harness = harness or detect_harness(headers)
    if harness == "claude-code":
        if _is_compaction(request):
            return "compaction"
        sys0 = request.messages[0].content if request.messages and request.messages[0].role == "system" else ""
        if _h(headers, "x-claude-code-agent-id") is not None or "cc_is_subagent=true" in sys0:
            return "subagent"
        if not request.tools:
            return "auxiliary"
        return "main"
    if harness == "codex":
        md = _turn_metadata(headers)
        if md.get("request_kind") == "compaction" or _is_compaction(request):
            return "compaction"
        if md.get("thread_source") == "subagent" or _h(headers, "x-openai-subagent") is not None:
            return "subagent"
        if not request.tools:
            return "auxiliary"
        return "main"
    if _is_compaction(request):
        return "compaction"
    return "main"


def harness_metadata(headers: Mapping[str, str], harness: str | None = None) -> dict[str, Any]:
    """Record metadata from the request headers: ``harness``, ``thread`` and kept headers."""
    harness = harness or detect_harness(headers)
    kept = {}
    for name in KEPT_HEADERS:
        v = _h(headers, name)
        if v is not None:
            kept[name] = v
    thread = "main"
    if harness == "claude-code":
        thread = _h(headers, "x-claude-code-agent-id") or "main"
    elif harness == "codex":
        md = _turn_metadata(headers)
        tid = _h(headers, "thread-id") or md.get("thread_id") or "main"
        thread = f"{tid}:{md.get('window_number', 0)}"
    return {"harness": harness, "thread": thread, "headers": kept}
