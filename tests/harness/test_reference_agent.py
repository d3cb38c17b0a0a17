"""The reference agent's pure parts (conversation, compaction policy, tool-call parsing), its
tools, its HTTP client's retries, and its loop driven by a scripted in-process client."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from gyre.harness.reference_agent import (
    COMPACTION_PROMPT,
    AgentConfig,
    ChatClient,
    CompactionPolicy,
    ContextTooLong,
    Conversation,
    ModelAPIError,
    ReferenceAgent,
    Toolbox,
    assistant_message,
    parse_tool_calls,
)
from gyre.harness.reference_agent.tools import truncate


def call(name, args, cid="c1"):
    return {"id": cid, "type": "function", "function": {"name": name,
                                                        "arguments": args if isinstance(args, str) else json.dumps(args)}}


# ---------------------------------------------------------------- conversation (pure)


def test_conversation_bookkeeping_and_size_estimate():
    conv = Conversation.start("sys", "task")
    assert conv.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    assert conv.context_tokens(1.0) == 7 and conv.usage_tokens is None
    msg = assistant_message({"role": "assistant", "content": None, "tool_calls": [call("bash", '{ "command" : "ls" }')],
                             "extra": 1})
    assert msg == {"role": "assistant", "content": None, "tool_calls": [call("bash", '{ "command" : "ls" }')]}
    conv.add_assistant(msg, usage_tokens=100)
    assert conv.context_tokens(4.0) == 100
    conv.add_tool_result("c1", "x" * 40)
    assert conv.context_tokens(4.0) == 110 and conv.messages[-1] == {"role": "tool", "tool_call_id": "c1",
                                                                      "content": "x" * 40}
    conv.add_assistant(assistant_message({"content": "done"}), usage_tokens=None)  # no usage: estimate grows
    assert conv.context_tokens(4.0) == 111


def test_compaction_request_extends_context_and_compacted_restarts():
    conv = Conversation.start("sys", "the task")
    conv.add_assistant({"role": "assistant", "content": "a"}, 50)
    req = conv.compaction_request()
    assert req[:-1] == conv.messages and req[-1] == {"role": "user", "content": COMPACTION_PROMPT}
    new = conv.compacted("  did X  ", "the task")
    assert new.compactions == 1 and new.agent == "main" and new.usage_tokens is None
    assert new.messages[0] == {"role": "system", "content": "sys"}
    assert new.messages[1]["content"].startswith("This task is being continued")
    assert "did X\n" in new.messages[1]["content"] and new.messages[1]["content"].endswith("the task")
    assert len(conv.messages) == 3  # the old context is untouched


@pytest.mark.parametrize("tokens, messages, compactions, expected", [
    (1001, 4, 0, True), (1000, 4, 0, False), (5000, 3, 0, False), (5000, 4, 2, False)])
def test_compaction_policy(tokens, messages, compactions, expected):
    conv = Conversation.start("s", "u", compactions=compactions)
    for _ in range(messages - 2):
        conv.add_user("x")
    conv.usage_tokens, conv.pending_chars = tokens, 0
    assert CompactionPolicy(1000, max_compactions=2).should_compact(conv) is expected
    assert CompactionPolicy(0).should_compact(conv) is False
    with pytest.raises(ValueError):
        CompactionPolicy(-1)


def test_parse_tool_calls():
    calls = parse_tool_calls({"tool_calls": [call("bash", '{ "command" :  "ls" }', "a"), call("x", "{bad", "b"),
                                             call("y", "[1]", "c"), call("z", "", "d")]})
    assert [(c.id, c.name, c.args, c.error is None) for c in calls] == [
        ("a", "bash", {"command": "ls"}, True), ("b", "x", None, False), ("c", "y", None, False), ("d", "z", {}, True)]
    assert calls[0].arguments == '{ "command" :  "ls" }'  # raw text kept byte for byte
    assert parse_tool_calls({"content": "hi"}) == []


# ---------------------------------------------------------------- tools


def test_toolbox(tmp_path):
    tb = Toolbox(tmp_path, bash_timeout_s=5, max_output_chars=200)
    assert tb.run("write_file", {"path": "d/a.txt", "content": "one two two"}) == "wrote 11 characters to d/a.txt"
    assert tb.run("read_file", {"path": "d/a.txt"}) == "one two two"
    assert "occurs 2 times" in tb.run("edit_file", {"path": "d/a.txt", "old_text": "two", "new_text": "2"})
    assert tb.run("edit_file", {"path": "d/a.txt", "old_text": "one", "new_text": "1"}) == "edited d/a.txt"
    assert (tmp_path / "d/a.txt").read_text() == "1 two two"
    assert tb.run("bash", {"command": "echo hi; exit 3"}) == "exit code: 3\nhi\n"
    assert tb.run("read_file", {"path": "missing"}).startswith("error: ")
    assert tb.run("write_file", {"path": "x"}).startswith("error: content")
    assert tb.run("nope", {}) == "error: unknown tool 'nope'"
    assert tb.run("bash", {}) == "error: command must be a non-empty string"
    assert len(tb.run("bash", {"command": "yes | head -c 5000"})) < 300


def test_bash_timeout_kills_group(tmp_path):
    tb = Toolbox(tmp_path, bash_timeout_s=0.5)
    out = tb.run("bash", {"command": "(sleep 30; touch late) & sleep 30"})
    assert out.startswith("error: command timed out after 0.5 s")
    assert not (tmp_path / "late").exists()


def test_truncate():
    assert truncate("abc", 10) == "abc"
    t = truncate("a" * 50 + "b" * 50, 20)
    assert t.startswith("a" * 10) and t.endswith("b" * 10) and "80 characters omitted" in t


# ---------------------------------------------------------------- client


def test_client_retries_then_succeeds():
    statuses = [503, 429, 200]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers["authorization"], request.headers.get("x-gyre-role"), request.content))
        st = statuses.pop(0)
        if st != 200:
            return httpx.Response(st, json={"error": "busy"}, headers={"retry-after": "0.25"} if st == 429 else {})
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

    sleeps = []
    c = ChatClient("http://x/v1", "k", transport=httpx.MockTransport(handler), sleep=sleeps.append, backoff_s=0.1)
    out = c.chat({"model": "m", "messages": []}, headers={"X-Gyre-Role": "main"})
    assert out["choices"][0]["message"]["content"] == "ok"
    assert sleeps == [0.1, 0.25]  # exponential backoff, then retry-after
    assert len({s[2] for s in seen}) == 1 and seen[0][:2] == ("Bearer k", "main")  # identical bodies


def test_client_errors():
    def handler(request):
        body = json.loads(request.content)
        if body["model"] == "long":
            return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 4096"}})
        if body["model"] == "gyre-long":
            return httpx.Response(400, json={"error": {"message": "prompt is too long: 5000 tokens > 4095 maximum"}})
        if body["model"] == "bad":
            return httpx.Response(401, json={"error": "no"})
        if body["model"] == "junk":
            return httpx.Response(200, text="not json")
        return httpx.Response(500)

    c = ChatClient("http://x/v1", "k", transport=httpx.MockTransport(handler), sleep=lambda s: None, max_retries=2)
    with pytest.raises(ContextTooLong):
        c.chat({"model": "long"})
    with pytest.raises(ContextTooLong):
        c.chat({"model": "gyre-long"})
    with pytest.raises(ModelAPIError, match="HTTP 401"):
        c.chat({"model": "bad"})
    with pytest.raises(ModelAPIError, match="malformed"):
        c.chat({"model": "junk"})
    with pytest.raises(ModelAPIError, match="giving up after 3 attempts"):
        c.chat({"model": "x"})


# ---------------------------------------------------------------- the loop


class ScriptedClient:
    """Stands in for ChatClient: records (body, headers) and answers with policy(body, headers)."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []

    def chat(self, body, *, headers=None):
        self.calls.append((json.loads(json.dumps(body)), dict(headers or {})))
        msg, usage = self.policy(body, headers or {})
        return {"choices": [{"message": msg, "finish_reason": "stop"}], "usage": {"total_tokens": usage}}


def tool_msg(name, args, cid):
    return {"role": "assistant", "content": None, "tool_calls": [call(name, args, cid)]}


def test_loop_tool_then_final(tmp_path):
    def policy(body, headers):
        n_tool = sum(m["role"] == "tool" for m in body["messages"])
        if n_tool == 0:
            return tool_msg("write_file", '{"path": "answer.txt", "content": "13"}', "c1"), 50
        return {"role": "assistant", "content": "13"}, 60

    client = ScriptedClient(policy)
    log = io.StringIO()
    res = ReferenceAgent(client, Toolbox(tmp_path), AgentConfig(tools=["write_file"], system_prompt=""),
                         transcript=log, clock=lambda: 0.0).run("What is 6+7? Write the result to answer.txt")
    assert (res.final, res.stop, res.turns, res.model_calls, res.tool_calls) == ("13", "final", 2, 2, 1)
    assert (tmp_path / "answer.txt").read_text() == "13"
    (b1, h1), (b2, h2) = client.calls
    assert b1["messages"] == [{"role": "user", "content": "What is 6+7? Write the result to answer.txt"}]
    assert [t["function"]["name"] for t in b1["tools"]] == ["write_file"]
    assert b2["messages"][:1] == b1["messages"]  # each request extends the previous one
    assert b2["messages"][1] == tool_msg("write_file", '{"path": "answer.txt", "content": "13"}', "c1")
    assert b2["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "wrote 2 characters to answer.txt"}
    assert h1 == {"X-Gyre-Harness": "reference", "X-Gyre-Role": "main", "X-Gyre-Agent-Id": "main"}
    events = [json.loads(line)["event"] for line in log.getvalue().splitlines()]
    assert events == ["request", "response", "tool", "request", "response", "end"]


def test_loop_turn_limit_and_bad_arguments(tmp_path):
    client = ScriptedClient(lambda body, h: (tool_msg("bash", "{not json", "c"), 10))
    res = ReferenceAgent(client, Toolbox(tmp_path), AgentConfig(max_turns=3)).run("x")
    assert (res.final, res.stop, res.turns) == (None, "max_turns", 3)
    assert client.calls[-1][0]["messages"][-1]["content"].startswith("error: arguments are not valid JSON")


def long_task_policy(body, headers):
    """Main: 4 bash turns (the context grows by 400 tokens a turn, so it passes 1000 after the
    third and compacts), one delegation, then final;
    compaction: a summary; sub-agent: one bash turn then its answer."""
    role, msgs = headers["X-Gyre-Role"], body["messages"]
    if role == "compaction":
        return {"role": "assistant", "content": "SUMMARY: ran steps"}, 10
    tools_done = sum(m["role"] == "tool" for m in msgs)
    if role == "subagent":
        if tools_done == 0:
            return tool_msg("bash", {"command": "echo sub-work > sub.txt"}, "s1"), 100
        return {"role": "assistant", "content": "SUBAGENT_RESULT: wrote sub.txt"}, 120
    continued = msgs[-1]["content"].startswith("This task is being continued") or any(
        m["role"] == "user" and m["content"].startswith("This task is being continued") for m in msgs)
    step = tools_done + (3 if continued else 0)  # steps 0-2 before the compaction, 3 after it
    if step < 4:
        return tool_msg("bash", {"command": f"echo step{step} >> log.txt"}, f"m{step}"), 400 * (tools_done + 1)
    if step == 4:
        return tool_msg("delegate", {"task": "SUBAGENT_TASK: write sub.txt"}, "d1"), 300
    return {"role": "assistant", "content": "All done."}, 350


def test_loop_compaction_and_delegation(tmp_path):
    client = ScriptedClient(long_task_policy)
    cfg = AgentConfig(compaction=CompactionPolicy(1000), max_turns=20)
    res = ReferenceAgent(client, Toolbox(tmp_path), cfg).run("MAIN_TASK: long")
    assert res.stop == "final" and res.final == "All done."
    assert res.compactions == 1 and res.subagents == 1
    roles = [(h["X-Gyre-Role"], h["X-Gyre-Agent-Id"]) for _, h in client.calls]
    assert roles == [("main", "main")] * 3 + [("compaction", "main"), ("main", "main"), ("main", "main"),
                                               ("subagent", "sub-1"), ("subagent", "sub-1"), ("main", "main")]
    bodies = [b for b, _ in client.calls]
    # the compaction call extends the last main context with the compaction prompt (same tools)
    comp = bodies[3]
    assert comp["messages"][:-1] == bodies[2]["messages"] + comp["messages"][len(bodies[2]["messages"]):-1]
    assert comp["messages"][-1] == {"role": "user", "content": COMPACTION_PROMPT}
    assert comp["tools"] == bodies[2]["tools"] and comp["tool_choice"] == "none"
    # the next main call is a new context that starts with the summary
    after = bodies[4]["messages"]
    assert after[0] == bodies[0]["messages"][0] and len(after) == 2
    assert "SUMMARY: ran steps" in after[1]["content"] and after[1]["content"].endswith("MAIN_TASK: long")
    # the sub-agent has a fresh context, no delegate tool, and its answer is the delegate result
    sub = bodies[6]
    assert sub["messages"][0]["content"].startswith("You are a sub-agent")
    assert sub["messages"][1] == {"role": "user", "content": "SUBAGENT_TASK: write sub.txt"}
    assert "delegate" not in [t["function"]["name"] for t in sub["tools"]]
    assert bodies[-1]["messages"][-1] == {"role": "tool", "tool_call_id": "d1",
                                          "content": "SUBAGENT_RESULT: wrote sub.txt"}
    assert (tmp_path / "sub.txt").read_text() == "sub-work\n"
    assert (tmp_path / "log.txt").read_text() == "step0\nstep1\nstep2\nstep3\n"


def test_context_too_long_forces_compaction(tmp_path):
    state = {"n": 0}

    class Client(ScriptedClient):
        def chat(self, body, *, headers=None):
            state["n"] += 1
            if state["n"] == 3:  # the third main request does not fit
                self.calls.append((body, dict(headers)))
                raise ContextTooLong("too long", 400)
            return super().chat(body, headers=headers)

    client = Client(long_task_policy)
    res = ReferenceAgent(client, Toolbox(tmp_path), AgentConfig(tools=["bash"])).run("t")
    roles = [h["X-Gyre-Role"] for _, h in client.calls]
    assert roles[:4] == ["main", "main", "main", "compaction"] and res.compactions == 1


def test_config_validation():
    with pytest.raises(ValueError, match="unknown tools"):
        AgentConfig(tools=["rm_rf"])
    with pytest.raises(ValueError):
        AgentConfig(max_turns=0)
