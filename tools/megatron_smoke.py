"""Foundation smoke job: the embedded model trained data-parallel by Megatron-core on every rank.

    torchrun --nproc-per-node K tools/megatron_smoke.py --config examples/cpu_tiny.yaml [--flag value ...]

In the shape of Megatron-LM's ``pretrain_gpt.py`` (``model_provider``, ``forward_step``,
``loss_func``): every rank builds the embedded model in Megatron (HF -> Megatron conversion) and
trains it data-parallel for ``--train-steps`` steps on chat-template format examples, through
Megatron DDP and ``get_forward_backward_func``. It checks the Megatron path on CPU (gloo, DDP,
optimizer patches); the RL main job is ``pretrain_gyre.py``. Rank 0 writes ``summary.json``
under ``--run-dir`` and prints it.
"""

import argparse
import json
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from gyre.arguments import parse_args

logger = logging.getLogger("gyre.smoke")


def model_provider(args):
    """Build this rank's Megatron GPTModel from the HF checkpoint (``--model-dir`` or the embedded default).

    Returns ``(model, transformer_config, model_dir)``.
    """
    from megatron.core import parallel_state as ps

    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.training.checkpoint_conversion import hf_to_megatron, load_into_megatron
    from gyre.training.megatron_model import build_gpt_model, transformer_config_from_hf

    model_dir = args.model_dir or ensure_tiny_model(args.tokenizer_kind, args.model_cache_dir)
    hf = load_hf_model(model_dir)
    config = transformer_config_from_hf(hf.config, bf16=args.bf16)
    model = build_gpt_model(hf.config, config)
    load_into_megatron(model, hf_to_megatron(
        hf.state_dict(), hf.config, ps.get_tensor_model_parallel_rank(), args.tensor_model_parallel_size,
        ps.get_pipeline_model_parallel_rank(), args.pipeline_model_parallel_size))
    return model, config, model_dir


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked mean of per-token losses ``[b, s]``; returns ``(loss, {"lm loss": loss})``."""
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """One micro-batch: ``(tokens [s+1], loss_mask [s])`` -> per-token loss and its reduction."""
    from gyre.training.megatron_model import causal_attention_mask

    tokens, loss_mask = next(data_iterator)
    tokens, loss_mask = tokens[None], loss_mask[None]
    seq = tokens.shape[1] - 1
    position_ids = torch.arange(seq)[None]
    output = model(tokens[:, :-1], position_ids, causal_attention_mask(seq), labels=tokens[:, 1:])
    return output, partial(loss_func, loss_mask)


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
        rows = ([(tokens[i], loss_mask[i]) for i in range(len(tokens)) if i % dp == dp_rank]
                or [(tokens[0], loss_mask[0] * 0)])
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


def main(argv=None) -> int:
    args = parse_args(argv, prog="megatron_smoke.py")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.log_level != "DEBUG":
        logging.getLogger("megatron").setLevel(logging.WARNING)
    if args.backend != "cpu":
        print("megatron_smoke.py: error: --backend gpu needs requirements-gpu.txt",
              file=sys.stderr)
        return 2
    from gyre.training.megatron_model import initialize_megatron_cpu

    initialize_megatron_cpu(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed)
    summary = run_smoke(args, model_provider, forward_step)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(json.dumps(summary))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
