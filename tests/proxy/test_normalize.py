"""Normalisation of the three APIs into the internal message form (gyre/proxy/api/)."""

from __future__ import annotations

import pytest

from gyre.proxy.errors import ProxyError, error_body
from gyre.proxy.messages import Message, ToolCall
from gyre.proxy.api import normalize
from gyre.proxy.api.anthropic import normalize_anthropic
from gyre.proxy.api.openai_chat import normalize_chat
from gyre.proxy.api.openai_responses import normalize_responses


def test_anthropic_cache_control_string_vs_block_and_billing_header():
    a = normalize_anthropic({
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.421; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are X.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "\nMore."},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
        "max_tokens": 10,
    })
    b = normalize_anthropic({
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.cf6; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are X."},
            {"type": "text", "text": "\nMore."},
        ],
        "messages": [{"role": "user", "content": "hi"}],
    })
    assert [m.key() for m in a.messages] == [m.key() for m in b.messages]
    assert a.messages[0] == Message("system", "You are X.\nMore.")
    assert a.sampling.max_tokens == 10 and b.sampling.max_tokens is None


def test_anthropic_tool_results_thinking_and_system_messages_in_order():
    req = normalize_anthropic({
        "messages": [
            {"role": "user", "content": "task"},
            {"role": "system", "content": [], "output_config": {"x": 1}},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig1"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"description": "d", "command": "ls"}},
                {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"file_path": "/x"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "R"}]},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "B", "is_error": True},
                {"type": "text", "text": "<system-reminder>x</system-reminder>"},
            ]},
        ],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}, "cache_control": {}}],
    })
    roles = [m.role for m in req.messages]
    assert roles == ["user", "system", "assistant", "tool", "tool", "user"]
    asst = req.messages[2]
    assert asst.reasoning == "hmm" and asst.content == "Calling." and asst.item_ids == ("sig1",)
    assert asst.tool_calls[0] == ToolCall("toolu_1", "Bash", '{"description": "d", "command": "ls"}')
    # completion order is kept; is_error kept but not part of the key
    assert [m.tool_call_id for m in req.messages[3:5]] == ["toolu_2", "toolu_1"]
    assert req.messages[4].is_error and req.messages[4].key() == ("tool", "B")
    assert req.tools == [{"type": "function", "function": {"name": "Bash", "description": "run", "parameters": {"type": "object"}}}]


def test_chat_messages_tools_and_options():
    req = normalize_chat({
        "model": "m",
        "messages": [
            {"role": "developer", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]},
            {"content": None, "role": "assistant", "tool_calls": [
                {"function": {"arguments": '{ "command" :  "ls" }', "name": "bash"}, "id": "call_1", "type": "function"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "out"},
        ],
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
        "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 7, "stop": "X",
        "chat_template_kwargs": {"enable_thinking": False},
    })
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[1].content == "a[image]"
    assert req.messages[2].tool_calls[0].arguments == '{ "command" :  "ls" }'  # byte for byte
    assert req.stream and req.include_usage and req.sampling.max_tokens == 7 and req.sampling.stop == ("X",)
    assert req.template_kwargs == {"enable_thinking": False}


def test_responses_grouping_namespace_custom_and_developer():
    req = normalize_responses({
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "U"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}], "content": None,
             "encrypted_content": "e"},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "exec", "arguments": "{\n \"cmd\" : 1\n}"},
            {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "spawn_agent", "namespace": "multi_agent_v1",
             "arguments": "{}", "async_": None, "caller": None},
            {"type": "function_call_output", "call_id": "c1", "output": "o1"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "o2"}]},
            {"type": "reasoning", "id": "rs_2", "summary": []},
            {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c3", "name": "apply_patch", "input": "*** Begin"},
            {"type": "custom_tool_call_output", "call_id": "c3", "output": "ok"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
            {"type": "web_search_call", "id": "ws"},
        ],
        "tools": [
            {"type": "function", "name": "exec", "parameters": {"type": "object"}, "strict": False},
            {"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn_agent"}]},
            {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
            {"type": "web_search"},
        ],
        "include": ["reasoning.encrypted_content"],
    })
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    a1 = req.messages[2]
    assert a1.reasoning == "think" and a1.item_ids == ("rs_1",)
    assert [tc.name for tc in a1.tool_calls] == ["exec", "multi_agent_v1.spawn_agent"]
    assert a1.tool_calls[0].arguments == "{\n \"cmd\" : 1\n}" and a1.tool_calls[0].item_id == "fc_1"
    assert req.messages[4].content == "o2"
    a2 = req.messages[5]
    assert a2.tool_calls[0] == ToolCall("c3", "apply_patch", '"*** Begin"', "custom", "ctc_1")
    assert req.messages[7].content == "done"
    assert req.tool_kinds == {"exec": "function", "multi_agent_v1.spawn_agent": "function", "apply_patch": "custom"}
    assert req.namespaces == {"multi_agent_v1.spawn_agent": ("multi_agent_v1", "spawn_agent")}
    assert normalize_responses({"input": "hello", "instructions": "I"}).messages == [
        Message("system", "I"), Message("user", "hello")]


@pytest.mark.parametrize("api,body,param", [
    ("anthropic", [], None),
    ("anthropic", {"messages": "x"}, "messages"),
    ("anthropic", {"messages": [{"role": "bot", "content": "x"}]}, "role"),
    ("anthropic", {"messages": [], "max_tokens": 0}, "max_tokens"),
    ("anthropic", {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": 3}]}]}, None),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, None),
    ("chat", {"messages": [], "n": 2}, "n"),
    ("chat", {"messages": [], "temperature": "hot"}, "temperature"),
    ("responses", {"input": 5}, "input"),
    ("responses", {"input": [], "previous_response_id": "r"}, "previous_response_id"),
    ("responses", {"input": [{"type": "message", "role": "robot", "content": "x"}]}, "role"),
])
def test_malformed_bodies_raise_400(api, body, param):
    with pytest.raises(ProxyError) as ei:
        normalize(api, body)
    assert ei.value.status == 400
    if param is not None:
        assert ei.value.param == param


def test_error_shapes():
    assert error_body("anthropic", 401, "bad key") == {
        "type": "error", "error": {"type": "authentication_error", "message": "bad key"}}
    assert error_body("chat", 400, "bad", "n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
    assert error_body("responses", 529, "x")["error"]["type"] == "server_error"
