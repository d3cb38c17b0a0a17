"""Encoding in bounded pieces (gyre/proxy/piece_encode.py): the same ids as one call of the
tokenizer for any text, wherever the pieces are cut; the early stop at a token limit, measured as
characters handed to the tokenizer; the lower bound of an uncut stretch; and the 400 a proxy over
real HTTP answers with for a prompt that only its tokens show to be too long."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy.engines import ScriptedEngine
from gyre.proxy.piece_encode import PieceEncoder, PromptTooLong, cuts_exactly
from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.proxy.conftest import hypothesis_examples

#: Fragments the random texts are made of: every class of the split regex, the added tokens (and
#: pieces of them), whitespace runs, multi-byte text, combining marks that compose under NFC
#: (also with ASCII: "=" + U+0338 is "≠"), contractions, control characters.
FRAGMENTS = ["a", "Zq", "word", "0", "7", "42", " ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", " \n ", "[", "]", "{",
             '"', ":", ",", ".", "-", "=", ">", "'", "'s", "'LL", "'re", "<|im_end|>", "<|im_start|>", "<think>",
             "</think>", "<tool_call>", "<|", "|>", "<", "|", "é", "e\u0301", "\u0338", "\u0301", "中文", "😀", "\u00a0",
             "\u3000", "\x00", "\x7f", "\x1f", "\u2028", "Ⅻ", "٣"]

texts = st.lists(st.sampled_from(FRAGMENTS), max_size=300).map("".join)


@pytest.fixture(scope="module", params=["local", "qwen"])
def tokenizer(request, tiny_model_dir, tiny_qwen_model_dir):
    from gyre.embedded_model import load_tokenizer

    return load_tokenizer(tiny_model_dir if request.param == "local" else tiny_qwen_model_dir)


def one_call(tokenizer, text: str) -> list[int]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def test_the_qwen_tokenizers_have_the_proven_pipeline(tokenizer):
    assert cuts_exactly(tokenizer)


@settings(max_examples=hypothesis_examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, piece=st.one_of(st.integers(1, 40), st.integers(60, 300)), batch=st.integers(1, 600))
def test_pieces_give_the_ids_of_one_call(tokenizer, text, piece, batch):
    pe = PieceEncoder(tokenizer, piece_chars=piece, batch_chars=batch)
    spans = list(pe.spans(text))
    assert "".join(text[s:e] for s, e in spans) == text and all(s < e for s, e in spans)
    assert pe.encode([text])[0].tolist() == one_call(tokenizer, text)


@settings(max_examples=hypothesis_examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(texts, max_size=5), piece=st.integers(1, 12))
def test_several_texts_keep_their_own_ids(tokenizer, parts, piece):
    got = PieceEncoder(tokenizer, piece_chars=piece, batch_chars=2 * piece).encode(parts)
    assert [g.tolist() for g in got] == [one_call(tokenizer, t) for t in parts]
    assert all(g.dtype.name == "int32" for g in got)


def test_cuts_fall_after_letters_and_around_digits_only(tokenizer):
    pe = PieceEncoder(tokenizer, piece_chars=1)
    # "ab" letter-letter and " [" / "[[" are no cut points
    assert list(pe.spans("ab [[12")) == [(0, 2), (2, 5), (5, 6), (6, 7)]
    assert list(pe.spans("k|>z")) == [(0, 1), (1, 4)]
    assert list(pe.spans("x|>z")) == [(0, 4)]  # "x|" is inside the added token "<|fim_prefix|>"


def test_a_tokenizer_without_the_proven_pipeline_gets_one_piece_per_text(tiny_model_dir):
    from tokenizers import pre_tokenizers

    from gyre.embedded_model import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    pe = PieceEncoder(tok, piece_chars=4)
    text = "some words, 123 and more " * 20
    assert not pe.exact_cuts and list(pe.spans(text)) == [(0, len(text))]
    assert pe.encode([text])[0].tolist() == one_call(tok, text)
    assert pe.lower_bound("[" * 100) == 0


def test_the_limit_is_inclusive(tokenizer):
    text = "alpha 12, beta [3] " * 50
    n = len(one_call(tokenizer, text))
    pe = PieceEncoder(tokenizer, piece_chars=16, batch_chars=64)
    assert len(pe.encode([text], max_tokens=n)[0]) == n
    assert len(pe.encode([text], max_tokens=n + 3, fixed=3)[0]) == n
    with pytest.raises(PromptTooLong) as err:
        pe.encode([text], max_tokens=n + 2, fixed=3)
    assert err.value.status == 400 and err.value.at_least == n + 3
    assert err.value.message == f"prompt is too long: at least {n + 3} tokens > {n + 2} maximum"


def test_encoding_stops_soon_after_the_limit(tokenizer):
    text = "a1 " * 100_000  # 300,000 characters, at least one token per three of them
    pe = PieceEncoder(tokenizer)
    with pytest.raises(PromptTooLong) as err:
        pe.encode(["short", text], max_tokens=1000)
    assert 1000 < err.value.at_least <= 1000 + pe.batch_chars
    assert pe.encoded_chars <= 3 * 1001 + 2 * pe.batch_chars


def test_an_uncut_run_over_the_limit_is_refused_by_its_bound_without_encoding(tokenizer):
    text = 'call({"args": "' + "[" * 100_000 + "1" + "]" * 100_000  # no cut point inside the runs
    pe = PieceEncoder(tokenizer)
    with pytest.raises(PromptTooLong) as err:
        pe.encode([text], max_tokens=32767)
    assert err.value.at_least > 32767
    assert pe.encoded_chars < 100  # only the text before the first run
    # under a limit the bound does not reach, the run is encoded whole, exactly
    n = len(one_call(tokenizer, text))
    assert pe.encode([text], max_tokens=n)[0].tolist() == one_call(tokenizer, text)


@settings(max_examples=hypothesis_examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(st.sampled_from(list("[]{}\"': ,a1\n.=-_x")), st.integers(1, 3000)), max_size=12),
       cut=st.integers(0, 5))
def test_the_lower_bound_never_exceeds_the_tokens(tokenizer, runs, cut):
    text = "".join(c * k for c, k in runs)  # runs longer than 256 count, and cross 4,096-byte chunks
    pe = PieceEncoder(tokenizer)
    assert pe.lower_bound(text) <= len(one_call(tokenizer, text))
    assert pe.lower_bound("ab" + text + "é", 2 + cut, 2 + len(text)) <= len(one_call(tokenizer, text[cut:]))


@settings(max_examples=hypothesis_examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, piece=st.integers(1, 40), begin=st.integers(0, 400), length=st.integers(0, 400))
def test_the_pieces_of_a_range_are_the_pieces_of_its_slice(tokenizer, text, piece, begin, length):
    pe = PieceEncoder(tokenizer, piece_chars=piece)
    begin = min(begin, len(text))
    stop = min(len(text), begin + length)
    want = [(s + begin, e + begin) for s, e in pe.spans(text[begin:stop])]
    assert list(pe.spans(text, begin, stop)) == want


@settings(max_examples=hypothesis_examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(st.sampled_from(list("[]{}\"': ,a1.=")), st.integers(1, 1500)), max_size=8),
       head=st.sampled_from(["", "x", "é ", "call(1, "]), budget=st.integers(0, 3000))
def test_a_range_over_its_budget_by_the_bound_is_refused_by_the_encoder(tokenizer, runs, head, budget):
    text = "".join(c * k for c, k in runs)
    pe = PieceEncoder(tokenizer, piece_chars=64, batch_chars=256)
    found = pe.over_by_bound(head + text + "é", budget, len(head), len(head) + len(text))
    n = len(one_call(tokenizer, text))
    if found:
        assert budget < found <= n  # a bound of the tokens, never above them
        with pytest.raises(PromptTooLong):
            pe.encode([text], max_tokens=budget)
    # the bound of a piece that exceeds the budget, or none: the first such piece's lower bound, at most
    assert found <= max([pe.lower_bound(text, s, e) for s, e in pe.spans(text) if e - s > 128] + [0])
    assert pe.over_by_bound(text, n) == 0  # a text within the budget is never found over it


def test_a_bracket_run_over_the_budget_is_found_without_the_vocabulary_table(tokenizer):
    text = '{"x": "' + "[" * 100_000 + "1" + "]" * 100_000 + '"}'
    pe = PieceEncoder(tokenizer)
    pe.lower_bound = lambda *a: pytest.fail("the vocabulary table was read")  # the runs alone suffice
    found = pe.over_by_bound(text, 32767)
    del pe.lower_bound
    assert 32767 < found <= pe.lower_bound(text, 6, text.index("1"))
    assert pe.over_by_bound(text, 32767, 0, 6) == 0
    assert pe.over_by_bound(text, len(one_call(tokenizer, text))) == 0


def test_lower_bound_of_a_bracket_run_is_tight(tokenizer):
    pe = PieceEncoder(tokenizer)
    n = len(one_call(tokenizer, "[" * 100_000))
    assert pe.lower_bound("[" * 100_000) == n  # one token per character ("local") or per two ("qwen")
    assert pe.lower_bound("[" * 100_000 + "é") == 0  # not ASCII: no bound
    assert pe.lower_bound("é" + "[" * 100_000, 1) == n
    # 200 runs of 300: the longest token of "[" and "]" is "[]" (2 bytes, "local") or "[][]" (4, "qwen"), the
    # longest of "[" alone "[" or "[["; so each run needs (300 - 2 * 2) / 1 or (300 - 2 * 4) / 2 tokens
    assert pe.lower_bound(("[" * 300 + "]" * 300) * 100) == (200 * 296 if n == 100_000 else 200 * 146)


def test_the_proxy_answers_a_prompt_too_long_by_its_tokens_with_400_early(local_renderer):
    r = local_renderer
    srv = ProxyServer(r, config=ProxyConfig(max_context_tokens=4096))
    srv.add_engine(ScriptedEngine("e0", r.encode("ok") + [r.eos_id]))
    text = "[1]" * 20_000  # 60,000 characters: too few for the size bound, 60,000 tokens
    with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        ex = srv.register_execution()
        before = r.pieces.encoded_chars
        resp = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]},
                      headers={"authorization": f"Bearer {ex.api_key}"})
        spent = r.pieces.encoded_chars - before
        body = json.loads(resp.text)
        assert resp.status_code == 400 and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("prompt is too long: at least ")
        assert spent < 4096 + 2 * r.pieces.batch_chars  # stopped after about the context's worth
        counted = c.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": text}]},
                         headers={"x-api-key": ex.api_key})
        assert counted.status_code == 400 and counted.json()["error"]["type"] == "invalid_request_error"
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "[1]" * 100}]},
                    headers={"authorization": f"Bearer {ex.api_key}"})
        assert ok.status_code == 200
    assert len(srv.tree(ex.execution_id).records) == 1
