"""What one request holds while its new messages render, by tracemalloc: a 200 KB tool-call argument
of 100,000 nested brackets (``gyre/testing/hostile_cases.py``'s ``depth_case``) is held once by
the request and once more by the one rendering of a window kept at a time (gyre/proxy/render.py);
the piece bound refuses it before its text is copied out (gyre/proxy/tito_input.py,
``InputPlan.text_span``). Beside it, the verdicts do not change: without a limit the input is the
full rendering's tokens, the limit refuses exactly the prompts its tokens exceed, and a long text
the template drops is never refused."""

from __future__ import annotations

import gc
import json
import tracemalloc

import pytest

from gyre.proxy.api import normalize
from gyre.proxy.messages import ChatRequest, Message
from gyre.proxy.piece_encode import PromptTooLong
from gyre.proxy.tito import TitoSession
from gyre.testing.hostile_cases import depth_case

LIMIT = 32767


def _deep_request(api: str) -> ChatRequest:
    return normalize(api, json.loads(depth_case(api, False, "tool_args", 100_000, False, 128).raw))


def _long_text(req: ChatRequest) -> int:
    return max(len(tc.arguments) for m in req.messages for tc in m.tool_calls)


def _prepare_peak(renderer, req: ChatRequest, limit: int | None) -> tuple[int, Exception | None]:
    """(bytes traced at the peak of a fresh session's ``prepare``, the error it raised)."""
    session = TitoSession("e", renderer)
    gc.collect()
    tracemalloc.start()
    err = None
    try:
        session.prepare(req, limit)
    except PromptTooLong as exc:
        err = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, err


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_deep_bracket_argument_is_refused_holding_one_rendering(local_renderer, api):
    req = _deep_request(api)
    n = _long_text(req)
    assert n > 200_000
    _prepare_peak(local_renderer, req, LIMIT)  # the tokenizer's caches are built on first use
    peak, err = _prepare_peak(local_renderer, req, LIMIT)
    assert isinstance(err, PromptTooLong) and err.status == 400 and err.at_least > LIMIT
    # one rendering of the window beside the request's own text, and transient working memory;
    # renderings held side by side and the text cut out for encoding took 4.1 times the text
    assert peak < 1.5 * n, (peak, n)


def test_without_a_limit_the_input_is_the_full_rendering_and_the_limit_is_exact(local_renderer):
    r = local_renderer
    req = _deep_request("chat")
    full = r.encode(r.render([m.template_dict() for m in req.messages], req.tools, add_generation_prompt=True))
    assert TitoSession("e", r).prepare(req).input_ids.tolist() == full
    assert TitoSession("e", r).prepare(req, len(full)).input_ids.tolist() == full
    with pytest.raises(PromptTooLong):
        TitoSession("e", r).prepare(req, len(full) - 1)


def test_a_long_run_the_template_drops_is_not_refused(qwen3_renderer):
    """Qwen3's own template drops the reasoning of a turn before the last user query: a prompt that
    holds it only in a window rendering, never in the input, fits."""
    r = qwen3_renderer
    msgs = [Message("user", "q"), Message("assistant", "a", "[" * 100_000 + "1" + "]" * 100_000),
            Message("user", "next")]
    req = ChatRequest(api="chat", messages=msgs)
    prep = TitoSession("e", r).prepare(req, 200)
    assert prep.input_ids.tolist() == r.encode(r.render([m.template_dict() for m in msgs], add_generation_prompt=True))
    assert len(prep.input_ids) < 200
    last = [Message("user", "q"), msgs[1]]  # kept when it is the last turn: then refused by its bound
    with pytest.raises(PromptTooLong):
        TitoSession("e", r).prepare(ChatRequest(api="chat", messages=last), 200)
