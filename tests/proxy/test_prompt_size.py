"""A prompt whose size alone proves it too long is refused before tokenisation, and only then
(gyre/proxy/prompt_size.py against the real chat templates; the server over real HTTP on 127.0.0.1)."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy.api import normalize
from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ChatRequest, Message, ToolCall
from gyre.proxy.prompt_size import PARTS, check_prompt_size, max_token_bytes, prompt_chars_lower_bound
from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.proxy.conftest import hypothesis_examples, renderer_with_template

#: A template of our own that drops much of what it is given: system text, the content of every
#: assistant turn but the last, reasoning, and all of a tool definition but its name; it trims text.
DROPPING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '<|im_start|>system\\n(withheld)<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.last -%}{{- m.content | trim -}}{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{{- '\\n<tool_call>' + tc.function.name + ' ' + tc.function.arguments + '</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content | trim + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}{{- '<|im_start|>system\\nTools: ' + (tools | map(attribute='function.name') | join(', '))"
    " + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def dropping_renderer(tiny_qwen_model_dir):
    return renderer_with_template(tiny_qwen_model_dir, DROPPING_TEMPLATE)


def _tokens(r, req: ChatRequest) -> int:
    """Tokens of ``req``'s prompt as the template renders it (generation prompt included)."""
    text = r.render([m.template_dict() for m in req.messages], req.tools, add_generation_prompt=True,
                    template_kwargs=req.template_kwargs)
    return len(r.encode(text))


def test_each_template_keeps_what_its_text_shows(local_renderer, qwen_renderer, qwen3_renderer, dropping_renderer):
    assert local_renderer.kept_parts == qwen_renderer.kept_parts == frozenset(PARTS)   # Gyre's own template
    # Qwen3's drops reasoning and <think> markup in content before the last user query
    assert qwen3_renderer.kept_parts == frozenset(PARTS) - {"reasoning", "think_markup"}
    assert dropping_renderer.kept_parts == {"user", "tool_results", "tool_calls"}


def test_think_text_qwen3_drops_is_not_counted(qwen3_renderer, qwen_renderer):
    """An earlier turn's <think> block in assistant content: Qwen3's template drops it, so a prompt
    that fits is served; Gyre's template keeps it, so the same request is refused."""
    think = " " * 128 * 400                                          # 400 tokens of 128 spaces each
    req = ChatRequest("chat", [Message("user", "q"), Message("assistant", f"<think>\n{think}\n</think>\n\nok"),
                               Message("user", "next")])
    L = max_token_bytes(qwen3_renderer.tokenizer)
    assert L == 128
    n3, n = _tokens(qwen3_renderer, req), _tokens(qwen_renderer, req)
    assert n3 < 40 < 400 < n
    check_prompt_size(req, 100, qwen3_renderer.tokenizer, kept=qwen3_renderer.kept_parts)  # fits: served
    assert prompt_chars_lower_bound(req, qwen3_renderer.kept_parts) == len("q") + len("ok") + len("next")
    with pytest.raises(ProxyError, match="prompt is too long"):   # what counting every part did
        check_prompt_size(req, 100, qwen3_renderer.tokenizer, kept=PARTS)
    with pytest.raises(ProxyError, match="prompt is too long"):
        check_prompt_size(req, 100, qwen_renderer.tokenizer, kept=qwen_renderer.kept_parts)


# Mostly runs of 16 x 128 spaces (16 tokens of L = 128 bytes on the Qwen vocabulary), so that the real
# token count is close to the bound and counting a dropped part would show as a refused prompt that fits.
def test_system_text_a_template_drops_is_not_counted(dropping_renderer, qwen_renderer):
    req = ChatRequest("chat", [Message("system", "[" + " " * 128 * 300 + "]"), Message("user", "hi")])
    n_dropping, n = _tokens(dropping_renderer, req), _tokens(qwen_renderer, req)
    assert n_dropping < 30 < 300 < n
    check_prompt_size(req, 100, dropping_renderer.tokenizer, kept=dropping_renderer.kept_parts)
    with pytest.raises(ProxyError, match="at least 300 tokens"):
        check_prompt_size(req, 100, qwen_renderer.tokenizer, kept=qwen_renderer.kept_parts)


_CHUNKS = [" " * 128 * 16] * 6 + [" " * 40, "a", "\n", "x y", "<think>", "</think>", "\n\n", "字", "{}"]
# mostly between non-space ends, since the bound leaves out the whitespace around each part
_text = st.builds(lambda a, chunks, b: a + "".join(chunks) + b, st.sampled_from(["[", "[", ""]),
                  st.lists(st.sampled_from(_CHUNKS), max_size=12), st.sampled_from(["]", "]", ""]))
_call = st.builds(lambda name, a: ToolCall(f"c{name}", name, json.dumps({"a": a})), st.sampled_from(["f", "g"]), _text)
_message = st.one_of(
    st.builds(Message, st.just("user"), _text),
    st.builds(Message, st.just("tool"), _text, tool_call_id=st.just("cf")),
    st.builds(Message, st.just("system"), _text),
    st.builds(Message, st.just("assistant"), _text, reasoning=st.one_of(st.none(), _text),
              tool_calls=st.lists(_call, max_size=2).map(tuple)),
)
_tool = st.builds(lambda name, desc: {"type": "function", "function": {
    "name": name, "description": desc, "parameters": {"type": "object", "properties": {"a": {"type": "string",
                                                                                          "description": desc}}}}},
    st.sampled_from(["f", "g"]), _text)
_request = st.builds(lambda msgs, tools, kw: ChatRequest("chat", msgs, tools=tools, template_kwargs=kw),
                     st.lists(_message, min_size=1, max_size=7), st.lists(_tool, max_size=2),
                     st.sampled_from([{}, {"enable_thinking": False}]))


@pytest.mark.parametrize("which", ["qwen_renderer", "qwen3_renderer", "dropping_renderer", "local_renderer"])
@settings(max_examples=hypothesis_examples(80), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=_request, data=st.data())
def test_a_refused_prompt_is_longer_than_the_context(request, which, req, data):
    """Against the real renderer: whenever the bound refuses, the rendered prompt has at least
    ``max_context_tokens`` tokens. The context is drawn next to the bound (the largest refused one
    and the smallest served one), so that both verdicts occur."""
    r = request.getfixturevalue(which)
    chars = prompt_chars_lower_bound(req, r.kept_parts)
    bound = chars // max_token_bytes(r.tokenizer)
    ctx = max(1, bound + data.draw(st.integers(-1, 1), label="context - bound"))  # the sharpest contexts
    try:
        check_prompt_size(req, ctx, r.tokenizer, kept=r.kept_parts)
    except ProxyError as exc:
        assert exc.status == 400 and "prompt is too long" in exc.message
        assert _tokens(r, req) > ctx - 1
        assert ctx <= bound
    else:
        assert ctx > bound


def test_max_token_bytes_is_the_longest_decoded_token(local_renderer, qwen_renderer):
    for r in (local_renderer, qwen_renderer):
        tok = r.tokenizer
        brute = max(len(tok.decode([i]).encode("utf-8", "surrogatepass")) for i in range(len(tok)))
        assert max_token_bytes(tok) == brute
    assert max_token_bytes(qwen_renderer.tokenizer) == 128          # a run of 128 spaces


def test_max_token_bytes_decodes_a_bounded_number_of_ids_at_a_time(tiny_model_dir):
    """Built by the first request that needs it: its working memory does not grow with the
    vocabulary (all 4,122 ids of the embedded tokenizer in one call took 1.04 MB)."""
    import tracemalloc

    from gyre.embedded_model import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)  # a fresh object: nothing cached on it
    tracemalloc.start()
    try:
        got = max_token_bytes(tok)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == 64 and len(tok) == 4122
    assert peak < 200_000, peak


def test_the_bound_never_exceeds_the_real_token_count(qwen_renderer):
    """Brute force on random texts: tokens of the rendered prompt >= characters / L."""
    r = qwen_renderer
    L = max_token_bytes(r.tokenizer)
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "  ", " " * 40, "\n", "é", "字", "🙂", "def ", "tool_", "{}"]
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000)))
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}],
                "tools": [{"name": text[:50] or "t", "description": text[::-1], "input_schema": {"type": "object"}}]}
        req = normalize("anthropic", body)
        chars = prompt_chars_lower_bound(req, r.kept_parts)
        assert chars >= 2 * len(text.strip())
        n = len(r.encode(r.render([m.template_dict() for m in req.messages], tools=req.tools,
                                  add_generation_prompt=True)))
        assert n >= chars // L, (n, chars, L)
        check_prompt_size(req, n + 1, r.tokenizer, kept=r.kept_parts)  # a context that fits is never refused


@pytest.fixture()
def served(local_renderer):
    r = local_renderer
    eng = ScriptedEngine("e0", r.encode("ok") + [r.eos_id], chunk=1)
    srv = ProxyServer(r, config=ProxyConfig(max_context_tokens=131072))
    srv.add_engine(eng)
    srv.start()
    yield srv
    srv.stop()


def _huge_tool_body(mb: int = 33) -> bytes:
    name = "tool_" * (mb * 1_000_000 // 5)  # ~3M+ tokens of tool name
    return json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                       "tools": [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
                       }).encode()


def test_a_33_mb_body_is_refused_before_tokenisation(served):
    """Tokenising it took 23-25 s; the size check answers after the JSON decode (~0.5 s here;
    ``bench/chaos.py --sections huge_bodies`` measures it, alone and 8 at once)."""
    ex = served.register_execution()
    raw = _huge_tool_body()
    h = {"authorization": f"Bearer {ex.api_key}", "content-type": "application/json"}
    with httpx.Client(base_url=served.url, timeout=60) as c:
        t0 = time.perf_counter()
        r = c.post("/v1/chat/completions", content=raw, headers=h)
        took = time.perf_counter() - t0
    assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"], r.text[:300]
    assert took < 5.0, took
    assert served.counters(ex.execution_id)["rejected"] == 1
