"""Settings of the embedded engine (a light module: no torch import)."""

from __future__ import annotations

from dataclasses import dataclass


#: KV bytes the prefix cache may hold when ``prefix_cache_tokens`` is ``None`` (1 GiB).
PREFIX_CACHE_DEFAULT_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """Settings of one embedded engine (units: tokens, sequences, seconds).

    ``model_dir=None`` uses the embedded tiny Qwen3 (``ensure_tiny_model("local")``).
    ``prefix_cache_tokens`` bounds the prefix cache (LRU); ``0`` disables it; ``None`` sizes it
    to :data:`PREFIX_CACHE_DEFAULT_BYTES` of KV (about 1M tokens of the tiny model).
    ``max_running_requests``: KV slots; the slot store holds ``slots x longest sequence`` KV
    (right-padded), so keep it modest for very long contexts on big models.
    ``num_threads``: ``torch.set_num_threads`` for the process (``None``: leave as is).
    ``incremental_streaming_output``: stream chunks carry deltas (default; O(output) bytes per
    request) rather than SGLang's default cumulative chunks (O(output^2)); both are SGLang modes
    and :class:`gyre.rollout.client.engine_client.EngineClient` normalises either.
    ``device``: where the model and its KV live (``"cuda:0"`` on a GPU; sampling stays on CPU).
    """

    model_dir: str | None = None
    tokenizer_dir: str | None = None
    served_model_name: str | None = None
    context_length: int | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    prefill_chunk_tokens: int = 2048
    prefix_cache_tokens: int | None = None
    weight_version: str = "default"
    random_seed: int = 0
    incremental_streaming_output: bool = True
    num_threads: int | None = None
    device: str = "cpu"
