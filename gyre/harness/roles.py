"""How each harness's model calls are told apart: role rules the proxy can apply.

Roles: ``main``, ``subagent``, ``compaction``, ``auxiliary`` (``evaluator`` calls come from
Gyre's judge, never from a harness). Every harness adapter declares a :class:`RoleRules`
(:attr:`gyre.harness.Harness.roles`): an ordered list of :class:`RoleRule`; the first rule that
matches a request gives its role, ``default`` otherwise.

The rules follow what Claude Code 2.1.332, Codex 0.171.0 and mini-swe-agent 2.4.6 send, as
recorded in request logs of each. :func:`classify_role` is the pure reference implementation; it
understands Anthropic Messages, Chat Completions and Responses bodies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RoleRule", "RoleRules", "classify_role", "request_texts", "HARNESS_ROLES"]

#: Roles a harness's calls can have.
HARNESS_ROLES = ("main", "subagent", "compaction", "auxiliary")


@dataclass(slots=True, frozen=True)
class RoleRule:
    """One condition set; it matches when *all* of its conditions hold:

    * ``header`` present (case-insensitive name) and, with ``header_pattern``, its value matches
      the regular expression (``re.search``);
    * ``prompt_pattern`` found (``re.search``) in the request text selected by ``prompt_scope``:
      ``"last_user"`` (the text of the last user message / input item -- where Claude Code and
      Codex put their compaction prompts), ``"system"`` (system/developer prompts) or ``"any"``;
    * ``no_tools`` -- the request offers no tools (``True``) or offers some (``False``).

    Raises ``ValueError`` for an unknown role, a bad scope, or a rule with no condition.
    """

    role: str
    header: str | None = None
    header_pattern: str | None = None
    prompt_pattern: str | None = None
    prompt_scope: str = "last_user"
    no_tools: bool | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.role not in HARNESS_ROLES:
            raise ValueError(f"role must be one of {HARNESS_ROLES}, got {self.role!r}")
        if self.prompt_scope not in ("last_user", "system", "any"):
            raise ValueError(f"prompt_scope must be last_user, system or any, got {self.prompt_scope!r}")
        if self.header is None and self.prompt_pattern is None and self.no_tools is None:
            raise ValueError("a role rule needs at least one condition")
        if self.header_pattern is not None and self.header is None:
            raise ValueError("header_pattern needs header")
        for pat in (self.header_pattern, self.prompt_pattern):
            if pat is not None:
                re.compile(pat)

    def matches(self, headers: Mapping[str, str], texts: Mapping[str, str], has_tools: bool) -> bool:
        if self.header is not None:
            value = _header(headers, self.header)
            if value is None:
                return False
            if self.header_pattern is not None and not re.search(self.header_pattern, value):
                return False
        if self.prompt_pattern is not None and not re.search(self.prompt_pattern, texts[self.prompt_scope]):
            return False
        if self.no_tools is not None and self.no_tools == has_tools:
            return False
        return True

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) not in (None, "")}


@dataclass(slots=True, frozen=True)
class RoleRules:
    """Ordered role rules of one harness plus the role of everything else."""

    harness: str
    rules: tuple[RoleRule, ...] = ()
    default: str = "main"
    notes: str = ""

    def classify(self, headers: Mapping[str, str], body: Any) -> str:
        """Role of one request (:func:`classify_role`)."""
        return classify_role(self, headers, body)

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (for the proxy's configuration and the run's records)."""
        return {"harness": self.harness, "default": self.default, "notes": self.notes,
                "rules": [r.as_dict() for r in self.rules]}


def _header(headers: Mapping[str, str], name: str) -> str | None:
    low = name.lower()
    for k, v in headers.items():
        if k.lower() == low:
            return str(v)
    return None


def _text(content: Any) -> str:
    """Text of a message content: a string, or the text of its text-like blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        for key in ("text", "content", "output"):
            if isinstance(content.get(key), (str, list)):
                return _text(content[key])
        return ""
    if isinstance(content, Sequence):
        return "\n".join(_text(c) for c in content)
    return ""


def request_texts(body: Any) -> dict[str, str]:
    """``{"system", "last_user", "any"}`` texts of an Anthropic / Chat / Responses request body."""
    system_parts: list[str] = []
    users: list[str] = []
    everything: list[str] = []
    if not isinstance(body, Mapping):
        return {"system": "", "last_user": "", "any": ""}
    if "system" in body:  # Anthropic
        system_parts.append(_text(body["system"]))
    if isinstance(body.get("instructions"), str):  # Responses
        system_parts.append(body["instructions"])
    items = body.get("messages")
    if items is None:
        items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, Mapping):
            continue
        role = item.get("role")
        text = _text(item.get("content"))
        if role in ("system", "developer"):
            system_parts.append(text)
        elif role == "user":
            users.append(text)
        everything.append(text)
    system = "\n".join(system_parts)
    return {"system": system, "last_user": users[-1] if users else "", "any": "\n".join([system, *everything])}


def classify_role(rules: RoleRules, headers: Mapping[str, str], body: Any) -> str:
    """Apply ``rules`` to one request: the first matching rule's role, else ``rules.default``."""
    texts = request_texts(body)
    tools = body.get("tools") if isinstance(body, Mapping) else None
    has_tools = bool(tools)
    for rule in rules.rules:
        if rule.matches(headers, texts, has_tools):
            return rule.role
    return rules.default
