#!/usr/bin/env python
"""Training-step throughput on this CPU: per-row vs tree-packed forward, pack vs pad layout, HF and Megatron.

    python bench/train.py [--source replay|shaped] [--scale 0.125] [--budget N] [--iters 3] [--backend hf|megatron|both]

The batch: one execution per trace of ``tests/data/traces`` (``--copies`` each, shaped only), up to
``J_max = 5`` admitted rows each, random advantages, behaviour log-probs near the policy's. Trees
are real replays through the proxy core (``--source replay``, :mod:`gyre.proxy.replay`, rows of
9k-19k tokens, default budget 20480) or trees with the traces' structure and sizes scaled by
``--scale`` and random token ids (``--source shaped``, ``gyre/testing/trace_trees.py``, default
budget 4096; Megatron's local attention materialises ``[heads, s, s]`` scores, so use this one
for ``--backend megatron``). Every configuration runs the same full training step (forward-only log-ratio pass for
split executions, forward/backward of every micro-step, one Adam update) on the embedded tiny
model. ``tokens/s`` counts *row tokens* (the tokens a per-row forward processes), so tree-packed
and per-row numbers measure the same work; ``fwd ratio`` is trie tokens / row tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.buffer.packing import PackingConfig, pack_rows
from gyre.training.hf_step import HFTrainStep
from gyre.training.logprobs import target_logprobs_from_hidden
from gyre.training.megatron_step import build_megatron_train_step
from gyre.training.step import AdamConfig
from gyre.testing.trace_trees import trace_shaped_rows

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces"


def batch_rows(hf, source: str, scale: float, copies: int, seed: int):
    rng = np.random.default_rng(seed)
    rows = []
    renderer = None
    if source == "replay":
        from gyre.embedded_model import ensure_tiny_model, load_tokenizer
        from gyre.proxy.render import ChatRenderer

        renderer = ChatRenderer(load_tokenizer(ensure_tiny_model("local")))
    for path in sorted(TRACES.glob("*/*.jsonl")):
        if source == "replay":
            from gyre.proxy.replay import replay_trace
            from gyre.trajectory import materialize, sample_trajectories

            tree = replay_trace(path, renderer).tree
            rows += materialize(tree, sample_trajectories(tree, rng), float(rng.normal()))
            continue
        for c in range(copies):
            rows += trace_shaped_rows(path, rng, advantage=float(rng.normal()), scale=scale,
                                      execution_id=f"{path.stem.replace('_', '-')}-{c}")
    with torch.no_grad():  # behaviour log-probs = the policy's own + small noise (realistic ratios)
        for r in rows:
            t = np.flatnonzero(r.target_mask)
            hidden = hf.model(input_ids=torch.as_tensor(r.input_ids[None], dtype=torch.int64)).last_hidden_state[0]
            lp, _ = target_logprobs_from_hidden(hidden, hf.lm_head.weight, torch.as_tensor(t - 1),
                                                torch.as_tensor(r.input_ids[t], dtype=torch.int64))
            blp = np.zeros_like(r.behaviour_logprobs)
            blp[t] = lp.numpy() + rng.normal(0, 0.003, len(t))
            r.behaviour_logprobs = blp.astype(np.float32)
    return rows


def measure(make_step, rows, configs: list[PackingConfig], iters: int) -> list[dict]:
    """Time one full training step per configuration, ``iters`` interleaved rounds, best of them
    (the machine is shared: the minimum is the least disturbed measurement)."""
    steps = [make_step() for _ in configs]
    for step, cfg in zip(steps, configs):  # warm-up
        step(pack_rows(rows, cfg).micro_steps)
    times: list[list[float]] = [[] for _ in configs]
    last = [None] * len(configs)
    for _ in range(iters):
        for i, (step, cfg) in enumerate(zip(steps, configs)):
            ms = pack_rows(rows, cfg).micro_steps
            t0 = time.perf_counter()
            last[i] = step(ms)
            times[i].append(time.perf_counter() - t0)
    out = []
    for cfg, ts, res in zip(configs, times, last):
        s = pack_rows(rows, cfg).stats
        t = float(min(ts))
        out.append({"layout": cfg.layout, "tree": cfg.tree, "step_s": t, "step_s_all": ts, "row_tokens": s.row_tokens,
                    "real_tokens": s.real_tokens, "forward_tokens": s.forward_tokens, "micro_steps": s.micro_steps,
                    "split_executions": s.split_executions, "efficiency": s.efficiency,
                    "padding_fraction": s.padding_fraction, "forward_token_ratio": s.forward_token_ratio,
                    "tokens_per_s": s.row_tokens / t, "loss": res.metrics["loss"],
                    "log_ratio_pass_tokens": res.metrics["log_ratio_pass_tokens"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=("replay", "shaped"), default="replay",
                   help="Real trace replays or trace-shaped trees with random tokens.")
    p.add_argument("--scale", type=float, default=0.125, help="shaped: trace size multiplier (tokens).")
    p.add_argument("--copies", type=int, default=1, help="shaped: executions per trace.")
    p.add_argument("--budget", type=int, default=None, help="--micro-step-tokens (replay 20480, shaped 4096).")
    p.add_argument("--layouts", default=None,
                   help="Comma-separated layouts to time (default: replay 'pad' -- one packed sequence of "
                        "20k tokens is O(s^2) attention on CPU -- shaped 'pack,pad').")
    p.add_argument("--iters", type=int, default=2, help="Interleaved timing rounds (best is reported).")
    p.add_argument("--backend", choices=("hf", "megatron", "both"), default="hf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="Also print the results as JSON.")
    a = p.parse_args()
    warnings.filterwarnings("ignore")

    from gyre.embedded_model import ensure_tiny_model, load_hf_model

    hf = load_hf_model(ensure_tiny_model("local"))
    if a.budget is None:
        a.budget = 20480 if a.source == "replay" else 4096
    rows = batch_rows(hf, a.source, a.scale, a.copies, a.seed)
    print(f"batch ({a.source}): {len(rows)} rows of {len({r.execution_id for r in rows})} executions, "
          f"{sum(r.num_tokens for r in rows)} row tokens (longest {max(r.num_tokens for r in rows)}), "
          f"{sum(r.num_targets for r in rows)} targets; budget {a.budget} tokens/micro-step; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    backends = {}
    if a.backend in ("hf", "both"):
        backends["hf"] = lambda: HFTrainStep(copy.deepcopy(hf), adam=AdamConfig())
    if a.backend in ("megatron", "both"):
        from gyre.training.megatron_model import initialize_megatron_cpu

        initialize_megatron_cpu(1, 1)
        backends["megatron"] = lambda: build_megatron_train_step(hf, adam=AdamConfig())
    results = []
    header = f"{'backend':9} {'layout':6} {'forward':10} {'micro':>5} {'split':>5} {'row tok':>8} {'fwd tok':>8} " \
             f"{'fwd ratio':>9} {'pack eff':>8} {'pad %':>6} {'step s':>7} {'tokens/s':>9}"
    print(header, flush=True)
    layouts = (a.layouts or ("pad" if a.source == "replay" else "pack,pad")).split(",")
    configs = [PackingConfig(a.budget, layout, tree) for layout in layouts for tree in (False, True)]
    for name, make in backends.items():
        for r in measure(make, rows, configs, a.iters):
            r["backend"] = name
            results.append(r)
            print(f"{name:9} {r['layout']:6} {'tree' if r['tree'] else 'per-row':10} {r['micro_steps']:5d} "
                  f"{r['split_executions']:5d} {r['row_tokens']:8d} {r['real_tokens']:8d} "
                  f"{r['forward_token_ratio']:9.3f} {r['efficiency']:8.3f} {100 * r['padding_fraction']:6.1f} "
                  f"{r['step_s']:7.2f} {r['tokens_per_s']:9.0f}", flush=True)
    for name in backends:
        sub = {(r["layout"], r["tree"]): r for r in results if r["backend"] == name}
        for layout in layouts:
            pr, tr = sub[(layout, False)], sub[(layout, True)]
            print(f"{name} {layout}: per-row {pr['tokens_per_s']:.0f} tokens/s, tree-packed {tr['tokens_per_s']:.0f} "
                  f"tokens/s ({tr['tokens_per_s'] / pr['tokens_per_s']:.2f}x); forward-token ratio "
                  f"{tr['forward_token_ratio']:.3f} ({tr['row_tokens'] - tr['real_tokens']} of {tr['row_tokens']} saved)")
        if {"pack", "pad"} <= set(layouts):
            print(f"{name} pack vs pad (per-row): {sub[('pack', False)]['tokens_per_s']:.0f} vs "
                  f"{sub[('pad', False)]['tokens_per_s']:.0f} tokens/s; (tree): {sub[('pack', True)]['tokens_per_s']:.0f} "
                  f"vs {sub[('pad', True)]['tokens_per_s']:.0f} tokens/s")
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
