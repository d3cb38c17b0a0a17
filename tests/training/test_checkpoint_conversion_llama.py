"""HF <-> Megatron conversion of a Llama layout (no q/k norm): a random tiny ``LlamaForCausalLM``
(tied and untied embeddings) and the real SmolLM2-135M-Instruct give Megatron the HF logits, and
the conversion back is exact."""

import pytest
import torch

from gyre.training.checkpoint_conversion import (has_qk_norm, hf_to_megatron, load_into_megatron,
                                                 megatron_state_dict, megatron_to_hf)


@pytest.fixture(scope="module")
def megatron_single_rank():
    from gyre.training.megatron_model import initialize_megatron_cpu

    initialize_megatron_cpu(1, 1, seed=1234)
    yield


def tiny_llama(tied: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied, dtype="float32")
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so that a dropped or misplaced norm shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    return model


def megatron_logits(hf_model, ids):
    from gyre.training.megatron_model import build_gpt_model, causal_attention_mask

    model = build_gpt_model(hf_model.config).eval()
    load_into_megatron(model, hf_to_megatron(hf_model.state_dict(), hf_model.config))
    n = ids.shape[1]
    with torch.no_grad():
        return model, model(ids, torch.arange(n)[None].expand(ids.shape[0], -1), causal_attention_mask(n))


@pytest.mark.parametrize("tied", [True, False])
def test_a_llama_converts_with_no_qk_norm_and_equal_logits(megatron_single_rank, tied):
    hf = tiny_llama(tied)
    assert not has_qk_norm(hf.config)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    model, mg = megatron_logits(hf, ids)
    assert not any("layernorm" in n and ("q_" in n or "k_" in n) for n in megatron_state_dict(model))
    with torch.no_grad():
        ref = hf(ids).logits
    assert mg.shape == ref.shape == (2, 40, 512)
    assert (mg - ref).abs().max().item() < 1e-5
    back = megatron_to_hf({(0, 0): megatron_state_dict(model)}, hf.config)
    sd = hf.state_dict()
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_a_llama_shards_and_merges_by_tp_and_pp():
    hf = tiny_llama(tied=True)
    sd = hf.state_dict()
    shards = {(t, p): hf_to_megatron(sd, hf.config, t, 2, p, 2) for t in range(2) for p in range(2)}
    # 1 KV group per TP rank: 3 query heads + k + v of 16 rows each
    assert shards[(1, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (5 * 16, 96)
    back = megatron_to_hf(shards, hf.config)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_smollm2_in_megatron_gives_the_hf_logits(megatron_single_rank, smollm2_model_dir):
    from gyre.embedded_model import load_hf_model, load_tokenizer

    hf = load_hf_model(smollm2_model_dir)
    assert hf.config.model_type == "llama" and not has_qk_norm(hf.config) and hf.config.tie_word_embeddings
    assert sum(p.numel() for p in hf.parameters()) == 134_515_008
    tok = load_tokenizer(smollm2_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok(text)["input_ids"]])
    _, mg = megatron_logits(hf, ids)
    with torch.no_grad():
        ref = hf(ids).logits
    assert mg.shape == ref.shape == (1, ids.shape[1], 49152)
    assert (mg.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item() < 1e-4
