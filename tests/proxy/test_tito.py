"""TITO assembly and tool-call restoration: the re-tokenisation traps of docs/proxy.md with exact
token expectations on the real Qwen vocabulary (gyre/proxy/tito.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.proxy.api import make_builder
from gyre.proxy.api.common import IdFactory
from gyre.proxy.messages import ChatRequest, Message, ToolCall
from gyre.proxy.api.anthropic import normalize_anthropic
from gyre.proxy.parse import OutputParser
from gyre.proxy.tito import TitoSession
from gyre.trajectory.records import Provenance

IM_START, IM_END, NL, NLNL, USER, ASSISTANT = 151644, 151645, 198, 271, 872, 77091


class _Ids(IdFactory):
    def __init__(self):
        self.n = 0

    def tool_call_id(self, api, index):
        self.n += 1
        return f"toolu_{self.n}"


def turn(session, request, out_ids, ids=None):
    """prepare -> 'sample' ``out_ids`` -> parse -> shape -> commit; returns (prepared, record, output message)."""
    r = session.renderer
    prep = session.prepare(request)
    parser = OutputParser(r.decode, [r.eos_id], request.tool_kinds, starts_in_reasoning=prep.starts_in_reasoning)
    b = make_builder(request, len(prep.input_ids), ids or _Ids())
    for ev in parser.feed(out_ids) + parser.finish():
        b.on_event(ev)
    b.finish("stop", len(out_ids))
    msg = b.output_message()
    rec = session.commit(prep, output_ids=out_ids, output_logprobs=np.full(len(out_ids), -0.5), finish_reason="stop",
                         output_message=msg, role="main")
    return prep, rec, msg


def chat(*msgs, **kw):
    return ChatRequest("chat", list(msgs), **kw)


def enc(r, text):
    return r.encode(text)


def test_reply_starting_with_newline_is_reused_verbatim(qwen_renderer):
    r = qwen_renderer
    s = TitoSession("e", r)
    hello = enc(r, "Hello")
    p1, rec1, m1 = turn(s, chat(Message("user", "hi")), [NL] + hello + [IM_END])
    assert p1.input_ids.tolist() == [IM_START, USER, NL] + enc(r, "hi") + [IM_END, NL, IM_START, ASSISTANT, NL]
    assert m1.content == "\nHello"
    req2 = chat(Message("user", "hi"), Message("assistant", "\nHello"), Message("user", "more"))
    p2 = s.prepare(req2)
    tail = enc(r, "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    assert p2.input_ids.tolist() == p1.input_ids.tolist() + [NL] + hello + [IM_END] + [NL] + tail
    assert p2.reused_tokens == len(p1.input_ids) + len(hello) + 3 and p2.identified == [None, 0, None]
    naive = r.encode(r.render([m.template_dict() for m in req2.messages], add_generation_prompt=True))
    assert naive[len(p1.input_ids) - 1] == NLNL and naive != p2.input_ids.tolist()  # the trap a re-render falls into
    assert s.tree.match(p2.input_ids).depth == len(p1.input_ids) + len(hello) + 2


def test_newline_after_im_end_is_template_not_target(qwen_renderer):
    r = qwen_renderer
    s = TitoSession("e", r)
    out = enc(r, "Done") + [IM_END]
    p1, rec1, _ = turn(s, chat(Message("user", "a")), out)
    p2, rec2, _ = turn(s, chat(Message("user", "a"), Message("assistant", "Done"), Message("user", "b")), enc(r, "ok") + [IM_END])
    node = s.tree.record_node(rec2.call_index)
    toks, prov, is_out = s.tree.path_tokens(node), s.tree.path_provenance(node), s.tree.path_output_mask(node)
    k = len(p1.input_ids) + len(out)  # position right after the sampled <|im_end|>
    assert toks[k - 1] == IM_END and is_out[k - 1] and prov[k - 1] == Provenance.POLICY  # EOS is sampled: a target
    assert toks[k] == NL and not is_out[k] and prov[k] == Provenance.EXTERNAL
    assert is_out.sum() == len(out) + len(enc(r, "ok")) + 1 and not is_out[: len(p1.input_ids)].any()
    assert (rec2.input_provenance == Provenance.POLICY).sum() == len(out)  # reused outputs keep policy provenance


def test_reserialised_tool_json_is_restored_keeping_the_incoming_id(qwen_renderer):
    r = qwen_renderer
    s = TitoSession("e", r)
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}]
    body = {"messages": [{"role": "user", "content": "go"}], "tools": tools}
    out = enc(r, '<tool_call>\n{"name": "Bash", "arguments": {"description": "d",  "command": "ls"}}\n</tool_call>') + [IM_END]
    p1, rec1, m1 = turn(s, normalize_anthropic(body), out)
    assert m1.tool_calls[0].arguments == '{"description": "d",  "command": "ls"}'  # the model's own bytes
    echo = {"role": "assistant", "content": [{"type": "tool_use", "id": m1.tool_calls[0].id, "name": "Bash",
                                              "input": {"command": "ls", "description": "d"}}]}  # schema order
    res = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m1.tool_calls[0].id, "content": "file"}]}
    req2 = normalize_anthropic({"messages": body["messages"] + [echo, res], "tools": tools})
    assert req2.messages[1].tool_calls[0].arguments == '{"command": "ls", "description": "d"}'
    p2 = s.prepare(req2)
    assert p2.restored_calls == 1 and p2.identified[1] == 0
    restored = p2.messages[1].tool_calls[0]
    assert restored.id == m1.tool_calls[0].id and restored.arguments == '{"description": "d",  "command": "ls"}'
    n = len(p1.input_ids) + len(out)
    assert p2.input_ids[:n].tolist() == p1.input_ids.tolist() + out and p2.input_ids[n] == NL
    # a changed value is not the same call: no restoration, a new branch inside the output
    changed = dict(echo, content=[dict(echo["content"][0], input={"command": "rm -rf /", "description": "d"})])
    p3 = s.prepare(normalize_anthropic({"messages": body["messages"] + [changed, res], "tools": tools}))
    assert p3.restored_calls == 0 and p3.identified[1] is None
    assert len(p1.input_ids) <= s.tree.match(p3.input_ids).depth < n


@pytest.mark.parametrize("restore_reasoning", [True, False])
def test_stripped_think_block(qwen_renderer, restore_reasoning):
    r = qwen_renderer
    s = TitoSession("e", r, restore_reasoning=restore_reasoning)
    out = enc(r, "<think>\nplan\n</think>\n\nDone") + [IM_END]
    p1, _, m1 = turn(s, chat(Message("user", "a")), out)
    assert m1.reasoning == "plan" and m1.content == "Done"
    req2 = chat(Message("user", "a"), Message("assistant", "Done"), Message("user", "b"))  # harness dropped the think
    p2 = s.prepare(req2)
    n1 = len(p1.input_ids)
    if restore_reasoning:
        assert p2.input_ids[: n1 + len(out)].tolist() == p1.input_ids.tolist() + out
        assert p2.identified[1] == 0
    else:
        expect = enc(r, "Done<|im_end|>\n<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n")
        assert p2.input_ids.tolist() == p1.input_ids.tolist() + expect
        assert s.tree.match(p2.input_ids).depth == n1  # a new branch at the output's start


def test_consecutive_tool_results_share_one_block(qwen_renderer):
    r = qwen_renderer
    s = TitoSession("e", r)
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = enc(r, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>') + [IM_END]
    p1, _, m1 = turn(s, chat(Message("user", "a"), tools=tools), out)
    a, b = m1.tool_calls
    req2 = chat(Message("user", "a"), m1, Message("tool", "B", tool_call_id=b.id), Message("tool", "A", tool_call_id=a.id),
                tools=tools)
    p2 = s.prepare(req2)
    delta = p2.input_ids[len(p1.input_ids) + len(out):].tolist()
    assert delta == [NL] + enc(r, "<|im_start|>user\n<tool_response>\nB\n</tool_response>\n<tool_response>\nA\n"
                                  "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert delta.count(IM_START) == 2  # one user turn for both results, then the generation prompt
    # rendering the results one at a time would differ
    one = r.encode(r.render([{"role": "tool", "content": "B"}]) + r.render([{"role": "tool", "content": "A"}]))
    assert one != delta[1:-3]


def test_empty_think_block_of_enable_thinking_false_is_kept(qwen_renderer):
    r = qwen_renderer
    s = TitoSession("e", r)
    kw = {"enable_thinking": False}
    p1, _, _ = turn(s, chat(Message("user", "a"), template_kwargs=kw), enc(r, "x") + [IM_END])
    empty = enc(r, "<think>\n\n</think>\n\n")
    assert p1.input_ids[-len(empty):].tolist() == empty
    req2 = chat(Message("user", "a"), Message("assistant", "x"), Message("user", "b"), template_kwargs=kw)
    p2 = s.prepare(req2)
    assert p2.input_ids[: len(p1.input_ids)].tolist() == p1.input_ids.tolist()  # the empty block stays
    naive = r.encode(r.render([m.template_dict() for m in req2.messages], add_generation_prompt=True, template_kwargs=kw))
    assert naive[: len(p1.input_ids)] != p1.input_ids.tolist()  # a re-render removes it


def test_non_canonical_sampled_ids_are_kept(qwen_renderer):
    r = qwen_renderer
    s = TitoSession("e", r)
    sampled = enc(r, "Hel") + enc(r, "lo") + [IM_END]
    assert enc(r, "Hello") + [IM_END] != sampled  # decode -> encode would change them
    p1, _, m1 = turn(s, chat(Message("user", "a")), sampled)
    p2 = s.prepare(chat(Message("user", "a"), Message("assistant", "Hello"), Message("user", "b")))
    assert p2.input_ids[len(p1.input_ids): len(p1.input_ids) + len(sampled)].tolist() == sampled


def test_identified_output_is_spliced_into_a_new_context(qwen_renderer):
    r = qwen_renderer
    s = TitoSession("e", r)
    out = enc(r, "<think>\nR\n</think>\n\nstep") + [IM_END]
    p1, rec1, m1 = turn(s, chat(Message("system", "S"), Message("user", "task")), out)
    # post-compaction context: a summary, then the most recent turn kept verbatim
    req = chat(Message("system", "S"), Message("user", "SUMMARY"), Message("assistant", "step", "R"), Message("user", "go"))
    p = s.prepare(req)
    ids = p.input_ids.tolist()
    k = ids.index(IM_START, len(enc(r, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nSUMMARY<|im_end|>\n")) - 1)
    opening = enc(r, "<|im_start|>assistant\n")
    assert ids[k: k + len(opening) + len(out)] == opening + out
    prov = p.input_provenance[k + len(opening): k + len(opening) + len(out)]
    assert (prov == Provenance.POLICY).all() and p.identified == [None, None, 0, None]
    assert ids == r.encode(r.render([m.template_dict() for m in req.messages], add_generation_prompt=True))


def test_backs_off_from_a_cut_inside_a_tool_group(local_renderer):
    r = local_renderer
    s = TitoSession("e", r)
    calls = (ToolCall("c1", "f", "{}"), ToolCall("c2", "f", "{}"))
    base = [Message("user", "u"), Message("assistant", "", None, calls)]  # a foreign assistant turn
    p1, _, _ = turn(s, chat(*base, Message("tool", "A", tool_call_id="c1")), r.encode("x") + [r.eos_id])
    req2 = chat(*base, Message("tool", "A", tool_call_id="c1"), Message("tool", "B", tool_call_id="c2"))
    p2 = s.prepare(req2)
    full = r.encode(r.render([m.template_dict() for m in req2.messages], add_generation_prompt=True))
    assert p2.input_ids.tolist() == full
    prefix = r.encode(r.render([m.template_dict() for m in base]))
    assert p2.reused_tokens == len(prefix)  # reused up to the assistant turn, not into the tool block


def test_record_cache_size_changes_nothing_but_memory(qwen_renderer):
    """Main agent and a sub-agent interleaved: with a one-record cache every continuation is read
    back from the tree, with the default the extended record leaves the cache; the inputs are the
    same token for token, and the default cache holds the threads' latest records only."""
    r = qwen_renderer

    def run(session):
        main = [Message("system", "sys"), Message("user", "fix the bug")]
        sub = [Message("system", "sys"), Message("user", "search the code")]
        inputs = []
        for k in range(4):
            for conv, word in ((main, "main"), (sub, "sub")):
                p, rec, msg = turn(session, chat(*conv), enc(r, f"{word} step {k}") + [IM_END])
                inputs.append((p.input_ids.tolist(), p.input_provenance.tolist(), p.reused_tokens))
                conv += [msg, Message("user", f"{word} result {k} " + "x" * 40)]
        return inputs

    small, default = TitoSession("e", r, recent_records=1), TitoSession("e", r)
    a, b = run(small), run(default)
    assert a == b
    assert all(reused > 0 for _, _, reused in a[2:])  # every later call continued its thread
    latest_main, latest_sub = 6, 7
    assert list(default._recent) == [latest_main, latest_sub]
    ids, _, out, _, buffer = default._recent[latest_main]
    assert ids is default.tree.index.anchors[-2].input_ids and out is default.tree.index.anchors[-2].output_ids
    assert ids.base is buffer.ids  # every main input was written after the previous one, in place


def test_the_same_text_output_twice_is_identified_by_position(qwen_renderer):
    """An agent that answers the same text twice: both echoes match by content, and each is taken
    as the output at its own place in the conversation, so the whole history is reused."""
    r = qwen_renderer
    s = TitoSession("e", r)
    same = enc(r, "Let me look.") + [IM_END]
    conv = [Message("system", "sys"), Message("user", "task")]
    prev_len = 0
    for k in range(3):
        p, rec, msg = turn(s, chat(*conv), same)
        if k:
            assert p.reused_tokens == prev_len + len(same) + 1  # the previous call's whole input and output, and its "\n"
        prev_len = len(p.input_ids)
        conv += [Message("assistant", msg.content), Message("user", f"result {k}")]
    assert p.identified == [None, None, 0, None, 1, None]
    assert s.tree.num_nodes == 3 and len(s.tree.leaves()) == 1  # one node per call: one thread, no branch


class _CountingPool:
    """A thread pool that counts what it is given (``loop.run_in_executor`` calls ``submit``)."""

    def __init__(self):
        import concurrent.futures

        self.pool, self.texts = concurrent.futures.ThreadPoolExecutor(1), []

    def submit(self, fn, plan, *args):  # the session's encoding: (plan, token limit)
        self.texts.append(list(plan.texts))
        return self.pool.submit(fn, plan, *args)


@pytest.mark.parametrize("chars, off_loop", [(200, False), (900, False), (1100, True), (4000, True)])
def test_long_new_text_is_encoded_in_the_pool_with_the_same_ids(qwen_renderer, chars, off_loop):
    import asyncio

    from gyre.proxy.tito import INLINE_ENCODE_MAX_CHARS

    assert INLINE_ENCODE_MAX_CHARS == 1024
    text = ("def f(x):\n    return x * 2\n" * 200)[:chars]
    reqs = [chat(Message("user", "run it")),
            chat(Message("user", "run it"), Message("assistant", "ok"), Message("user", text))]
    sync, pooled, pool = TitoSession("a", qwen_renderer), TitoSession("b", qwen_renderer), _CountingPool()
    try:
        for req in reqs:
            want = sync.prepare(req)
            got = asyncio.run(pooled.prepare_async(req, pool))
            assert got.input_ids.tolist() == want.input_ids.tolist()
            for s, p in ((sync, want), (pooled, got)):
                s.commit(p, output_ids=enc(qwen_renderer, "ok") + [IM_END], output_logprobs=np.full(2, -0.5),
                         finish_reason="stop", output_message=Message("assistant", "ok"), role="main")
    finally:
        pool.pool.shutdown()
    # the first request's few characters are encoded inline; the second's new text (the template's
    # text around it included) in the pool only when it is over the limit
    assert len(pool.texts) == int(off_loop)
    if off_loop:
        assert text in "".join(pool.texts[0]) and sum(map(len, pool.texts[0])) > INLINE_ENCODE_MAX_CHARS
