"""Foundation smoke job: the embedded model trained data-parallel by Megatron-core on every rank.

    torchrun --nproc-per-node K tools/megatron_smoke.py --config examples/cpu_tiny.yaml [--flag value ...]

In the shape of Megatron-LM's ``pretrain_gpt.py``: only the model-specific pieces
(``model_provider``, ``forward_step``, ``loss_func``) and one library call
(``gyre/training/smoke.py``).  It checks the Megatron path on CPU (gloo, DDP, optimizer patches);
the RL main job is ``pretrain_gyre.py``.
"""

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from functools import partial

import torch

from gyre.arguments import parse_args


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
    from gyre.training.smoke import run_smoke

    initialize_megatron_cpu(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed)
    summary = run_smoke(args, model_provider, forward_step)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(json.dumps(summary))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
