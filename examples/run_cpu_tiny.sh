#!/usr/bin/env bash
# README command 1: set up .venv if needed, then run the main job on the embedded CPU default.
# Extra arguments are passed to pretrain_gyre.py (e.g. --train-steps 5 --run-dir runs/demo).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/tools/setup.sh" | tail -n 1)"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node 3 \
  pretrain_gyre.py --config examples/cpu_tiny.yaml "$@"
