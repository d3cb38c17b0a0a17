"""Fixtures of the proxy tests: chat renderers on the embedded tokenizers (loaded once)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def local_renderer(tiny_model_dir):
    """:class:`~gyre.proxy.render.ChatRenderer` on the fast ``local`` tokenizer."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer

    return ChatRenderer(load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="session")
def qwen_renderer(tiny_qwen_model_dir):
    """:class:`~gyre.proxy.render.ChatRenderer` on the full Qwen vocabulary (token ids equal Qwen3's)."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer

    return ChatRenderer(load_tokenizer(tiny_qwen_model_dir))


#: Qwen3's own chat template (provenance: tests/fixtures/README.md).
QWEN3_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_chat_template.jinja"


def renderer_with_template(model_dir, template: str):
    """A :class:`~gyre.proxy.render.ChatRenderer` on a fresh copy of ``model_dir``'s tokenizer whose
    chat template is ``template`` (raises what the renderer raises for it)."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer

    tok = load_tokenizer(model_dir)
    tok.chat_template = template
    return ChatRenderer(tok)


@pytest.fixture(scope="session")
def qwen3_renderer(tiny_qwen_model_dir):
    """:class:`~gyre.proxy.render.ChatRenderer` on the Qwen vocabulary with Qwen3's own chat template."""
    return renderer_with_template(tiny_qwen_model_dir, QWEN3_TEMPLATE.read_text())


def hypothesis_examples(n: int) -> int:
    """Hypothesis example count: ``n`` scaled by ``$GYRE_HYPOTHESIS_SCALE`` (default 1) for deep runs."""
    import os

    return max(1, int(n * float(os.environ.get("GYRE_HYPOTHESIS_SCALE", "1"))))
