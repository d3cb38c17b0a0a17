#!/usr/bin/env bash
# The Slurm tier: examples/slurm/gyre_multinode.sbatch and gyre_fleet.sbatch submitted to a real two-node Slurm cluster
# (tests/slurm). Starts the local cluster of tools/setup_slurm.sh (nodes n1 and n2 on this machine;
# needs root) unless SLURM_CONF already names a running cluster, then runs the tier in .venv.
# Usage: bash tools/test_slurm.sh [pytest args]; `bash tools/setup_slurm.sh --stop` stops the cluster.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/tools/setup.sh" | tail -n 1)"
bash "$ROOT/tools/setup_sandbox.sh" --bwrap >&2  # the CPU job's executions run in bubblewrap sandboxes
if [[ -z "${SLURM_CONF:-}" ]] || ! sinfo -h >/dev/null 2>&1; then
  export "$(bash "$ROOT/tools/setup_slurm.sh" | tail -n 1)"
fi
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$PY" -m pytest tests/slurm -p no:cacheprovider --tb=short "$@"
