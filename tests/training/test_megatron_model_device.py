"""A Megatron model made for a GPU (``use_cpu_initialization=False``) has every parameter on the
current GPU, the local spec's plain torch norms included.  Without a GPU here, the "current GPU" is
torch's ``meta`` device: Megatron makes its parallel layers on whatever ``torch.cuda.current_device()``
names, so a parameter left on the CPU shows."""

import torch

from gyre.embedded_model import load_hf_model


def test_a_model_made_for_a_gpu_has_every_parameter_on_it(tiny_model_dir, monkeypatch):
    from gyre.training.megatron_model import build_gpt_model, initialize_megatron_cpu, transformer_config_from_hf

    initialize_megatron_cpu(1, 1, seed=1234)
    hf = load_hf_model(tiny_model_dir)
    cfg = transformer_config_from_hf(hf.config, use_cpu_initialization=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    model = build_gpt_model(hf.config, cfg)
    where = {n: p.device.type for n, p in model.named_parameters()}
    assert set(where.values()) == {"meta"}, {n: d for n, d in where.items() if d != "meta"}
    assert any("layernorm" in n or "norm" in n for n in where)  # the norms were among them


def test_a_bf16_model_is_bf16_throughout(tiny_model_dir):
    """Megatron's local spec makes its norms as plain fp32 torch modules; in bf16 training every
    parameter is bf16 (Megatron's bf16 optimizer keeps the fp32 main copies)."""
    from gyre.training.megatron_model import build_gpt_model, initialize_megatron_cpu, transformer_config_from_hf

    initialize_megatron_cpu(1, 1, seed=1234)
    hf = load_hf_model(tiny_model_dir)
    model = build_gpt_model(hf.config, transformer_config_from_hf(hf.config, bf16=True))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.tensor([[11, 12, 13, 14, 15]])
    causal = torch.ones(1, 1, 5, 5, dtype=torch.bool).triu(1)
    logits = model(ids, torch.arange(5)[None], causal)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
