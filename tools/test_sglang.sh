#!/usr/bin/env bash
# The SGLang tier: Gyre's calls against a real SGLang server on this CPU (tests/sglang), run in the
# SGLang environment that tools/setup_sglang.sh installs (once per machine, outside the checkout).
# Usage: bash tools/test_sglang.sh [pytest args]      GYRE_SGLANG_VERSION=0.5.10.post1 for the older
# protocol generation (default: the newest version Gyre runs here).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="$(bash "$ROOT/tools/setup_sglang.sh" | tail -n 1)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whichever one the environment was installed from
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$ENV_DIR/bin/python" -m pytest tests/sglang -p no:cacheprovider --tb=short "$@"
