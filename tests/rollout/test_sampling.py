"""Sampling maths and behaviour log-probs (gyre/rollout/embedded/sampling.py)."""

import math

import pytest
import torch

from gyre.rollout.api.sglang_api import SamplingParams
from gyre.rollout.embedded.sampling import sample_next_tokens, truncate_probs


def gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_is_argmax_with_temperature_one_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    r = sample_next_tokens(logits, [SamplingParams(temperature=0.0)] * 2, gens(2))
    assert r.token_ids == [1, 0]
    ref = torch.log_softmax(logits, -1)
    assert r.logprobs == pytest.approx([ref[0, 1].item(), ref[1, 0].item()], abs=1e-7)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_tempered_logprob_is_log_softmax_of_scaled_logits(temperature):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    r = sample_next_tokens(logits, [SamplingParams(temperature=temperature)] * 4, gens(4))
    ref = torch.log_softmax(logits / temperature, -1)
    for b, t in enumerate(r.token_ids):
        assert r.logprobs[b] == pytest.approx(ref[b, t].item(), abs=1e-6)


def test_same_seed_same_tokens_regardless_of_batch_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    p = SamplingParams(temperature=1.0)
    alone = sample_next_tokens(logits[1:2], [p], [torch.Generator().manual_seed(42)])
    batch = sample_next_tokens(logits, [p] * 3, [torch.Generator().manual_seed(s) for s in (7, 42, 9)])
    assert alone.token_ids[0] == batch.token_ids[1]


def test_sampling_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    p = SamplingParams(temperature=0.7)
    g = torch.Generator().manual_seed(3)
    n = 1500
    counts = [0] * 4
    for _ in range(n):
        counts[sample_next_tokens(logits, [p], [g]).token_ids[0]] += 1
    probs = torch.softmax(logits[0] / 0.7, -1).tolist()
    chi2 = sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs))
    assert chi2 < 16.3  # 3 dof, p = 0.001


def test_truncation_semantics():
    probs = torch.tensor([0.1, 0.4, 0.3, 0.2])
    assert truncate_probs(probs, 2, 1.0, 0.0).tolist() == pytest.approx([0, 4 / 7, 3 / 7, 0])
    # top_p=0.5: keep 0.4 (mass before 0) and 0.3 (mass before 0.4 < 0.5), drop the rest
    assert truncate_probs(probs, -1, 0.5, 0.0).tolist() == pytest.approx([0, 4 / 7, 3 / 7, 0])
    # min_p=0.6: keep p >= 0.24
    assert truncate_probs(probs, -1, 1.0, 0.6).tolist() == pytest.approx([0, 4 / 7, 3 / 7, 0])
    # the most probable token always survives
    assert truncate_probs(probs, -1, 1e-9, 0.0).tolist() == pytest.approx([0, 1, 0, 0])


def test_truncated_sampling_never_draws_removed_tokens_and_returns_raw_logprobs():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    p = SamplingParams(temperature=1.0, top_k=2)
    g = torch.Generator().manual_seed(0)
    seen = {sample_next_tokens(logits, [p], [g]).token_ids[0] for _ in range(200)}
    assert seen == {1, 2}
    g = torch.Generator().manual_seed(0)
    r = sample_next_tokens(logits, [p], [g])
    t = r.token_ids[0]
    assert r.logprobs[0] == pytest.approx(math.log([0.1, 0.4, 0.3, 0.2][t]), abs=1e-6)   # raw, untruncated
    with pytest.raises(TypeError):
        sample_next_tokens(logits, [p], [g], logprob_mode="truncated")


def test_banned_ids_are_never_sampled_and_top_logprobs():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    r = sample_next_tokens(logits, [SamplingParams(temperature=0.0)], gens(1), banned=[[0]], top_logprobs_num=[2])
    assert r.token_ids[0] != 0
    # log-probs and top log-probs are raw: the banned id keeps its mass in the distribution
    raw = torch.log_softmax(logits[0], -1)
    assert r.logprobs[0] == pytest.approx(float(raw[r.token_ids[0]]), abs=1e-6)
    assert r.top_logprobs[0][0] == (pytest.approx(float(raw[0]), abs=1e-6), 0) and len(r.top_logprobs[0]) == 2
