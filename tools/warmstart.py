#!/usr/bin/env python
"""Supervised format warm-start: train a model on chat examples and save it as an HF directory.

    python tools/warmstart.py --out DIR [--model-dir SRC] [--examples FILE.jsonl | --builtin tool-loop]
                              [--builtin toy-sums --exclude-tasks examples/tasks/toy/tasks.jsonl]
                              [--builtin toy-largest --exclude-tasks examples/tasks/toy/largest.tasks.jsonl]
                              [--steps 200] [--lr 1e-3] [--seed 0]

Without --model-dir the embedded tiny Qwen3 (local tokenizer) is the start.  Examples are JSONL
objects ``{"messages": [...], "tools": [...]}`` rendered with the model's chat template; the loss
covers assistant tokens only.  Prints the loss at start and end and, last, ``{"model_dir": "DIR"}``.
Errors exit 2 with one line.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.error = lambda msg: p.exit(2, f"{p.prog}: error: {msg}\n")
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", default=None)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--examples", default=None, help="JSONL file of conversations")
    src.add_argument("--builtin", choices=("tool-loop", "toy-sums", "toy-largest"), default=None)
    p.add_argument("--exclude-tasks", default=None,
                   help="Task file whose instructions the examples leave out (toy-sums, toy-largest: the RL queries).")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.steps < 1 or a.lr <= 0:
        p.error("--steps must be >= 1 and --lr > 0")

    from gyre.embedded_model import ensure_tiny_model, load_hf_model, load_tokenizer
    from gyre.training.warmstart import BUILTIN_EXAMPLES, load_examples, sft

    try:
        exclude = []
        if a.exclude_tasks:
            from gyre.tasks import load_tasks

            exclude = [t.instruction for t in load_tasks(a.exclude_tasks).tasks]
        if a.builtin == "toy-sums":
            examples = BUILTIN_EXAMPLES[a.builtin](exclude)
        elif a.builtin == "toy-largest":
            examples = BUILTIN_EXAMPLES[a.builtin](exclude, seed=a.seed)
        else:
            examples = BUILTIN_EXAMPLES[a.builtin]() if a.builtin else load_examples(a.examples)
        src_dir = Path(a.model_dir) if a.model_dir else ensure_tiny_model("local")
        model, tok = load_hf_model(src_dir), load_tokenizer(src_dir)
        losses = sft(model, tok, examples, steps=a.steps, lr=a.lr, batch_size=a.batch_size, seed=a.seed)
    except (OSError, ValueError) as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    for f in ("generation_config.json", "gyre_model.json"):
        if (src_dir / f).exists():
            shutil.copy(src_dir / f, out / f)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps", file=sys.stderr)
    print(json.dumps({"model_dir": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
