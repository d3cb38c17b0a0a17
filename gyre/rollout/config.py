"""Settings of the embedded engine (a light module: no torch import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Settings of one embedded engine (units: tokens, sequences, seconds).

    ``model_dir=None`` uses the embedded tiny Qwen3 (``ensure_tiny_model("local")``).
    ``prefix_cache_tokens`` bounds the prefix cache (LRU); ``0`` disables it.
    ``logprob_mode``: ``"tempered"`` (default) or ``"truncated"`` (``gyre/rollout/sampling.py``).
    ``num_threads``: ``torch.set_num_threads`` for the process (``None``: leave as is).
    """

    model_dir: str | None = None
    tokenizer_dir: str | None = None
    served_model_name: str | None = None
    context_length: int | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    prefill_chunk_tokens: int = 2048
    prefix_cache_tokens: int = 131072
    logprob_mode: str = "tempered"
    weight_version: str = "default"
    random_seed: int = 0
    incremental_streaming_output: bool = False
    num_threads: int | None = None
