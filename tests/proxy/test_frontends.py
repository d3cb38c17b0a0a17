"""Response shapes (the builders in gyre/proxy/api/): what the proxy returns, echoed back by a harness,
normalises to the same message (so restoration and TITO reuse can find it)."""

from __future__ import annotations

import json

import pytest

from gyre.proxy.api import make_builder
from gyre.proxy.messages import ChatRequest, Message, ToolCall
from gyre.proxy.api import normalize
from gyre.proxy.parse import OutputEvent


def _events(m: Message):
    evs = []
    if m.reasoning:
        evs.append(OutputEvent("reasoning", m.reasoning))
    if m.content:
        evs.append(OutputEvent("text", m.content))
    evs += [OutputEvent("tool_call", tool_call=tc) for tc in m.tool_calls]
    return evs


def _build(api, m, stream=False, **req_kw):
    req = ChatRequest(api, [Message("user", "x")], model="m", stream=stream, **req_kw)
    b = make_builder(req, 10)
    sse = b.start()
    for ev in _events(m):
        sse += b.on_event(ev)
    sse += b.finish("stop", 5)
    return b, sse


def _echo(api, body):
    """The request a harness sends after receiving ``body``: the reply echoed into its history."""
    if api == "anthropic":
        return {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": body["content"]}]}
    if api == "chat":
        return {"messages": [{"role": "user", "content": "x"}, body["choices"][0]["message"]]}
    items = [dict(o, content=None) if o["type"] == "reasoning" else o for o in body["output"]]  # Codex adds null content
    return {"input": [{"type": "message", "role": "user", "content": "x"}] + items}


MESSAGES = [
    Message("assistant", "Hello", "think"),
    Message("assistant", "", "plan", (ToolCall("", "bash", '{"cmd":  "ls"}'),)),
    Message("assistant", "Two calls", None, (ToolCall("", "a", "{}"), ToolCall("", "b", '{"x": [1, 2]}'))),
    Message("assistant", "", None, ()),
]


@pytest.mark.parametrize("api", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("m", MESSAGES, ids=range(len(MESSAGES)))
def test_echo_of_a_response_normalises_to_its_output_message(api, m):
    if api == "responses" and not (m.content or m.reasoning or m.tool_calls):
        pytest.skip("an empty Responses output has no item a harness could echo")
    b, _ = _build(api, m)
    out = b.output_message()
    echoed = normalize(api, _echo(api, b.body())).messages[-1]
    if api == "anthropic":  # dicts: Anthropic returns tool input as an object, re-dumped on echo
        assert [json.loads(t.arguments) for t in echoed.tool_calls] == [json.loads(t.arguments) for t in out.tool_calls]
        assert echoed.content == out.content and (echoed.reasoning or None) == out.reasoning
    else:  # argument strings come back byte for byte
        assert echoed.key() == out.key()
    assert [t.id for t in echoed.tool_calls] == [t.id for t in out.tool_calls]
    assert set(out.item_ids) <= set(echoed.item_ids) or api == "chat"


def test_responses_namespace_custom_and_encrypted_reasoning():
    m = Message("assistant", "", "r", (ToolCall("", "multi_agent_v1.spawn_agent", '{"message": "go"}'),
                                       ToolCall("", "apply_patch", '"*** Begin Patch\\n"', "custom")))
    b, sse = _build("responses", m, namespaces={"multi_agent_v1.spawn_agent": ("multi_agent_v1", "spawn_agent")},
                    extra={"include": ["reasoning.encrypted_content"]})
    out = b.body()["output"]
    assert out[0]["type"] == "reasoning" and out[0]["encrypted_content"].startswith("gyre:")
    assert out[1]["name"] == "spawn_agent" and out[1]["namespace"] == "multi_agent_v1"
    assert out[2] == {"type": "custom_tool_call", "id": out[2]["id"], "call_id": out[2]["call_id"],
                      "name": "apply_patch", "input": "*** Begin Patch\n", "status": "completed"}
    types = [e[0] for e in sse]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.custom_tool_call_input.delta" in types and "response.function_call_arguments.done" in types
    assert [e[1]["sequence_number"] for e in sse] == list(range(len(sse)))
    echoed = normalize("responses", _echo("responses", b.body())).messages[-1]
    assert echoed.key() == b.output_message().key()


def test_anthropic_stream_events_and_stop_reasons():
    _, sse = _build("anthropic", MESSAGES[1], stream=True)
    names = [e[0] for e in sse]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert sse[-2][1]["delta"]["stop_reason"] == "tool_use"
    deltas = [e[1]["delta"]["type"] for e in sse if e[0] == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "input_json_delta"]
    b, _ = _build("anthropic", MESSAGES[0])
    b.finish_reason = "length"
    assert b.body()["stop_reason"] == "max_tokens"


def test_chat_stream_chunks():
    _, sse = _build("chat", MESSAGES[2], stream=True, include_usage=True)
    assert sse[-1] == (None, "[DONE]") and sse[-2][1]["usage"]["completion_tokens"] == 5
    assert sse[-3][1]["choices"][0]["finish_reason"] == "tool_calls"
    idx = [e[1]["choices"][0]["delta"]["tool_calls"][0]["index"] for e in sse[:-2]
           if e[1].get("choices") and "tool_calls" in e[1]["choices"][0]["delta"]]
    assert idx == [0, 1]
