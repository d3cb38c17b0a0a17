"""Foundation smoke job: every torchrun rank builds the embedded model in Megatron and trains it
data-parallel for a few steps on chat-template format examples.

This is what ``pretrain_gyre.py`` runs until the RL main job (trajectory buffer -> admission ->
GSPO objective -> elastic cells) is wired in.  It exercises the same pieces the main job uses:
Megatron-style arguments, the embedded tokenizer and chat template, megatron-core on CPU through
``megatron_patches``, HF -> Megatron conversion, DDP with gradient all-reduce, and
``get_forward_backward_func``.  Rank 0 writes ``summary.json`` under ``--run-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger("gyre.smoke")

FORMAT_EXAMPLES = [
    [{"role": "user", "content": "List the files."},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "shell", "arguments": {"cmd": "ls"}}}]},
     {"role": "tool", "content": "a.py\nb.py"},
     {"role": "assistant", "content": "There are two files: a.py and b.py."}],
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "Show a.py."},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
     {"role": "tool", "content": "print('hi')"},
     {"role": "assistant", "content": "a.py prints hi."}],
    [{"role": "user", "content": "Say done."}, {"role": "assistant", "content": "done"}],
]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("shell", "read_file")]


def format_batch(tokenizer, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Render :data:`FORMAT_EXAMPLES` into ``tokens [n, seq_length + 1]`` int64 and
    ``loss_mask [n, seq_length]`` float32 (1 on assistant tokens, 0 on prompt and padding)."""
    rows, masks = [], []
    for messages in FORMAT_EXAMPLES:
        ids: list[int] = []
        mask: list[float] = []
        for i in range(len(messages)):
            full = tokenizer.apply_chat_template(messages[: i + 1], tools=TOOLS, tokenize=True, return_dict=False)
            new = full[len(ids):]
            mask += [1.0 if messages[i]["role"] == "assistant" else 0.0] * len(new)
            ids = full
        ids = ids[: seq_length + 1]
        pad = seq_length + 1 - len(ids)
        rows.append(ids + [tokenizer.pad_token_id] * pad)
        masks.append((mask[1: len(ids)] + [0.0] * pad)[:seq_length])
    return torch.tensor(rows), torch.tensor(masks)


def run_smoke(args: argparse.Namespace, model_provider: Callable, forward_step: Callable) -> dict:
    """Train ``args.train_steps`` steps data-parallel over every rank; return the summary dict."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gyre.embedded_model import load_tokenizer
    from gyre.training.megatron_model import build_optimizer, wrap_ddp

    t0 = time.time()
    model, config, model_dir = model_provider(args)
    ddp = wrap_ddp(model, config)
    opt = build_optimizer(ddp, lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                          adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad)
    tokens, loss_mask = format_batch(load_tokenizer(model_dir), min(args.seq_length, 256))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    fbf = get_forward_backward_func()
    losses = []
    for step in range(args.train_steps):
        rows = [(tokens[i], loss_mask[i]) for i in range(len(tokens)) if i % dp == dp_rank] or [(tokens[0], loss_mask[0] * 0)]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = fbf(forward_step_func=forward_step, data_iterator=iter(rows), model=[ddp], num_microbatches=len(rows),
                  seq_length=tokens.shape[1] - 1, micro_batch_size=1, forward_only=False)
        _, grad_norm, _ = opt.step()
        loss = torch.tensor(sum(float(o["lm loss"]) for o in out) / max(len(out), 1))
        dist.all_reduce(loss)
        losses.append(float(loss) / dist.get_world_size())
        if dist.get_rank() == 0:
            logger.info("step %d/%d  lm loss %.4f  grad norm %.3f", step + 1, args.train_steps, losses[-1], grad_norm)
    flat = torch.cat([p.detach().flatten() for p in ddp.module.parameters()])
    replicas = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, flat)
    summary = {
        "mode": "foundation-smoke",
        "steps": args.train_steps,
        "world_size": dist.get_world_size(),
        "num_cells": args.num_cells,
        "placement": args.placement,
        "lm_loss_by_step": [round(x, 4) for x in losses],
        "replicas_identical": all(torch.equal(r, flat) for r in replicas),
        "model_dir": str(model_dir),
        "wall_s": round(time.time() - t0, 2),
    }
    if dist.get_rank() == 0:
        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
