"""Rendering work per call grows linearly in what is new (render.py's sliding-window test of long
tool-result groups, tito.py's match/draft/complete split), with the same tokens as a full render."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy import render
from gyre.proxy.messages import ChatRequest, Message, ToolCall
from gyre.proxy.render import GROUP_WINDOW, ChatRenderer
from gyre.proxy.tito import INLINE_RENDER_MAX_MESSAGES, TitoSession
from tests.proxy.conftest import hypothesis_examples

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class _CountingRenderer(ChatRenderer):
    """The real renderer, counting template calls and the messages and characters passed to them."""

    def __init__(self, tokenizer):
        self.reset()
        super().__init__(tokenizer)
        self.reset()

    def reset(self):
        self.calls = self.messages = self.chars = 0

    def render(self, messages, tools=None, **kw):
        self.calls += 1
        self.messages += len(messages)
        self.chars += sum(len(m.get("content") or "") for m in messages)
        return super().render(messages, tools, **kw)


def _full_ids(r, msgs, tools=TOOLS, gen=True):
    return r.encode(r.render([m.template_dict() for m in msgs], tools, add_generation_prompt=gen))


def _turn(session, request, out: Message):
    """prepare -> the output's canonical ids -> commit; returns the prepared input."""
    r = session.renderer
    prep = session.prepare(request)
    ids = r.encode(r.assistant_output_text(out))
    session.commit(prep, output_ids=ids, output_logprobs=np.zeros(len(ids)), finish_reason="stop",
                   output_message=out, role="main")
    return prep


def _tool_turn(n: int):
    """System + task, an output with ``n`` tool calls, its ``n`` results and the next user message."""
    head = [Message("system", "S"), Message("user", "inspect the files")]
    calls = tuple(ToolCall(f"c{i}", "f", json.dumps({"path": f"f{i}.py"})) for i in range(n))
    out = Message("assistant", "", None, calls)
    results = [Message("tool", f"contents of f{i}.py: " + "x = 1\n" * 3, tool_call_id=f"c{i}") for i in range(n)]
    return head, out, head + [out] + results + [Message("user", "next")]


def _tool_turn_work(r: _CountingRenderer, n: int) -> tuple[int, int, int]:
    s = TitoSession("e", r)
    head, out, req = _tool_turn(n)
    _turn(s, ChatRequest("chat", head, tools=TOOLS), out)
    r.reset()
    s.prepare(ChatRequest("chat", req, tools=TOOLS))
    return r.calls, r.messages, r.chars


def test_work_for_tool_results_in_one_turn_grows_linearly(local_renderer):
    r = _CountingRenderer(local_renderer.tokenizer)
    small, large = _tool_turn_work(r, 60), _tool_turn_work(r, 240)
    for a, b in zip(small, large):  # calls, messages, characters: 4x the results, ~4x the work (16x if quadratic)
        assert 3.5 < b / a < 4.5, (small, large)
    # each result costs two template calls of a few messages, plus two renders of the whole group
    assert large[0] < 2 * 240 + 20 and large[1] < (2 * GROUP_WINDOW + 1) * 240 + 2 * 240 + 40


def test_work_for_many_messages_grows_linearly_and_an_extension_costs_what_is_new(local_renderer):
    r = _CountingRenderer(local_renderer.tokenizer)

    def work(n):
        s = TitoSession("e", r)
        conv = [Message("user" if i % 2 == 0 else "assistant", f"m{i}") for i in range(n)]
        r.reset()
        prep = s.prepare(ChatRequest("chat", conv))
        first = (r.calls, r.messages, r.chars)
        out = Message("assistant", "done")
        ids = r.encode(r.assistant_output_text(out))
        s.commit(prep, output_ids=ids, output_logprobs=np.zeros(len(ids)), finish_reason="stop", output_message=out,
                 role="main")
        r.reset()
        ext = s.prepare(ChatRequest("chat", conv + [out, Message("user", "next")]))
        assert ext.reused_tokens == len(prep.input_ids) + len(ids) + 1
        return first, (r.calls, r.messages, r.chars)

    (first_s, ext_s), (first_l, ext_l) = work(201), work(801)
    for a, b in zip(first_s, first_l):
        assert 3.5 < b / a < 4.5, (first_s, first_l)
    assert ext_s == ext_l  # the next call renders its one new message, however long the history


def _reference(r, prev, new, tools):
    """Brute force: every boundary tested in the whole history, segments cut out of one full render."""
    hist = ([prev] if prev is not None else []) + list(new)
    dicts = [m.template_dict() for m in hist]
    use_tools = tools if prev is None else None
    k0 = 1 if prev is not None else 0
    texts = [r.render(dicts[:k + 1], use_tools) for k in range(len(dicts))]
    cuts = [k for k in range(k0, len(dicts) - 1) if texts[k + 1].startswith(texts[k])] + [len(dicts) - 1]
    segs, start, off = [], k0, len(texts[k0 - 1]) if k0 else 0
    for k in cuts:
        segs.append((start - k0, k - k0, r.encode(texts[k][off:])))
        start, off = k + 1, len(texts[k])
    gen = r.render(dicts, use_tools, add_generation_prompt=True)
    assert gen.startswith(texts[-1])
    return segs, r.encode(gen[len(texts[-1]):])


_roles = st.lists(st.sampled_from(["user", "assistant", "tool", "tool", "tool", "tool"]), min_size=1, max_size=40)


@pytest.fixture(params=["texts", "digests"])
def kept(request, monkeypatch):
    """Renderings kept for prefix tests as their texts (the default for short ones), or as their
    lengths and digests (what long ones get), for every rendering."""
    if request.param == "digests":
        monkeypatch.setattr(render, "KEEP_TEXT_CHARS", 0)
    return request.param


@settings(max_examples=hypothesis_examples(25), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(roles=_roles, system=st.booleans(), cut=st.integers(0, 39))
def test_delta_equals_the_brute_force_reference(local_renderer, kept, roles, system, cut):
    r = local_renderer
    msgs = ([Message("system", "S")] if system else []) + [
        Message(role, f"{role} {i}", "why" if role == "assistant" and i % 3 == 0 else None) for i, role in
        enumerate(roles)]
    want, gen = _reference(r, None, msgs, TOOLS)
    d = r.render_delta(None, msgs, TOOLS, add_generation_prompt=True)
    assert [(s.first, s.last, s.ids) for s in d.segments] == want and d.gen_ids == gen
    assert sum((s.ids for s in d.segments), []) + d.gen_ids == _full_ids(r, msgs)
    d = r.render_delta(None, msgs, TOOLS, add_generation_prompt=False)  # a run before a spliced output
    assert [(s.first, s.last, s.ids) for s in d.segments] == want and d.gen_ids == []
    # from a cuttable boundary inside the conversation, as a later call renders its new messages
    ends = [s[1] for s in want[:-1]]
    if ends:
        k = ends[cut % len(ends)]
        want, gen = _reference(r, msgs[k], msgs[k + 1:], None)
        d = r.render_delta(msgs[k], msgs[k + 1:], None, add_generation_prompt=True)
        assert [(s.first, s.last, s.ids) for s in d.segments] == want and d.gen_ids == gen


def test_a_long_tool_group_after_an_assistant_turn_on_qwen3_s_own_template(qwen3_renderer, local_renderer, kept):
    calls = tuple(ToolCall(f"c{i}", "f", "{}") for i in range(12))
    prev = Message("assistant", "", None, calls)
    new = [Message("tool", f"r{i}", tool_call_id=f"c{i}") for i in range(12)] + [Message("user", "next")]
    for r in (qwen3_renderer, local_renderer):
        want, gen = _reference(r, prev, new, None)
        d = r.render_delta(prev, new, None, add_generation_prompt=True)
        assert [(s.first, s.last) for s in d.segments] == [(0, 11), (12, 12)]
        assert [(s.first, s.last, s.ids) for s in d.segments] == want and d.gen_ids == gen
        d = r.render_delta(prev, new[:12], None, add_generation_prompt=False)  # the open long group's rendering
        assert [(s.first, s.last, s.ids) for s in d.segments] == [(0, 11, want[0][2])]


def test_a_sliding_window_the_template_refuses_gets_the_whole_window_test(tiny_model_dir, local_renderer):
    from tests.proxy.conftest import renderer_with_template

    strict = local_renderer.tokenizer.chat_template.replace(  # a tool result must not open the conversation
        "{%- for message in messages[ns.start:] -%}",
        "{%- if messages and messages[0].role == 'tool' -%}{{- raise_exception('a tool result opens it') -}}"
        "{%- endif -%}{%- for message in messages[ns.start:] -%}", 1)
    assert strict != local_renderer.tokenizer.chat_template
    r = renderer_with_template(tiny_model_dir, strict)
    calls = tuple(ToolCall(f"c{i}", "f", "{}") for i in range(8))
    msgs = [Message("user", "u"), Message("assistant", "", None, calls)] + [
        Message("tool", f"r{i}", tool_call_id=f"c{i}") for i in range(8)]
    d = r.render_delta(None, msgs, TOOLS, add_generation_prompt=True)
    assert [(s.first, s.last) for s in d.segments] == [(0, 0), (1, 1), (2, 9)]
    assert sum((s.ids for s in d.segments), []) + d.gen_ids == _full_ids(r, msgs)


def test_a_large_tool_group_renders_as_a_full_render_sync_and_in_the_pool(qwen_renderer):
    r = qwen_renderer
    n = 300
    head, out, req = _tool_turn(n)
    want = _full_ids(r, req)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for run in ("sync", "pool"):
            s = TitoSession("e", r)
            p1 = _turn(s, ChatRequest("chat", head, tools=TOOLS), out)
            request = ChatRequest("chat", req, tools=TOOLS)
            p2 = s.prepare(request) if run == "sync" else asyncio.run(s.prepare_async(request, pool))
            assert p2.input_ids.tolist() == want
            assert p2.identified == [None, None, 0] + [None] * (n + 1)
            n_out = len(r.encode(r.assistant_output_text(out)))
            assert p2.reused_tokens == len(p1.input_ids) + n_out + 1  # the output and its "\n" after EOS
            # the results are one segment: the boundary after the last result is the first cut
            cuts = [k for k, node in enumerate(p2.pending) if node.end >= 0]
            assert cuts == [n - 1, n]
            assert p2.pending[n - 1].end == len(want) - len(r.encode("<|im_start|>user\nnext<|im_end|>\n"
                                                                     "<|im_start|>assistant\n"))
            assert p2.pending[n].end == len(want) - len(r.encode("<|im_start|>assistant\n"))
    finally:
        pool.shutdown()


class _OneThread:
    """An executor that records which tasks it is given and runs them in one worker thread."""

    def __init__(self):
        self.pool, self.tasks = concurrent.futures.ThreadPoolExecutor(1), []

    def submit(self, fn, *args):
        self.tasks.append(fn.__name__)
        return self.pool.submit(fn, *args)


def test_many_new_messages_are_rendered_in_the_pool_with_the_same_ids(local_renderer):
    r = local_renderer
    few = [Message("user" if i % 2 == 0 else "assistant", f"m{i}") for i in range(INLINE_RENDER_MAX_MESSAGES - 1)]
    many = [Message("user" if i % 2 == 0 else "assistant", f"m{i}") for i in range(INLINE_RENDER_MAX_MESSAGES + 1)]
    ex = _OneThread()
    try:
        for conv, off_loop in ((few, False), (many, True)):
            ex.tasks.clear()
            want = TitoSession("a", r).prepare(ChatRequest("chat", conv))
            got = asyncio.run(TitoSession("b", r).prepare_async(ChatRequest("chat", conv), ex))
            assert got.input_ids.tolist() == want.input_ids.tolist() == _full_ids(r, conv, None)
            assert [(p.key, p.end) for p in got.pending] == [(p.key, p.end) for p in want.pending]
            assert ex.tasks == (["_draft_and_encode"] if off_loop else [])
    finally:
        ex.pool.shutdown()


def test_a_commit_while_the_pool_renders_does_not_change_the_input(local_renderer):
    """A call of the same execution commits while another's many new messages are rendered off the
    loop: the second input is the one it would have got had it been prepared before that commit."""
    r = local_renderer
    s, ref = TitoSession("e", r), TitoSession("e", r)
    conv = [Message("system", "S"), Message("user", "task")]
    out = Message("assistant", "step")
    for sess in (s, ref):
        _turn(sess, ChatRequest("chat", conv), out)
    long = conv + [out] + [Message("tool", f"r{i}") for i in range(3 * INLINE_RENDER_MAX_MESSAGES)]
    sibling = conv + [out, Message("user", "other")]
    want = ref.prepare(ChatRequest("chat", long))

    class _CommitFirst:
        """Runs the sibling call's prepare + commit on the loop's thread before the pool task."""

        def submit(self, fn, *args):
            _turn(s, ChatRequest("chat", sibling), Message("assistant", "sib"))
            fut = concurrent.futures.Future()
            fut.set_result(fn(*args))
            return fut

    got = asyncio.run(s.prepare_async(ChatRequest("chat", long), _CommitFirst()))
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.reused_tokens == want.reused_tokens > 0
    done = Message("assistant", "done")  # it commits after the sibling, and the next call continues it
    ids = r.encode(r.assistant_output_text(done))
    s.commit(got, output_ids=ids, output_logprobs=np.zeros(len(ids)), finish_reason="stop", output_message=done,
             role="main")
    node = s.tree.record_node(2)
    assert len(s.tree.records) == 3
    assert s.tree.path_tokens(node)[:len(want.input_ids)].tolist() == want.input_ids.tolist()
    nxt = s.prepare(ChatRequest("chat", long + [done, Message("user", "more")]))
    assert nxt.reused_tokens == len(got.input_ids) + len(ids) + 1


def test_an_execution_released_while_the_pool_renders_still_gets_its_input(local_renderer):
    """The server releases a closed execution's session (trie, caches, tree) once nothing is left
    to commit; a call still being prepared read its stored tokens before the pool took over."""
    r = local_renderer
    s, ref = TitoSession("e", r), TitoSession("e", r)
    conv = [Message("system", "S"), Message("user", "task")]
    out = Message("assistant", "step")
    for sess in (s, ref):
        _turn(sess, ChatRequest("chat", conv), out)
    long = ChatRequest("chat", conv + [out] + [Message("tool", f"r{i}") for i in range(3 * INLINE_RENDER_MAX_MESSAGES)])
    want = ref.prepare(long)

    class _ReleaseFirst:
        def submit(self, fn, *args):
            s.release()
            s.tree = None
            fut = concurrent.futures.Future()
            fut.set_result(fn(*args))
            return fut

    got = asyncio.run(s.prepare_async(long, _ReleaseFirst()))
    assert got.input_ids.tolist() == want.input_ids.tolist() and got.reused_tokens == want.reused_tokens > 0
