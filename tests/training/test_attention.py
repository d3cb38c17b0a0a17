"""Fused core attention (no dense mask) against Megatron's dense path, forward only on CPU
(FlexAttention has no CPU backward): the same target log-probs for tree-packed and for plain causal
micro-steps, with grouped-query attention (the tiny model has 4 heads, 2 KV groups)."""

import pytest
import torch

from gyre.buffer.packing import PackingConfig, pack_rows
from gyre.embedded_model import load_hf_model
from gyre.training.step import MicroStepBatch
from tests.training.test_step import trace_batch, with_behaviour_near_policy


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from gyre.training.checkpoint_conversion import hf_to_megatron, load_into_megatron
    from gyre.training.megatron_model import build_gpt_model, initialize_megatron_cpu, transformer_config_from_hf
    from gyre.training.megatron_step import MegatronPolicy

    initialize_megatron_cpu(1, 1, seed=1234)
    hf = load_hf_model(tiny_model_dir)
    out = {}
    for kind in ("dense", "fused"):
        m = build_gpt_model(hf.config, transformer_config_from_hf(hf.config), attention=kind).eval()
        load_into_megatron(m, hf_to_megatron(hf.state_dict(), hf.config, 0, 1, 0, 1))
        out[kind] = MegatronPolicy(m)
    return hf, out


@pytest.mark.parametrize("layout,tree", [("pack", True), ("pad", True), ("pad", False)])
def test_fused_attention_gives_the_dense_log_probs(models, traces_dir, layout, tree):
    hf, policies = models
    assert policies["fused"].fused and not policies["dense"].fused
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=3), seed=3)
    micro = pack_rows(rows, PackingConfig(4096 if layout == "pad" else 100_000, layout, tree=tree)).micro_steps
    assert any(not ms.is_causal for ms in micro) == tree
    worst = 0.0
    with torch.no_grad():
        for ms in micro:
            dense = MicroStepBatch.from_micro_step(ms)
            fused = MicroStepBatch.from_micro_step(ms, tree_intervals=True)
            assert (fused.tree is not None) == (not ms.is_causal) and fused.attention_allowed is None
            lp_d, _ = policies["dense"](dense)
            lp_f, _ = policies["fused"](fused)
            worst = max(worst, float((lp_d - lp_f).abs().max()))
    assert worst < 1e-5


def test_a_wrong_tree_changes_the_log_probs(models, traces_dir):
    """Negative control: intervals that let every column see every earlier one (a plain causal
    pattern over the packed tree) give other log-probs."""
    hf, policies = models
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=3), seed=3)
    ms = next(m for m in pack_rows(rows, PackingConfig(100_000, "pack", tree=True)).micro_steps if not m.is_causal)
    batch = MicroStepBatch.from_micro_step(ms, tree_intervals=True)
    s = ms.shape[1]
    chain = (torch.arange(s)[None], torch.full((1, s), s - 1))
    with torch.no_grad():
        right, _ = policies["fused"](batch)
        batch.tree = chain
        wrong, _ = policies["fused"](batch)
    assert float((right - wrong).abs().max()) > 1e-2
