#!/usr/bin/env bash
# The main job with SGLang cells on the CPU (examples/cpu_sglang.yaml): installs the SGLang
# environment once per machine (tools/setup_sglang.sh) and runs pretrain_gyre.py from it, so the
# trainer and the SGLang servers share one torch. Extra arguments go to pretrain_gyre.py.
#   bash examples/run_cpu_sglang.sh --run-dir runs/sglang
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="$(bash "$ROOT/tools/setup_sglang.sh" | tail -n 1)"
PY="$ENV_DIR/bin/python"
cd "$ROOT"
NPROC="${GYRE_NPROC:-3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whichever one the environment was installed from
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
export GLOG_minloglevel="${GLOG_minloglevel:-2}" TRANSFORMERS_VERBOSITY="${TRANSFORMERS_VERBOSITY:-error}"
WORLD_SIZE="$NPROC" "$PY" pretrain_gyre.py --config examples/cpu_sglang.yaml "$@" --check-config
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  pretrain_gyre.py --config examples/cpu_sglang.yaml "$@"
