#!/usr/bin/env bash
# Set up Gyre's CPU environment in .venv (idempotent; a no-op in ~1 s when nothing changed).
#   - Debian libibverbs1 (needed by mooncake-transfer-engine-non-cuda), via apt-get when root
#   - .venv with Python 3.11, CPU requirements with torch pinned by constraints.txt on every pip call
#     (the test tools among them: pytest, ruff and import-linter for tests/test_lint.py)
#   - dashscope 2.0.2 without dependencies (it only carries the offline Qwen BPE file)
#   - requirements-fleet.txt (Ray, for --execution-fleet and tests/fleet; the embedded default runs without it)
#   - a .pth file so `gyre` and `megatron_patches` import from this checkout
# Usage: bash tools/setup.sh        (prints the venv's python path as its last line)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
say() { echo "[gyre setup] $*" >&2; }

if ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1' >/dev/null; then  # not grep -q: pipefail + SIGPIPE
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian libibverbs1"
    apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libibverbs1 >/dev/null; }
  else
    say "warning: libibverbs1 missing and not root; Mooncake's TCP transport will not import"
  fi
fi

if [ ! -x "$PY" ]; then
  BASE="$(command -v python3.11 || true)"
  if [ -z "$BASE" ] && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    BASE="$(command -v python3)"
  fi
  [ -n "$BASE" ] || { say "error: Python 3.11 not found (torch 2.13.0's CPU wheel is cp311)"; exit 2; }
  say "creating .venv with $BASE"
  "$BASE" -m venv "$VENV"
fi

STAMP="$VENV/.gyre-setup-stamp"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-fleet.txt" "$ROOT/constraints.txt" "$ROOT/tools/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  say "installing CPU requirements (torch pinned by constraints.txt)"
  PIP=("$PY" -m pip --disable-pip-version-check -q)
  "${PIP[@]}" install -c "$ROOT/constraints.txt" -r "$ROOT/requirements.txt" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  "${PIP[@]}" install -c "$ROOT/constraints.txt" --no-deps dashscope==2.0.2 2>&1 | grep -v '^WARNING: Location' >&2 || true
  # optional for a run, installed for the test tier (tests/fleet): the execution fleet's Ray
  "${PIP[@]}" install -c "$ROOT/constraints.txt" -r "$ROOT/requirements-fleet.txt" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  "$PY" -W ignore -c 'import torch, megatron.core, transformers, yaml, fastapi, pytest, ruff, importlinter; assert torch.__version__.startswith("2.13.0"), torch.__version__' \
    || { say "error: requirements did not install"; exit 1; }
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$ROOT" > "$SITE/gyre-checkout.pth"
  echo "$WANT" > "$STAMP"
fi
echo "$PY"
