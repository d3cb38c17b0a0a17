#!/usr/bin/env bash
# Run Gyre's test suite on the CPU, installing what it needs first (tools/setup.sh).
# Extra arguments go to pytest, e.g. `bash tools/test.sh tests/trajectory -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/tools/setup.sh" | tail -n 1)"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$PY" -m pytest "$@"
