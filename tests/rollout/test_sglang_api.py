"""Parsing and checking of SGLang-native bodies (gyre/rollout/api/sglang_api.py)."""

import pytest

from gyre.rollout.api.sglang_api import (
    ProtocolError,
    SamplingParams,
    final_text,
    finish_length,
    finish_stop,
    logprob_triples,
    parse_generate,
)
from gyre.rollout.api.sglang_control_api import (
    parse_abort,
    parse_pause,
    parse_tags,
    parse_update_from_disk,
    parse_update_from_tensor,
    parse_update_weight_version,
)

V, CTX = 100, 50


def gen(body, tokenize=None):
    return parse_generate(body, vocab_size=V, context_len=CTX, tokenize=tokenize, new_rid=iter(map(str, range(1000))).__next__)


def test_single_prompt_defaults_follow_sglang():
    r = gen({"input_ids": [1, 2, 3]})
    assert r.single and r.input_ids == [[1, 2, 3]] and not r.stream and not r.return_logprob
    p = r.params[0]
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n) == (128, 1.0, 1.0, -1, 0.0, 1)
    [s] = r.expand()
    assert s.rid == s.group_rid == r.rids[0] and s.index == 0 and s.seed is None


def test_batch_and_n_expand_input_major_with_seeds_and_rids():
    r = gen({"input_ids": [[1], [2, 3]], "rid": ["a", "b"], "return_logprob": True,
             "sampling_params": {"n": 2, "sampling_seed": 7, "temperature": 0.5}})
    assert not r.single
    specs = r.expand()
    assert [(s.rid, s.group_rid, s.index, s.input_ids, s.seed) for s in specs] == [
        ("a_0", "a", 0, [1], 7), ("a_1", "a", 1, [1], 8), ("b_0", "b", 2, [2, 3], 7), ("b_1", "b", 3, [2, 3], 8)]
    assert all(s.return_logprob for s in specs)


def test_single_prompt_with_n_is_a_list_response():
    assert not gen({"input_ids": [1], "sampling_params": {"n": 3}}).single


def test_per_input_sampling_params_list():
    r = gen({"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]})
    assert [p.max_new_tokens for p in r.params] == [1, 2]


def test_text_input_uses_tokenizer():
    r = gen({"text": "abc"}, tokenize=lambda t: [ord(c) - 90 for c in t])
    assert r.input_ids == [[7, 8, 9]] and r.single


def test_sampling_params_round_trip_and_greedy():
    p = SamplingParams.from_json({"temperature": 0, "stop": "x", "stop_token_ids": [5], "ignore_eos": True,
                                  "top_k": 3, "min_new_tokens": 1, "max_new_tokens": 4}, V)
    assert p.greedy and p.stop == ["x"] and p.truncates
    assert SamplingParams.from_json(p.to_json(), V) == p
    assert SamplingParams.from_json({"frequency_penalty": 0.0, "repetition_penalty": 1.0, "top_k": None}) == SamplingParams()
    assert SamplingParams.from_json({"top_k": 1000}, V).top_k == -1  # >= vocab: no truncation


BAD_GENERATE = [
    ("not an object", []),
    ("no input", {}),
    ("both inputs", {"input_ids": [1], "text": "a"}),
    ("empty input", {"input_ids": []}),
    ("empty batch item", {"input_ids": [[1], []]}),
    ("string id", {"input_ids": ["1"]}),
    ("float id", {"input_ids": [1.5]}),
    ("bool id", {"input_ids": [True]}),
    ("negative id", {"input_ids": [-1]}),
    ("out of vocab", {"input_ids": [V]}),
    ("too long", {"input_ids": [1] * CTX}),
    ("text without tokenizer", {"text": "a"}),
    ("negative max_new_tokens", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}),
    ("string max_new_tokens", {"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}),
    ("bool max_new_tokens", {"input_ids": [1], "sampling_params": {"max_new_tokens": True}}),
    ("negative temperature", {"input_ids": [1], "sampling_params": {"temperature": -0.1}}),
    ("nan temperature", {"input_ids": [1], "sampling_params": {"temperature": float("nan")}}),
    ("top_p zero", {"input_ids": [1], "sampling_params": {"top_p": 0}}),
    ("top_p > 1", {"input_ids": [1], "sampling_params": {"top_p": 1.5}}),
    ("top_k zero", {"input_ids": [1], "sampling_params": {"top_k": 0}}),
    ("min_p > 1", {"input_ids": [1], "sampling_params": {"min_p": 2}}),
    ("n zero", {"input_ids": [1], "sampling_params": {"n": 0}}),
    ("empty stop", {"input_ids": [1], "sampling_params": {"stop": [""]}}),
    ("stop id oov", {"input_ids": [1], "sampling_params": {"stop_token_ids": [V]}}),
    ("min > max", {"input_ids": [1], "sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}}),
    ("unknown sampling key", {"input_ids": [1], "sampling_params": {"temprature": 1}}),
    ("penalty", {"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}),
    ("regex", {"input_ids": [1], "sampling_params": {"regex": "a+"}}),
    ("sampling_params not object", {"input_ids": [1], "sampling_params": [1]}),
    ("sampling list length", {"input_ids": [[1], [2]], "sampling_params": [{}]}),
    ("unknown top-level", {"input_ids": [1], "foo": 1}),
    ("stream not bool", {"input_ids": [1], "stream": "yes"}),
    ("return_logprob int", {"input_ids": [1], "return_logprob": 1}),
    ("rid list for single", {"input_ids": [1], "rid": ["a"]}),
    ("duplicate rids", {"input_ids": [[1], [2]], "rid": ["a", "a"]}),
    ("empty rid", {"input_ids": [1], "rid": ""}),
    ("logprob_start_len", {"input_ids": [1], "logprob_start_len": 0}),
    ("top_logprobs negative", {"input_ids": [1], "top_logprobs_num": -1}),
    ("image data", {"input_ids": [1], "image_data": "x"}),
]


@pytest.mark.parametrize("why,body", BAD_GENERATE, ids=[b[0] for b in BAD_GENERATE])
def test_malformed_generate_bodies_raise_protocol_error(why, body):
    with pytest.raises(ProtocolError):
        gen(body)


def test_text_empty_after_tokenization():
    with pytest.raises(ProtocolError, match="empty"):
        gen({"text": "x"}, tokenize=lambda t: [])


def test_control_bodies():
    assert parse_abort({"rid": "a"}) == ("a", False)
    assert parse_abort({"abort_all": True}) == (None, True)
    for bad in ({}, {"rid": 3}, {"rid": ""}, {"abort_all": "yes"}, [], {"x": 1}):
        with pytest.raises(ProtocolError):
            parse_abort(bad)
    assert parse_pause(None) == "abort" and parse_pause({"mode": "in_place"}) == "in_place"
    with pytest.raises(ProtocolError):
        parse_pause({"mode": "later"})
    assert parse_tags(None, "x") == ("weights", "kv_cache", "cuda_graph")
    assert parse_tags({"tags": ["kv_cache"]}, "x") == ("kv_cache",)
    assert parse_tags({"tags": ["cuda_graph", "weights"]}, "x") == ("weights", "cuda_graph")
    for bad in ({"tags": []}, {"tags": ["gpu"]}, {"tags": "weights"}):
        with pytest.raises(ProtocolError):
            parse_tags(bad, "x")
    u = parse_update_from_disk({"model_path": "/m", "weight_version": "v2", "abort_all_requests": True})
    assert (u.source, u.weight_version, u.abort_all_requests, u.flush_cache) == ("/m", "v2", True, True)
    for bad in ({}, {"model_path": 1}, {"model_path": "/m", "weight_version": 2}, {"model_path": "/m", "x": 1}):
        with pytest.raises(ProtocolError):
            parse_update_from_disk(bad)
    assert parse_update_from_tensor({"serialized_named_tensors": ["QQ=="]}).source == ["QQ=="]
    for bad in ({}, {"serialized_named_tensors": []}, {"serialized_named_tensors": [1]}):
        with pytest.raises(ProtocolError):
            parse_update_from_tensor(bad)
    assert parse_update_weight_version({"new_version": "v3"}) == ("v3", False)
    with pytest.raises(ProtocolError):
        parse_update_weight_version({"new_version": ""})


def test_final_text_trims_like_sglang():
    dec = lambda ids, skip: "".join(chr(96 + i) for i in ids)  # noqa: E731  1->a, 2->b ...
    p = SamplingParams()
    assert final_text([1, 2, 3], finish_stop(3), p, dec) == "ab"            # matched token dropped
    assert final_text([1, 2, 3], finish_stop("bc"), p, dec) == "a"          # cut at stop string
    assert final_text([1, 2, 3], finish_length(3), p, dec) == "abc"
    keep = SamplingParams(no_stop_trim=True)
    assert final_text([1, 2, 3], finish_stop(3), keep, dec) == "abc"
    assert final_text([1, 2, 3], finish_stop("bc"), keep, dec) == "abc"
    assert final_text([1], None, p, None) == ""


def test_logprob_triples_shape():
    assert logprob_triples([-0.5, -1.0], [3, 4]) == [[-0.5, 3, None], [-1.0, 4, None]]
    assert logprob_triples([-0.5], [3], lambda t: f"<{t}>") == [[-0.5, 3, "<3>"]]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from gyre.embedded_model import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_incremental_detokenizer_matches_full_decode(tokenizer):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gyre.rollout.api.sglang_api import IncrementalDetokenizer

    def decode(ids, skip):
        return tokenizer.decode(ids, skip_special_tokens=skip)

    # single bytes (0..255, incl. partial UTF-8), merged tokens, and special tokens
    token = st.one_of(st.integers(0, 255), st.integers(256, 4095), st.integers(4096, 4121))

    @settings(max_examples=150, deadline=None)
    @given(st.lists(token, min_size=1, max_size=40), st.booleans())
    def check(ids, skip):
        det = IncrementalDetokenizer(decode, skip)
        prev = ""
        for n in range(1, len(ids) + 1):
            text = det.text(ids[:n])
            assert text.startswith(prev)                       # deltas can be streamed
            prev = text
        assert prev == decode(ids, skip).rstrip("\ufffd")

    check()
