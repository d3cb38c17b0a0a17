"""Delta rendering at message boundaries (render.py) and output parsing (parse.py)."""

from __future__ import annotations

import json
import unicodedata

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy.messages import Message, ToolCall
from tests.proxy.conftest import hypothesis_examples
from gyre.proxy.parse import OutputParser, parse_output, parse_tool_call_body

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _full_ids(r, msgs, tools=TOOLS, gen=True):
    return r.encode(r.render([m.template_dict() for m in msgs], tools, add_generation_prompt=gen))


def _conversation():
    return [
        Message("system", "S"),
        Message("user", "hi"),
        Message("assistant", "ok", "why", (ToolCall("1", "f", '{"a": 1}'), ToolCall("2", "f", "{}"))),
        Message("tool", "A", tool_call_id="1"),
        Message("tool", "B", tool_call_id="2"),
        Message("user", "next"),
    ]


def test_delta_from_scratch_equals_full_render(local_renderer):
    r = local_renderer
    msgs = _conversation()
    d = r.render_delta(None, msgs, TOOLS, add_generation_prompt=True)
    assert [(s.first, s.last) for s in d.segments] == [(0, 0), (1, 1), (2, 2), (3, 4), (5, 5)]  # tool group shares a block
    assert sum((s.ids for s in d.segments), []) + d.gen_ids == _full_ids(r, msgs)
    assert r.decode(d.gen_ids) == "<|im_start|>assistant\n"


def test_delta_after_a_message_and_not_inside_a_tool_group(local_renderer):
    r = local_renderer
    msgs = _conversation()
    d = r.render_delta(msgs[2], msgs[3:], None, add_generation_prompt=True)
    assert r.decode(d.segments[0].ids) == (
        "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n")
    import pytest

    from gyre.proxy.render import RenderError
    with pytest.raises(RenderError):  # cutting between two results of one block is not a boundary
        r.render_delta(msgs[3], msgs[4:], None, add_generation_prompt=True)


def test_probed_template_facts(local_renderer):
    r = local_renderer
    assert r.assistant_close == "<|im_end|>\n" and r.after_eos == "\n"
    assert r.generation_prompt({"enable_thinking": False}) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>", "<|endoftext|>",
         "<tool_response>", "</tool_response>")
# the Qwen tokenizer applies NFC normalisation, so text that NFC changes cannot round-trip (e.g. U+F900)
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40).filter(
    lambda s: not any(t in s for t in _TAGS) and unicodedata.normalize("NFC", s) == s)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | _text,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3), max_leaves=6)


@st.composite
def _assistant(draw):
    calls = []
    for k in range(draw(st.integers(0, 3))):
        args = draw(st.dictionaries(_text, _json, max_size=3))
        sep = draw(st.sampled_from([(", ", ": "), (",", ":"), (" , ", " :  ")]))
        calls.append(ToolCall("", draw(_text.filter(bool)), json.dumps(args, separators=sep, ensure_ascii=draw(st.booleans()))))
    reasoning = draw(st.none() | _text)
    return Message("assistant", draw(_text), reasoning or None, tuple(calls))


@settings(max_examples=hypothesis_examples(80), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=_assistant(), chunk=st.integers(1, 7))
def test_parse_inverts_render_streaming_or_not(local_renderer, m, chunk):
    r = local_renderer
    ids = r.encode(r.assistant_output_text(m))
    whole = parse_output(r.decode, ids, [r.eos_id]).message()
    assert whole.key() == m.key()  # arguments byte for byte
    p = OutputParser(r.decode, [r.eos_id])
    events = []
    for i in range(0, len(ids), chunk):
        events += p.feed(ids[i:i + chunk])
    events += p.finish()
    assert p.result().message().key() == m.key()
    assert "".join(e.text for e in events if e.kind == "text") == m.content
    assert [e.tool_call.arguments for e in events if e.kind == "tool_call"] == [c.arguments for c in m.tool_calls]


def test_malformed_and_truncated_tool_calls_are_text(local_renderer):
    r = local_renderer
    text = 'Hi\n<tool_call>\n{"name": "f", "arguments": {bad}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call><|im_end|>'
    out = parse_output(r.decode, r.encode(text), [r.eos_id])
    assert out.malformed == 1
    assert out.content == 'Hi\n<tool_call>\n{"name": "f", "arguments": {bad}\n</tool_call>'
    assert [tc.name for tc in out.tool_calls] == ["g"]
    cut = parse_output(r.decode, r.encode('<tool_call>\n{"name": "f", "argu'), [r.eos_id], finish_reason="length")
    assert cut.tool_calls == () and cut.content == '<tool_call>\n{"name": "f", "argu' and cut.malformed == 1
    unclosed = parse_output(r.decode, r.encode("<think>\nstill thinking"), [r.eos_id])
    assert unclosed.reasoning == "still thinking" and unclosed.content == ""
    # arguments that are not an object (function tools) or not a string (custom tools): text
    assert parse_tool_call_body('{"name": "f", "arguments": [1]}') is None
    assert parse_tool_call_body('{"name": "p", "arguments": {"a": 1}}', "custom") is None
    assert parse_tool_call_body('{"name": "p", "arguments": "x"}', "custom") == ("p", '"x"')
    assert parse_tool_call_body('{"arguments": {"b" :1}, "name": "f"}') == ("f", '{"b": 1}')  # re-dumped


def test_streaming_holds_back_partial_tags(local_renderer):
    r = local_renderer
    p = OutputParser(r.decode, [r.eos_id])
    ev = p.feed(r.encode("Hello\n"))
    assert "".join(e.text for e in ev) == "Hello"  # the "\n" may precede a <tool_call>
    ev = p.feed(r.encode("world"))
    assert "".join(e.text for e in ev) == "\nworld"
    p = OutputParser(r.decode, [r.eos_id], starts_in_reasoning=True)
    ev = p.feed(r.encode("abc\n</think>\n\nX"))
    assert [(e.kind, e.text) for e in ev] == [("reasoning", "abc"), ("text", "X")]


def test_encoding_without_offsets_gives_the_tokenizers_own_ids(qwen_renderer):
    r = qwen_renderer
    assert r._fast_batch is not None                      # the offset-free batch encoder is in use
    texts = ["plain words", "<|im_end|>\n<|im_start|>user\nspecial tokens inside", "ünïcödé 漢字 🙂  \t\n",
             "x" * 5000, ""]
    want = [r.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert r.encode_batch(texts) == want
    assert [r.encode(t) for t in texts] == want
    assert r.encode_batch(texts[1:2]) == want[1:2] and r.encode_batch([]) == []
    assert 151645 in want[1]                              # <|im_end|> matched as one special token
