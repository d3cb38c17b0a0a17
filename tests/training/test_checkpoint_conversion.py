import pytest
import torch

from gyre.embedded_model import load_hf_model
from gyre.training.checkpoint_conversion import hf_to_megatron, load_into_megatron, megatron_state_dict, megatron_to_hf


@pytest.fixture(scope="module")
def megatron_single_rank():
    from gyre.training.megatron_model import initialize_megatron_cpu

    initialize_megatron_cpu(1, 1, seed=1234)
    yield


def test_hf_to_megatron_logits_equal(megatron_single_rank, tiny_model_dir):
    from gyre.training.megatron_model import build_gpt_model, causal_attention_mask

    hf = load_hf_model(tiny_model_dir)
    model = build_gpt_model(hf.config).eval()
    load_into_megatron(model, hf_to_megatron(hf.state_dict(), hf.config))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4122, (2, 48), generator=g)
    pos = torch.arange(48)[None].expand(2, -1)
    with torch.no_grad():
        mg = model(ids, pos, causal_attention_mask(48))
        ref = hf(ids).logits
    assert mg.shape == ref.shape == (2, 48, 4224)
    assert (mg - ref).abs().max().item() < 1e-5


def test_megatron_to_hf_round_trip_is_exact(megatron_single_rank, tiny_model_dir):
    from gyre.training.megatron_model import build_gpt_model

    hf = load_hf_model(tiny_model_dir)
    model = build_gpt_model(hf.config)
    load_into_megatron(model, hf_to_megatron(hf.state_dict(), hf.config))
    back = megatron_to_hf({(0, 0): megatron_state_dict(model)}, hf.config)
    sd = hf.state_dict()
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_sharded_round_trip(tiny_model_dir, tp, pp):
    hf = load_hf_model(tiny_model_dir)
    sd = hf.state_dict()
    shards = {(t, p): hf_to_megatron(sd, hf.config, t, tp, p, pp) for t in range(tp) for p in range(pp)}
    qkv = shards[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
    # 1 query group per TP rank at TP=2: 2 query heads + k + v, 32 rows each
    assert qkv.shape == ((2 // tp) * (2 + 2) * 32, 128)
    # rank 0's first rows are query head 0 of group 0
    torch.testing.assert_close(qkv[:32], sd["model.layers.0.self_attn.q_proj.weight"][:32], rtol=0, atol=0)
    back = megatron_to_hf(shards, hf.config)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_bad_parallel_size_is_a_clear_error(tiny_model_dir):
    hf = load_hf_model(tiny_model_dir)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by 4"):
        hf_to_megatron(hf.state_dict(), hf.config, 0, 4)
    with pytest.raises(ValueError, match="expected 4 shards"):
        megatron_to_hf({(0, 0): {}, (1, 1): {}, (1, 0): {}}, hf.config)
