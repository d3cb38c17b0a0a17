"""Role declarations: each real harness's rules classify every recorded request of
tests/data/traces (and of the extra trace set, when present) like the scripted server did; the
rule engine itself."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from gyre.harness import (
    CLAUDE_CODE_ROLES,
    CODEX_ROLES,
    MINI_SWE_AGENT_ROLES,
    REFERENCE_ROLES,
    HARNESSES,
    RoleRule,
    RoleRules,
    classify_role,
    request_texts,
)
from gyre.harness.reference_agent import COMPACTION_PROMPT, SUBAGENT_SYSTEM_PROMPT


RULES = {"claude-code": CLAUDE_CODE_ROLES, "codex": CODEX_ROLES, "mini-swe-agent": MINI_SWE_AGENT_ROLES}

# Per trace set and harness: requests by role that got a complete reply (failed attempts excluded).
EXPECTED = {
    "recorded": {"claude-code": {"main": 35, "subagent": 8, "compaction": 1}, "codex": {"main": 19, "subagent": 4, "compaction": 1},
                 "mini-swe-agent": {"main": 12}},
    "extra": {"claude-code": {"main": 25, "subagent": 6, "compaction": 1},
              "codex": {"main": 17, "subagent": 2, "compaction": 1},
              "mini-swe-agent": {"main": 12}},
}


@pytest.mark.parametrize("harness", sorted(RULES))
def test_rules_match_the_traces(trace_source, harness):
    source, root = trace_source
    got: Counter = Counter()
    paths = sorted((root / harness).glob("*.jsonl"))
    assert paths, f"no {harness} traces in {root}"
    for path in paths:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            kind = rec.get("kind")
            if rec.get("injected") or kind in (None, "count_tokens", "unhandled"):  # failed attempts, non-model calls
                continue
            want = "main" if kind == "main_text" else kind
            role = RULES[harness].classify(rec["headers"], rec["body"])
            assert role == want, f"{path.name} #{rec['seq']}: {role} != {want}"
            got[role] += 1
    assert dict(got) == EXPECTED[source][harness]


def test_reference_roles():
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "t"}], "tools": [{}]}
    assert REFERENCE_ROLES.classify({"X-Gyre-Role": "compaction"}, body) == "compaction"
    assert REFERENCE_ROLES.classify({"x-gyre-role": "subagent"}, body) == "subagent"
    assert REFERENCE_ROLES.classify({"X-Gyre-Role": "main"}, body) == "main"
    # without headers, the prompts identify them
    comp = {**body, "messages": body["messages"] + [{"role": "user", "content": COMPACTION_PROMPT}]}
    assert REFERENCE_ROLES.classify({}, comp) == "compaction"
    sub = {**body, "messages": [{"role": "system", "content": SUBAGENT_SYSTEM_PROMPT}, {"role": "user", "content": "x"}]}
    assert REFERENCE_ROLES.classify({}, sub) == "subagent"


def test_every_adapter_declares_roles():
    for name, cls in HARNESSES.items():
        rules = cls.roles if name != "command" else RoleRules("command")
        assert isinstance(rules, RoleRules) and rules.default == "main"
        json.dumps(rules.as_dict())


def test_request_texts_across_apis():
    anth = {"system": [{"type": "text", "text": "SYS"}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "first"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "out"},
                                     {"type": "text", "text": "LAST"}]}]}
    t = request_texts(anth)
    assert t["system"] == "SYS" and t["last_user"] == "out\nLAST" and "first" in t["any"]
    resp = {"input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "DEV"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "U"}]},
                      {"type": "function_call_output", "call_id": "c", "output": "o"}]}
    t = request_texts(resp)
    assert t["system"] == "DEV" and t["last_user"] == "U"
    assert request_texts({"input": "plain"})["last_user"] == "plain"
    assert request_texts("junk") == {"system": "", "last_user": "", "any": ""}


def test_rule_engine():
    rules = RoleRules("x", (
        RoleRule("subagent", header="x-agent", header_pattern=r"^sub"),
        RoleRule("compaction", prompt_pattern="SUMMARISE", prompt_scope="any", no_tools=False),
        RoleRule("auxiliary", no_tools=True),
    ))
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    assert classify_role(rules, {"X-Agent": "sub-1"}, chat) == "subagent"
    assert classify_role(rules, {"X-Agent": "main"}, chat) == "main"
    assert classify_role(rules, {}, {**chat, "messages": [{"role": "system", "content": "SUMMARISE"}]}) == "compaction"
    assert classify_role(rules, {}, {"messages": [{"role": "system", "content": "SUMMARISE"}]}) == "auxiliary"
    for bad in (dict(role="evaluator", no_tools=True), dict(role="main"), dict(role="main", header_pattern="x"),
                dict(role="main", prompt_pattern="(", prompt_scope="any"), dict(role="main", no_tools=True,
                                                                                prompt_scope="user")):
        with pytest.raises(Exception):
            RoleRule(**bad)
