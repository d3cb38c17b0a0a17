"""A prompt whose size alone proves it too long is refused before tokenisation
(gyre/proxy/prompt_size.py; the server over real HTTP on 127.0.0.1)."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from gyre.proxy.api import normalize
from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.prompt_size import check_prompt_size, max_token_bytes, prompt_chars_lower_bound
from gyre.proxy.server import ProxyConfig, ProxyServer


def test_max_token_bytes_is_the_longest_decoded_token(local_renderer, qwen_renderer):
    for r in (local_renderer, qwen_renderer):
        tok = r.tokenizer
        brute = max(len(tok.decode([i]).encode("utf-8", "surrogatepass")) for i in range(len(tok)))
        assert max_token_bytes(tok) == brute
    assert max_token_bytes(qwen_renderer.tokenizer) == 128          # a run of 128 spaces


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
        chars = prompt_chars_lower_bound(req)
        assert chars >= 2 * len(text)
        n = len(r.encode(r.render([m.template_dict() for m in req.messages], tools=req.tools,
                                  add_generation_prompt=True)))
        assert n >= chars // L, (n, chars, L)
        check_prompt_size(req, n + 1, r.tokenizer)                  # a context that fits is never refused


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
