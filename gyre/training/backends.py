"""The training step the arguments ask for: :func:`build_train_step` picks the backend
(:mod:`gyre.training.hf_step` or :mod:`gyre.training.megatron_step`) of ``--training-backend``."""

from __future__ import annotations

import argparse

import torch

from gyre.rl.objective import ObjectiveConfig
from gyre.training.step import AdamConfig, TrainStep

__all__ = ["build_train_step"]


def build_train_step(args: argparse.Namespace, hf_model: torch.nn.Module) -> TrainStep:
    """The training step the arguments ask for, holding ``hf_model``'s weights.

    Reads ``--training-backend`` (``hf``: trains ``hf_model`` in place; ``megatron``: a converted
    ``GPTModel``, call ``initialize_megatron_cpu`` first), the objective flags
    (:meth:`ObjectiveConfig.from_args`), the optimizer flags (:meth:`AdamConfig.from_args`),
    ``--logprob-chunk-size``, ``--rollout-temperature`` (the trained log-probs are those of the
    tempered distribution the engine sampled from), ``--bf16`` (Megatron only; not exercised
    on CPU) and ``--attention-kernel`` (Megatron only; ``auto``: fused where the model is on a GPU).
    """
    objective = ObjectiveConfig.from_args(args)
    adam = AdamConfig.from_args(args)
    chunk, temperature = int(args.logprob_chunk_size), float(args.rollout_temperature)
    if args.training_backend == "hf":
        from gyre.training.hf_step import HFTrainStep

        return HFTrainStep(hf_model, objective, adam, chunk, temperature=temperature)
    from gyre.training.megatron_step import build_megatron_train_step

    kernel = getattr(args, "attention_kernel", "dense")
    if kernel == "auto":
        kernel = "fused" if next(hf_model.parameters()).device.type == "cuda" else "dense"
    return build_megatron_train_step(hf_model, objective, adam, chunk, bf16=bool(args.bf16),
                                     temperature=temperature, attention=kernel)
