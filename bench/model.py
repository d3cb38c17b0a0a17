#!/usr/bin/env python
"""Tiny-model forward/backward throughput (tokens/s) of the HF and Megatron paths on this CPU.

    python bench/model.py [--tokenizer local|qwen] [--batch 4] [--seq 512] [--iters 5]

Both paths hold the same weights (HF -> Megatron conversion); prints one line per path and a JSON
summary.  Megatron runs single-process (TP=1) through megatron_patches with its local layer spec.
"""

import argparse
import json
import time

import torch


def bench(fn, iters: int) -> float:
    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", choices=("local", "qwen"), default="local")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()

    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.training.checkpoint_conversion import hf_to_megatron, load_into_megatron
    from gyre.training.megatron_model import build_gpt_model, causal_attention_mask, initialize_megatron_cpu

    hf = load_hf_model(ensure_tiny_model(a.tokenizer))
    initialize_megatron_cpu(1, 1)
    mg = build_gpt_model(hf.config)
    load_into_megatron(mg, hf_to_megatron(hf.state_dict(), hf.config))
    ids = torch.randint(0, 4000, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(a.seq)[None].expand(a.batch, -1)
    mask = causal_attention_mask(a.seq)
    tokens = a.batch * a.seq
    results = {"threads": torch.get_num_threads(), "batch": a.batch, "seq": a.seq, "tokenizer": a.tokenizer,
               "vocab": hf.config.vocab_size}

    def hf_fwd():
        with torch.no_grad():
            hf(x)

    def hf_fwd_bwd():
        hf.zero_grad(set_to_none=True)
        logits = hf(x).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()

    def mg_fwd():
        with torch.no_grad():
            mg(x, pos, mask)

    def mg_fwd_bwd():
        mg.zero_grad(set_to_none=True)
        mg(x, pos, mask, labels=y).mean().backward()

    hf.train()
    for name, fn in (("hf_forward", hf_fwd), ("hf_forward_backward", hf_fwd_bwd),
                     ("megatron_forward", mg_fwd), ("megatron_forward_backward", mg_fwd_bwd)):
        s = bench(fn, a.iters)
        results[name + "_tokens_per_s"] = round(tokens / s, 1)
        print(f"{name:28s} {tokens / s:10.0f} tokens/s  ({s * 1000:.1f} ms / {tokens} tokens)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
