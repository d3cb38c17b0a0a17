"""A Hugging Face causal LM behind the :class:`gyre.rollout.embedded.core.ModelRunner` protocol, on CPU.

KV storage is one preallocated fp32 tensor ``[layers, 2, slots, kv_heads, capacity, head_dim]``
(grown by doubling); slot ``b`` holds running sequence ``b`` and position ``t`` is column
``t``.  The HF model runs unchanged: a ``transformers`` ``Cache`` whose layers are
:class:`_SlotLayerImpl` writes the new K/V in place.  Sequences are right-padded: in a decode
step row ``b`` writes column ``positions[b]`` at RoPE position ``positions[b]`` and a 2-D
attention mask hides later columns, so a padded batch equals per-sequence forwards up to fp32
summation order.  Prefill runs one sequence at a time in chunks of ``prefill_chunk_tokens``.

Weights: :meth:`HFModelRunner.load_weights` copies named tensors (HF state-dict names) into the
live parameters; :meth:`~HFModelRunner.release_weights` frees parameter storage (spilling to a
temporary safetensors file first unless they still equal the model directory) and
:meth:`~HFModelRunner.resume_weights` reloads them bit-identically.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)


class WeightError(ValueError):
    """Unknown names, wrong shapes, missing tensors or unreadable weight files."""


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read HF-named tensors from a model directory or one weight file.

    Accepts a directory with ``*.safetensors`` (or ``pytorch_model*.bin``) files, or a single
    ``.safetensors`` / ``.bin`` / ``.pt`` file.  ``.bin``/``.pt`` load with ``weights_only=True``.

    Raises:
        WeightError: the path does not exist or holds no readable weights.
    """
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors")) or sorted(p.glob("pytorch_model*.bin"))
        if not files:
            raise WeightError(f"{p}: no *.safetensors or pytorch_model*.bin files")
    elif p.is_file():
        files = [p]
    else:
        raise WeightError(f"{p}: no such file or directory")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                part = load_file(str(f))
            else:
                part = torch.load(str(f), map_location="cpu", weights_only=True)
        except Exception as exc:  # corrupt or foreign file: a client error, not a crash
            raise WeightError(f"{f}: cannot read weights ({type(exc).__name__}: {exc})"[:500]) from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise WeightError(f"{f}: not a mapping of names to tensors")
        out.update(part)
    return out


def _slot_layer_class():
    """Build :class:`_SlotLayer` lazily (``transformers`` is imported only when a runner is made)."""
    global _SlotLayer
    if _SlotLayer is not None:
        return _SlotLayer
    from transformers.cache_utils import CacheLayerMixin

    class SlotLayer(_SlotLayerImpl, CacheLayerMixin):
        pass

    _SlotLayer = SlotLayer
    return SlotLayer


_SlotLayer = None


class _SlotLayerImpl:
    """One attention layer's view of the slot KV store (a ``transformers`` cache layer).

    Mode ``"decode"``: rows ``0..B-1``, each writes one column ``pos[b]``; returns columns
    ``[0, kv_len)``.  Mode ``"prefill"``: row ``slot`` writes columns ``[start, start+n)`` and
    returns columns ``[0, start+n)``.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = True

    def __init__(self, runner: "HFModelRunner", layer: int):
        self.runner = runner
        self.layer = layer
        self.is_initialized = True
        self.keys = self.values = None

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        r = self.runner
        kv = r._kv
        K, V = kv[self.layer, 0], kv[self.layer, 1]        # [S, H, cap, D] views
        if r._mode == "decode":
            B = key_states.shape[0]
            rows = r._rows
            K[rows, :, r._pos] = key_states[:, :, 0]
            V[rows, :, r._pos] = value_states[:, :, 0]
            return K[:B, :, : r._kv_len], V[:B, :, : r._kv_len]
        s, start, n = r._slot, r._start, key_states.shape[2]
        K[s, :, start:start + n] = key_states[0]
        V[s, :, start:start + n] = value_states[0]
        return K[s:s + 1, :, : start + n], V[s:s + 1, :, : start + n]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.runner._kv_len, 0

    def get_seq_length(self) -> int:
        return self.runner._seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class HFModelRunner:
    """Slot-KV runner over a ``transformers`` decoder-only model (fp32, CPU).

    Args:
        model: e.g. ``Qwen3ForCausalLM`` in eval mode.
        source_dir: directory the weights were loaded from (for :meth:`resume_weights`).
        context_len: longest sequence served (default ``config.max_position_embeddings``).
        max_slots: most concurrent sequences (KV rows).
        prefill_chunk_tokens: tokens per prefill forward.
        initial_capacity: KV columns allocated at first use (grows by doubling).
    """

    def __init__(self, model, *, source_dir: str | os.PathLike | None = None, context_len: int | None = None,
                 max_slots: int = 64, prefill_chunk_tokens: int = 2048, initial_capacity: int = 256):
        from transformers.cache_utils import Cache

        self.model = model.eval()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(context_len or getattr(cfg, "max_position_embeddings", 32768))
        self.max_slots = max_slots
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.initial_capacity = initial_capacity
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # KV, indices and released weights live here
        self._kv: torch.Tensor | None = None
        self._layers = [_slot_layer_class()(self, i) for i in range(self.num_layers)]
        self._cache = Cache(layers=self._layers)
        self._mode = "decode"
        self._rows = torch.arange(0, device=self.device)
        self._pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._kv_len = self._seq_len = 0
        self._slot = self._start = 0
        # live parameters by state-dict name (tied weights appear under both names)
        self._params: dict[str, torch.nn.Parameter] = {
            k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.nn.Parameter)}
        self._specs = {k: (tuple(v.shape), v.dtype) for k, v in self._params.items()}
        unique: dict[int, str] = {}
        for name, p in self._params.items():
            unique.setdefault(id(p), name)
        self._unique_names = sorted(unique.values())
        self._source_dir = str(source_dir) if source_dir is not None else None
        self._initial_source = self._source_dir   # the engine's own model dir: assumed to stay
        self._dirty = source_dir is None
        self._spill_dir: str | None = None
        self.weights_released = False

    # ------------------------------------------------------------------ KV storage

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def kv_capacity(self) -> tuple[int, int]:
        """``(slots, columns)`` currently allocated (``(0, 0)`` when released)."""
        if self._kv is None:
            return (0, 0)
        return (self._kv.shape[2], self._kv.shape[4])

    def _ensure(self, slots: int, length: int) -> None:
        s0, c0 = self.kv_capacity
        if slots <= s0 and length <= c0:
            return
        s1 = min(max(slots, 2 * s0, 1), max(self.max_slots, slots))
        c1 = c0 if length <= c0 else min(max(length, 2 * c0, self.initial_capacity), self.context_len)
        c1 = max(c1, length, c0)
        new = torch.zeros(self.num_layers, 2, s1, self.num_kv_heads, c1, self.head_dim, dtype=self.dtype,
                          device=self.device)
        if self._kv is not None:
            new[:, :, :s0, :, :c0] = self._kv
        self._kv = new

    def release_kv(self) -> None:
        """Free the KV store (re-allocated on next use)."""
        self._kv = None

    def read_kv(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Copy of positions ``[start, end)`` of ``slot``: ``[layers, 2, kv_heads, n, head_dim]``."""
        return self._kv[:, :, slot, :, start:end].clone()

    def write_kv(self, slot: int, start: int, pieces: Sequence[torch.Tensor]) -> None:
        """Write payloads (from :meth:`read_kv`) into ``slot`` from position ``start``."""
        total = sum(p.shape[3] for p in pieces)
        self._ensure(slot + 1, start + total + 1)
        pos = start
        for p in pieces:
            n = p.shape[3]
            self._kv[:, :, slot, :, pos:pos + n] = p
            pos += n

    @staticmethod
    def slice_kv(payload: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Positions ``[start, end)`` of a payload (a view)."""
        return payload[:, :, :, start:end]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of ``src`` into ``dst``."""
        if length:
            self._kv[:, :, dst, :, :length] = self._kv[:, :, src, :, :length]

    # ------------------------------------------------------------------ forward

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         cache=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    @torch.no_grad()
    def prefill(self, slot: int, token_ids: Sequence[int], start: int) -> None:
        """Store KV of ``token_ids`` at positions ``start..`` of ``slot`` (chunked, batch 1)."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        self._ensure(slot + 1, start + ids.numel() + 1)
        self._mode, self._slot = "prefill", slot
        pos = start
        for chunk in ids.split(self.prefill_chunk_tokens):
            n = chunk.numel()
            self._start, self._seq_len, self._kv_len = pos, pos, pos + n
            self._forward(chunk[None], torch.arange(pos, pos + n, device=self.device)[None], None)
            pos += n

    @torch.no_grad()
    def decode(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Feed ``token_ids[b]`` at ``positions[b]`` of slot ``b``; return logits ``[B, V]`` fp32."""
        B = len(token_ids)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        longest = int(pos.max()) + 1
        self._ensure(B, longest)
        self._mode = "decode"
        self._rows, self._pos = torch.arange(B, device=self.device), pos
        self._kv_len, self._seq_len = longest, longest - 1
        mask = None
        if int(pos.min()) + 1 != longest:
            mask = (torch.arange(longest, device=self.device)[None, :] <= pos[:, None]).long()
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        return self._forward(ids[:, None], pos[:, None], mask)

    # ------------------------------------------------------------------ weights

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{state_dict_name: (shape, dtype)}`` of the live parameters (tied names included)."""
        return dict(self._specs)

    def check_weights(self, named: Mapping[str, torch.Tensor], require_all: bool) -> None:
        """Validate names and shapes without touching the model.

        Raises:
            WeightError: unknown name, shape mismatch, non-floating tensor, or (``require_all``)
                a parameter without a tensor.
        """
        unknown = sorted(k for k in named if k not in self._specs)
        if unknown:
            raise WeightError(f"unknown parameter name(s): {', '.join(unknown[:5])}"
                              f"{' ...' if len(unknown) > 5 else ''}")
        for k, t in named.items():
            shape = self._specs[k][0]
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise WeightError(f"{k}: expected a floating-point tensor")
            if tuple(t.shape) != shape:
                raise WeightError(f"{k}: shape {tuple(t.shape)} != expected {shape}")
        if require_all:
            covered = {id(self._params[k]) for k in named}
            missing = [n for n in self._unique_names if id(self._params[n]) not in covered]
            if missing:
                raise WeightError(f"missing parameter(s): {', '.join(missing[:5])}"
                                  f"{' ...' if len(missing) > 5 else ''}")

    @torch.no_grad()
    def load_weights(self, named: Mapping[str, torch.Tensor], *, source_dir: str | None = None) -> None:
        """Copy ``named`` tensors into the live parameters (cast to the model dtype).

        ``source_dir``: the weights now equal that directory's (full load from disk).
        Raises:
            WeightError: see :meth:`check_weights`; also when the weights are released.
        """
        if self.weights_released:
            raise WeightError("weights are released; resume_memory_occupation(tags=['weights']) first")
        self.check_weights(named, require_all=source_dir is not None)
        for k, t in named.items():
            self._params[k].data.copy_(t.to(self.dtype))
        if source_dir is not None:
            self._source_dir, self._dirty = source_dir, False
        else:
            self._dirty = True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached copies of the unique parameters (one name per tied group)."""
        return {n: self._params[n].detach().clone() for n in self._unique_names}

    def release_weights(self) -> None:
        """Free parameter storage.  The weights are first spilled to a temporary safetensors file
        unless they still equal the engine's initial model directory (a directory a later weight
        update came from may be gone by the time of :meth:`resume_weights`)."""
        if self.weights_released:
            return
        if self._dirty or self._source_dir is None or self._source_dir != self._initial_source:
            from safetensors.torch import save_file

            self._spill_dir = tempfile.mkdtemp(prefix="gyre-engine-weights-")
            save_file({n: self._params[n].detach().contiguous() for n in self._unique_names},
                      os.path.join(self._spill_dir, "model.safetensors"))
        for n in self._unique_names:
            p = self._params[n]
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.weights_released = True

    @torch.no_grad()
    def resume_weights(self) -> None:
        """Re-allocate parameters and reload the weights held before :meth:`release_weights`."""
        if not self.weights_released:
            return
        src = self._spill_dir or self._source_dir
        named = read_weights(src)
        for n in self._unique_names:
            shape, dtype = self._specs[n]
            self._params[n].data = torch.empty(shape, dtype=dtype, device=self.device)
        self.weights_released = False
        for k, t in named.items():
            if k in self._params:
                self._params[k].data.copy_(t.to(self.dtype))
        if self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir = None

    def describe(self) -> dict[str, Any]:
        """Static facts for ``/get_server_info``."""
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab_size, "context_length": self.context_len,
                "kv_capacity": list(self.kv_capacity), "dtype": str(self.dtype).replace("torch.", "")}


def load_model_dir(model_dir: str | os.PathLike):
    """``AutoModelForCausalLM`` from a local HF directory in fp32 eval mode (no network)."""
    from gyre.embedded_model import load_hf_model

    cfg = Path(model_dir) / "config.json"
    if not cfg.exists():
        raise WeightError(f"{model_dir}: no config.json (not an HF model directory)")
    json.loads(cfg.read_text())
    return load_hf_model(model_dir, dtype="float32")
