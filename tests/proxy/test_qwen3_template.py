"""Qwen3's own chat template (tests/fixtures/qwen3_chat_template.jinja) with the proxy: the renderer
accepts it, and a TITO session on it reuses sampled ids although the template would drop earlier
<think> blocks on a re-render (gyre/proxy/render.py, gyre/proxy/tito.py)."""

from __future__ import annotations

import pytest

from gyre.proxy.messages import ChatRequest, Message
from gyre.proxy.tito import TitoSession
from tests.proxy.conftest import QWEN3_TEMPLATE, renderer_with_template
from tests.proxy.test_tito import IM_END, NL, turn


def test_the_renderer_accepts_qwen3_s_template(qwen3_renderer):
    r = qwen3_renderer
    assert r.assistant_open == "<think>\n\n</think>\n\n"       # the empty reasoning block, which the model samples
    assert r.assistant_close == "<|im_end|>\n" and r.after_eos == "\n" and r.after_eos_ids == [NL]
    assert r.generation_prompt() == "<|im_start|>assistant\n"
    assert r.generation_prompt({"enable_thinking": False}) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # what a teacher-forced engine samples: the think block, then the content and EOS
    assert r.assistant_output_text(Message("assistant", "Hi", reasoning="hm")) == "<think>\nhm\n</think>\n\nHi<|im_end|>"
    assert r.assistant_output_text(Message("assistant", "Hi")) == "<think>\n\n</think>\n\nHi<|im_end|>"


def test_other_text_before_the_content_is_refused_with_the_reason_and_the_fix(tiny_qwen_model_dir):
    moved = QWEN3_TEMPLATE.read_text().replace(
        "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')",
        "{{- '<|im_start|>' + message.role + '\\nAnswer:\\n<think>\\n' + reasoning_content.strip('\\n')")
    assert moved != QWEN3_TEMPLATE.read_text()
    with pytest.raises(ValueError) as err:
        renderer_with_template(tiny_qwen_model_dir, moved)
    msg = str(err.value)
    assert "\n" not in msg and "'Answer:\\n<think>\\n\\n</think>\\n\\n'" in msg
    assert "not the turn's (empty) reasoning block" in msg and "fix: end the template's add_generation_prompt" in msg


def test_a_tito_round_trip_splices_the_sampled_think_block(qwen3_renderer):
    r = qwen3_renderer
    s = TitoSession("e", r)
    out = r.encode("<think>\nplan\n</think>\n\nDone") + [IM_END]
    p1, _, m1 = turn(s, ChatRequest("chat", [Message("user", "a")]), out)
    assert p1.input_ids.tolist() == r.encode("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n")
    assert m1.reasoning == "plan" and m1.content == "Done"
    req2 = ChatRequest("chat", [Message("user", "a"), Message("assistant", "Done", reasoning="plan"), Message("user", "b")])
    p2, _, _ = turn(s, req2, r.encode("ok") + [IM_END])
    tail = r.encode("<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n")
    assert p2.input_ids.tolist() == p1.input_ids.tolist() + out + [NL] + tail
    assert p2.identified[1] == 0 and p2.reused_tokens >= len(p1.input_ids) + len(out)
    # the template itself drops the earlier think block: a re-render is not what the model saw
    naive = r.render([m.template_dict() for m in req2.messages], add_generation_prompt=True)
    assert "plan" not in naive and r.encode(naive) != p2.input_ids.tolist()
