"""SmolLM2-135M-Instruct's ChatML template (tests/fixtures/smollm2_chat_template.jinja; the real converted
tokenizer when tools/setup_real_model.sh has run) with the proxy: the prompt a TITO session gives the
engine at each turn is token for token transformers' ``apply_chat_template`` of the conversation so far,
with the sampled replies spliced in (gyre/proxy/render.py, gyre/proxy/tito.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.proxy.messages import ChatRequest, Message
from tests.proxy.conftest import renderer_with_template
from tests.proxy.test_tito import turn

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2_chat_template.jinja"
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]

#: (system prompt or None, user turns, assistant replies, tools): each reply answers the user turn before it
CONVERSATIONS = [
    (None, ["Name one fruit."], [], None),
    (None, ["What is 2+3?", "And 4+4?", "Thanks!"], ["2+3 = 5.", "4+4 is 8"], None),
    ("You answer in one word.", ["Capital of France?", "Of Italy?"], [" Paris", "Rome.\n\nDone"], None),
    ("", ["Write 7 to answer.txt"], ["I cannot write files."], TOOLS),
    (None, ["héllo 🌍\n  with  spaces", "<b>tags</b> & {{ braces }}"], ["Ça va? 👋"], None),
]


@pytest.fixture(scope="module", params=["fixture-template", "converted"])
def smollm2(request):
    """``(renderer, tokenizer)``: the fast local tokenizer with the fixture template, or the converted
    SmolLM2 tokenizer (which must carry the same template)."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer

    if request.param == "fixture-template":
        model_dir = request.getfixturevalue("tiny_model_dir")
        r = renderer_with_template(model_dir, TEMPLATE.read_text())
        return r, r.tokenizer
    tok = load_tokenizer(request.getfixturevalue("smollm2_model_dir"))
    assert tok.chat_template == TEMPLATE.read_text()
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    return ChatRenderer(tok), tok


def test_the_renderer_reads_the_template(smollm2):
    r, _ = smollm2
    assert r.assistant_open == "" and r.assistant_close == "<|im_end|>\n" and r.after_eos == "\n"
    assert r.generation_prompt() == "<|im_start|>assistant\n"
    # no system message: the template writes its own default system turn first
    assert r.render([{"role": "user", "content": "u"}]) == DEFAULT_SYSTEM + "<|im_start|>user\nu<|im_end|>\n"


def _transformers_ids(tok, messages, tools):
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return list(out)


@pytest.mark.parametrize("system, users, replies, tools", CONVERSATIONS)
def test_each_turn_s_prompt_is_transformers_apply_chat_template(smollm2, system, users, replies, tools):
    from gyre.proxy.tito import TitoSession

    r, tok = smollm2
    s = TitoSession("e", r)
    history = [] if system is None else [Message("system", system)]
    for i, user in enumerate(users):
        history.append(Message("user", user))
        reply = replies[i] if i < len(replies) else "ok"
        sampled = r.encode(reply) + [r.eos_id]
        prep, _, msg = turn(s, ChatRequest("chat", list(history), tools=list(tools or [])), sampled)
        want = _transformers_ids(tok, [m.template_dict() for m in history], tools)
        assert prep.input_ids.tolist() == want, (i, r.decode(prep.input_ids.tolist()), tok.decode(want))
        assert msg.content == reply
        if i:  # the earlier turns' ids are reused, not re-rendered
            assert prep.reused_tokens > 0
        history.append(Message("assistant", reply))
