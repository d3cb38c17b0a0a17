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


def _biased_config(tiny_model_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(tiny_model_dir))
    cfg.attention_bias = True  # q/k/v (and, in HF, o_proj) biases
    cfg.num_hidden_layers = 2
    return cfg


def _reference_hf_attention(qkv_w, qkv_b, heads, groups, d):
    """Brute force: walk Megatron's rows head by head into HF's q/k/v projections."""
    qpg = heads // groups
    q_w, k_w, v_w, q_b, k_b, v_b = [], [], [], [], [], []
    for g in range(groups):
        base = g * (qpg + 2) * d
        for j in range(qpg):
            q_w.append(qkv_w[base + j * d: base + (j + 1) * d])
            q_b.append(qkv_b[base + j * d: base + (j + 1) * d])
        k_w.append(qkv_w[base + qpg * d: base + (qpg + 1) * d])
        k_b.append(qkv_b[base + qpg * d: base + (qpg + 1) * d])
        v_w.append(qkv_w[base + (qpg + 1) * d: base + (qpg + 2) * d])
        v_b.append(qkv_b[base + (qpg + 1) * d: base + (qpg + 2) * d])
    return {name: torch.cat(parts) for name, parts in
            (("q_proj.weight", q_w), ("k_proj.weight", k_w), ("v_proj.weight", v_w),
             ("q_proj.bias", q_b), ("k_proj.bias", k_b), ("v_proj.bias", v_b))}


def test_qkv_biases_convert_by_the_head_split_of_the_weights(megatron_single_rank, tiny_model_dir):
    """A model with ``add_qkv_bias`` (random weights and biases) converts to HF: each q/k/v bias and
    weight equals a head-by-head walk of Megatron's rows, HF's ``o_proj`` bias is zero, the HF model
    gives Megatron's logits, and the conversion back is exact."""
    from transformers import AutoModelForCausalLM

    from gyre.training.megatron_model import build_gpt_model, causal_attention_mask

    cfg = _biased_config(tiny_model_dir)
    model = build_gpt_model(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name.endswith("bias") else 0.05) + (
                1.0 if "layernorm" in name else 0.0))
    mg_sd = megatron_state_dict(model)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in mg_sd
    hf_sd = megatron_to_hf({(0, 0): mg_sd}, cfg)
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        pre = f"decoder.layers.{i}.self_attention.linear_qkv."
        ref = _reference_hf_attention(mg_sd[pre + "weight"], mg_sd[pre + "bias"], heads, groups, cfg.head_dim)
        for name, want in ref.items():
            assert torch.equal(hf_sd[f"model.layers.{i}.self_attn.{name}"], want), (i, name)
        assert not hf_sd[f"model.layers.{i}.self_attn.o_proj.bias"].any()
    hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    hf.load_state_dict(hf_sd, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    with torch.no_grad():
        mg = model(ids, torch.arange(24)[None].expand(2, -1), causal_attention_mask(24))
        ref = hf(ids).logits
    assert (mg - ref).abs().max().item() < 1e-4
    back = hf_to_megatron(hf_sd, cfg)
    assert set(back) == set(mg_sd)
    for k in mg_sd:
        assert torch.equal(back[k], mg_sd[k]), k


def test_qkv_biases_shard_and_merge_by_tp(tiny_model_dir):
    cfg = _biased_config(tiny_model_dir)
    g = torch.Generator().manual_seed(4)
    hf_sd = {k: torch.randn(v.shape, generator=g) for k, v in load_hf_model(tiny_model_dir).state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    if cfg.tie_word_embeddings:
        hf_sd["lm_head.weight"] = hf_sd["model.embed_tokens.weight"]
    d, rows = cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    for i in range(2):
        for proj, n in (("q", rows), ("k", cfg.num_key_value_heads * d), ("v", cfg.num_key_value_heads * d)):
            hf_sd[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(n, generator=g)
        hf_sd[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(cfg.hidden_size)
    shards = {(t, 0): hf_to_megatron(hf_sd, cfg, t, 2) for t in range(2)}
    b1 = shards[(1, 0)]["decoder.layers.0.self_attention.linear_qkv.bias"]
    qpg = cfg.num_attention_heads // cfg.num_key_value_heads
    # rank 1 holds query group 1: its query heads, then key head 1, then value head 1
    assert torch.equal(b1[: qpg * d], hf_sd["model.layers.0.self_attn.q_proj.bias"][qpg * d: 2 * qpg * d])
    assert torch.equal(b1[qpg * d: (qpg + 1) * d], hf_sd["model.layers.0.self_attn.k_proj.bias"][d: 2 * d])
    back = megatron_to_hf(shards, cfg)
    assert set(back) == set(hf_sd)
    for k in hf_sd:
        assert torch.equal(back[k], hf_sd[k]), k
    hf_sd["model.layers.1.self_attn.o_proj.bias"][0] = 1.0
    with pytest.raises(ValueError, match="o_proj.bias is not zero"):
        hf_to_megatron(hf_sd, cfg)
