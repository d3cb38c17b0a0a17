"""Tree-packed forward on trees from real trace replays (``tests/data/traces`` through the proxy core,
``gyre.proxy.replay``): every target sees exactly its original context, and the loss and gradients
equal the per-row forward's (1e-5).

Replayed rows are 9k-19k tokens; a per-row and a tree-packed forward/backward of them with the
2-layer embedded model takes ~25 s per trace on the 2-core CPU, so the numeric check runs a
1-layer, 32-wide model of the same architecture and vocabulary (the property checked -- same
logits through the trie mask and position ids -- does not depend on the width; the embedded model
itself is checked on trace-shaped trees in tests/training/test_step.py).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from gyre.buffer.packing import PackingConfig, pack_rows
from gyre.rl.objective import ObjectiveConfig
from gyre.trajectory import materialize, sample_trajectories
from gyre.training.hf_step import HFTrainStep
from tests.buffer.test_packing import check_invariants
from tests.training.test_step import grads_of, per_row_loss, with_behaviour_near_policy

pytestmark = pytest.mark.slow

BRANCHING = ("codex/cx2_gpt55_autocompact.jsonl", "codex/cx1_tools_subagent.jsonl")


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer

    return ChatRenderer(load_tokenizer(tiny_model_dir))


def replayed_rows(traces_dir, renderer, name, seed=0, advantage=0.7):
    from gyre.proxy.replay import replay_trace

    res = replay_trace(traces_dir / name, renderer)
    assert res.mismatches == 0 and res.duplicates == 0
    return materialize(res.tree, sample_trajectories(res.tree, np.random.default_rng(seed)), advantage)


@pytest.fixture(scope="module")
def micro_model(tiny_model_dir):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gyre.embedded_model import load_hf_model

    base = load_hf_model(tiny_model_dir).config.to_dict()
    cfg = Qwen3Config(**{**base, "num_hidden_layers": 1, "layer_types": None, "hidden_size": 32,
                         "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("name", BRANCHING)
def test_replayed_tree_every_target_sees_its_context(traces_dir, renderer, name):
    rows = replayed_rows(traces_dir, renderer, name)
    assert len(rows) >= 2
    cfg = PackingConfig(20_480, "pad", tree=True)
    res = pack_rows(rows, cfg)
    check_invariants(rows, res, cfg)
    assert res.stats.forward_token_ratio < 0.75  # compaction / sub-agent rows share long prefixes


@pytest.mark.parametrize("name", BRANCHING)
def test_replayed_tree_packed_forward_equals_per_row(traces_dir, renderer, micro_model, name):
    rows = with_behaviour_near_policy(micro_model, replayed_rows(traces_dir, renderer, name))
    ref_model = copy.deepcopy(micro_model)
    ref_loss, ref_out = per_row_loss(ref_model, rows, ObjectiveConfig())
    ref_loss.backward()
    ref = grads_of(ref_model)
    step = HFTrainStep(copy.deepcopy(micro_model))
    packed = pack_rows(rows, PackingConfig(20_480, "pad", tree=True))
    normaliser, stats = step.forward_backward(packed.micro_steps)
    assert normaliser == ref_out.normaliser == 1
    assert abs(stats.loss_sum / normaliser - float(ref_loss.detach())) < 1e-5
    got = grads_of(step.model)
    for n, g in ref.items():
        torch.testing.assert_close(got[n] / normaliser, g, rtol=0, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    assert packed.stats.tokens_saved > 0
