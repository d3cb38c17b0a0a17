#!/usr/bin/env bash
# mini-swe-agent (unmodified, from PyPI) on the bug-fix tasks, each execution in a podman container of
# the test image (Debian bookworm, built offline by tools/setup_sandbox.sh), no network: its model
# calls reach rank 0's proxy through the container's own socket; each task's test suite runs in a
# fresh container of the same image. One optimizer step on the embedded tiny model (whose replies are
# noise: the point is the path, not the fix). Extra flags go to pretrain_gyre.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/setup_sandbox.sh" >&2
exec bash "$ROOT/examples/run_cpu_tiny.sh" --harness mini-swe-agent --harness-max-turns 3 \
  --tasks "$ROOT/examples/tasks/bugfix" --execution-backend podman \
  --task-environment image:localhost/gyre-test:bookworm --execution-timeout-s 120 \
  --train-steps 1 --n-samples-per-prompt 2 --global-batch-groups 2 "$@"
