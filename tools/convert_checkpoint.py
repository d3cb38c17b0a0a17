#!/usr/bin/env python
"""Convert a Qwen3 or Llama model between HF safetensors and Megatron ``GPTModel`` shards (both directions).

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir DIR --megatron-dir OUT [--tp T] [--pp P]
    python tools/convert_checkpoint.py megatron-to-hf --megatron-dir DIR --hf-dir OUT --config-from HF_DIR

Megatron shards are written as ``OUT/mp_rank_{tp:02d}[_{pp:03d}]/model.pt`` (Megatron's naming; the
PP suffix only when P > 1) holding ``{"model": state_dict, "tp": (rank, size), "pp": (rank, size)}``.
``megatron-to-hf`` copies config and tokenizer files from ``--config-from`` and writes
``model.safetensors``.  Errors exit 2 with one line.
"""

import argparse
import re
import shutil
import sys
from pathlib import Path


def shard_name(tp: int, pp: int, pp_size: int) -> str:
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp_size > 1 else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda msg: parser.exit(2, f"{parser.prog}: error: {msg}\n")
    sub = parser.add_subparsers(dest="direction", required=True)
    h2m = sub.add_parser("hf-to-megatron")
    h2m.add_argument("--hf-dir", required=True)
    h2m.add_argument("--megatron-dir", required=True)
    h2m.add_argument("--tp", type=int, default=1)
    h2m.add_argument("--pp", type=int, default=1)
    m2h = sub.add_parser("megatron-to-hf")
    m2h.add_argument("--megatron-dir", required=True)
    m2h.add_argument("--hf-dir", required=True)
    m2h.add_argument("--config-from", required=True, help="HF directory whose config/tokenizer to copy")
    for sp in (h2m, m2h):
        sp.error = parser.error
    a = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from gyre.embedded_model import load_hf_model
    from gyre.training.checkpoint_conversion import hf_to_megatron, megatron_to_hf

    try:
        if a.direction == "hf-to-megatron":
            model = load_hf_model(a.hf_dir)
            out = Path(a.megatron_dir)
            for t in range(a.tp):
                for p in range(a.pp):
                    d = out / shard_name(t, p, a.pp)
                    d.mkdir(parents=True, exist_ok=True)
                    sd = hf_to_megatron(model.state_dict(), model.config, t, a.tp, p, a.pp)
                    torch.save({"model": sd, "tp": (t, a.tp), "pp": (p, a.pp)}, d / "model.pt")
            print(out)
        else:
            cfg = AutoConfig.from_pretrained(a.config_from, local_files_only=True)
            shards = {}
            for d in sorted(Path(a.megatron_dir).glob("mp_rank_*")):
                if not re.fullmatch(r"mp_rank_\d{2}(_\d{3})?", d.name):
                    continue
                blob = torch.load(d / "model.pt", map_location="cpu", weights_only=True)
                shards[(blob["tp"][0], blob["pp"][0])] = blob["model"]
            if not shards:
                raise ValueError(f"no mp_rank_* shards under {a.megatron_dir}")
            sd = megatron_to_hf(shards, cfg)
            out = Path(a.hf_dir)
            out.mkdir(parents=True, exist_ok=True)
            for f in Path(a.config_from).iterdir():
                if f.suffix in (".json", ".jinja") and f.name != "model.safetensors.index.json":
                    shutil.copy(f, out / f.name)
            if cfg.tie_word_embeddings:
                sd.pop("lm_head.weight")
            save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
                      metadata={"format": "pt"})
            print(out)
    except (OSError, ValueError, KeyError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
