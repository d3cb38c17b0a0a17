#!/usr/bin/env python
"""Write the embedded tiny Qwen3 model (config, safetensors, tokenizer + chat template) to a directory.

    python tools/make_tiny_model.py --out DIR [--tokenizer qwen|local] [--seed S]

No network: the tokenizer comes from dashscope 2.0.2's offline qwen.tiktoken (sha256-checked).
The last line printed is ``{"model_dir": "DIR"}``.
"""

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--tokenizer", choices=("qwen", "local"), default="local",
                        help="full Qwen BPE (151,669 ids) or its 4,096-rank prefix (fast)")
    parser.add_argument("--seed", type=int, default=1234, help="weight initialisation seed")
    parser.error = lambda msg: parser.exit(2, f"{parser.prog}: error: {msg}\n")  # one line
    args = parser.parse_args(argv)
    from gyre.embedded_model import build_tiny_model

    try:
        out = build_tiny_model(args.out, args.tokenizer, seed=args.seed)
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"model_dir": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
