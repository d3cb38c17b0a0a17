#!/usr/bin/env bash
# Run Gyre's test suite on the CPU, installing what it needs first (tools/setup.sh, tools/setup_sandbox.sh,
# tools/setup_real_model.sh).
# Two pytest-xdist workers, a test file to each at a time (GYRE_TEST_WORKERS=N for another number,
# 0 for one process), in collection order, the slow files first (tests/conftest.py; with
# --no-loadscope-reorder, as xdist would otherwise hand out the files with the most tests first and
# leave the few long tests of tests/integration to the end). Extra arguments go to pytest, e.g.
# `bash tools/test.sh tests/trajectory -x`;
# `bash tools/test.sh -m "not slow"` is the smoke tier (everything but tests/integration and the
# tests marked slow).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/tools/setup.sh" | tail -n 1)"
bash "$ROOT/tools/setup_sandbox.sh" >&2  # bubblewrap, podman, the test image: the sandbox tiers run, not skip
GYRE_PYTHON="$PY" bash "$ROOT/tools/setup_real_model.sh" >&2  # SmolLM2-135M converted: its tests run, not skip
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$PY" -m pytest -n "${GYRE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
