"""Fixtures of the proxy tests: chat renderers on the embedded tokenizers (loaded once)."""

from __future__ import annotations

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


def hypothesis_examples(n: int) -> int:
    """Hypothesis example count: ``n`` scaled by ``$GYRE_HYPOTHESIS_SCALE`` (default 1) for deep runs."""
    import os

    return max(1, int(n * float(os.environ.get("GYRE_HYPOTHESIS_SCALE", "1"))))
