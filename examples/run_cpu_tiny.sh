#!/usr/bin/env bash
# README command 1: set up .venv if needed, then run the main job on the embedded CPU default.
# Extra arguments are passed to pretrain_gyre.py (e.g. --train-steps 5 --run-dir runs/demo); a later
# --config replaces cpu_tiny.yaml, and GYRE_NPROC sets the ranks (default 3), e.g.
#   GYRE_NPROC=4 bash examples/run_cpu_tiny.sh --config examples/cpu_tp2.yaml
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/tools/setup.sh" | tail -n 1)"
bash "$ROOT/tools/setup_sandbox.sh" --bwrap  # executions run in bubblewrap sandboxes (docs/executions.md)
cd "$ROOT"
NPROC="${GYRE_NPROC:-3}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
export GLOG_minloglevel="${GLOG_minloglevel:-2}" TRANSFORMERS_VERBOSITY="${TRANSFORMERS_VERBOSITY:-error}"
# check the configuration once, in one process (exit 2 and one line), before starting the ranks
WORLD_SIZE="$NPROC" "$PY" pretrain_gyre.py --config examples/cpu_tiny.yaml "$@" --check-config
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  pretrain_gyre.py --config examples/cpu_tiny.yaml "$@"
