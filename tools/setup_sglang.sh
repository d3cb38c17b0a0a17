#!/usr/bin/env bash
# Install a real SGLang server for this CPU machine, once per machine, outside the checkout
# (idempotent; a no-op in seconds that writes nothing when the environment holds what it needs).
#   - its own virtual environment: ${GYRE_SGLANG_HOME:-~/.cache/gyre}/sglang-<version>
#     (SGLang pins its own torch and transformers, so it never shares the CPU .venv), made with
#     python3.12 where there is one, else python3.11 (requirements-sglang-env.txt pins
#     megatron-core by Python version: its 0.17 and newer releases need 3.12)
#   - Gyre's own package into it (a .pth to the installing checkout, no dependencies beyond
#     requirements-sglang-env.txt), so a job whose trainer and SGLang share one torch runs from
#     this environment; tools/test_sglang.sh and examples/run_cpu_sglang.sh put their own checkout
#     first on PYTHONPATH, so another clone reusing the environment runs its own code
#   - a CPU loader shim: sgl_kernel loads a CUDA kernel library that needs libcuda.so.1; with a
#     module named common_ops on the path its loader falls back to it and SGLang's torch-native
#     CPU code runs instead
#     and a sitecustomize that makes torch.cuda.synchronize a no-op where there is no CUDA device
#     (SGLang 0.5.23 calls it unconditionally when it releases memory)
#   - bin/sglang-server: `python -m sglang.launch_server --device cpu --dtype float32` with the
#     environment SGLang needs on a CPU (SGLANG_USE_CPU_ENGINE=1, HF_HUB_OFFLINE=1, the shim)
# Usage: bash tools/setup_sglang.sh [VERSION]   (default: the newest version Gyre runs here)
# Prints the environment's directory as its last line. GYRE_SGLANG_VERSION picks the version too.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-${GYRE_SGLANG_VERSION:-0.5.23}}"
HOME_DIR="${GYRE_SGLANG_HOME:-$HOME/.cache/gyre}"
ENV_DIR="$HOME_DIR/sglang-$VERSION"
PY="$ENV_DIR/bin/python"
say() { echo "[gyre setup_sglang] $*" >&2; }

case "$VERSION" in
  0.5.10.post1|0.5.23) ;;
  *) say "error: SGLang $VERSION is not one Gyre knows how to run here (0.5.23, 0.5.10.post1)"; exit 2 ;;
esac

# What the environment must hold besides requirements-sglang-env.txt (Mooncake's TCP build for weight
# snapshots between cells on the CPU, a GPU node takes the CUDA build; dashscope for the offline Qwen
# tokenizer, without its dependencies). A package the environment needs goes there or here: the
# environment is reused only when it holds all of them (tools/requirements_check.py).
EXTRAS=(mooncake-transfer-engine-non-cuda==0.3.13.post1)
NO_DEPS=(dashscope==2.0.2)
COMMON_OPS="$(cat <<'PYEOF'
# CPU shim: sgl_kernel's loader imports `common_ops` when its CUDA library cannot load (no
# libcuda.so.1 on a CPU machine). Empty on purpose: SGLang's torch-native CPU path needs none of it.
PYEOF
)"
SITECUSTOMIZE="$(cat <<'PYEOF'
# CPU shim, imported by every Python process of the server (PYTHONPATH): SGLang 0.5.23's
# release_memory_occupation calls torch.cuda.synchronize() unconditionally, which raises without an
# NVIDIA driver and kills the scheduler. With no CUDA device there is nothing to synchronize.
try:
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
except Exception:  # never stop the interpreter from starting
    pass
PYEOF
)"
LAUNCHER="$(cat <<SHEOF
#!/usr/bin/env bash
# An SGLang server on the CPU (written by Gyre's tools/setup_sglang.sh). Arguments go to
# sglang.launch_server after --device cpu --dtype float32 (a later --dtype wins).
export SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$ENV_DIR/cpu_shim\${PYTHONPATH:+:\$PYTHONPATH}"
exec "$PY" -m sglang.launch_server --device cpu --dtype float32 "\$@"
SHEOF
)"
# Reused as it is when its launcher and shims are the ones above and it holds sglang==VERSION and
# every requirement that applies to its Python (markers evaluated: megatron-core's pin depends on
# the Python version); nothing in it is written then.
ready() {
  [ -x "$ENV_DIR/bin/sglang-server" ] && [ "$(cat "$ENV_DIR/bin/sglang-server")" = "$LAUNCHER" ] \
    && [ "$(cat "$ENV_DIR/cpu_shim/common_ops.py" 2>/dev/null)" = "$COMMON_OPS" ] \
    && [ "$(cat "$ENV_DIR/cpu_shim/sitecustomize.py" 2>/dev/null)" = "$SITECUSTOMIZE" ] \
    && "$PY" "$ROOT/tools/requirements_check.py" "$ROOT/requirements-sglang-env.txt" --also "sglang==$VERSION" \
         $(printf -- '--also %s ' "${EXTRAS[@]}" "${NO_DEPS[@]}") 2>/dev/null
}
if ready; then
  echo "$ENV_DIR"; exit 0
fi

mkdir -p "$HOME_DIR"
exec 9>"$HOME_DIR/.sglang-$VERSION.lock"
flock 9   # two checkouts installing the same version wait for each other
if ready; then
  echo "$ENV_DIR"; exit 0
fi

# Python 3.12 where there is one (megatron-core 0.17 and newer need it), else 3.11
BASE="$(command -v python3.12 || command -v python3.11 || command -v python3)"
if [ ! -x "$PY" ]; then
  say "creating $ENV_DIR with $BASE"
  "$BASE" -m venv "$ENV_DIR"
fi
PIP=("$PY" -m pip --disable-pip-version-check -q)
# one resolver call: SGLang's own pins (torch, transformers, openai, ...) win over Gyre's extras
say "installing sglang==$VERSION, the torch it pins and Gyre's extras (several GB the first time, minutes)"
"${PIP[@]}" install "sglang==$VERSION" -r "$ROOT/requirements-sglang-env.txt" 2>&1 | grep -v '^WARNING: Location' >&2 || true
"${PIP[@]}" install "${EXTRAS[@]}" 2>&1 | grep -v '^WARNING: Location' >&2 || true
"${PIP[@]}" install --no-deps "${NO_DEPS[@]}" 2>&1 | grep -v '^WARNING: Location' >&2 || true

mkdir -p "$ENV_DIR/cpu_shim"
printf '%s\n' "$COMMON_OPS" > "$ENV_DIR/cpu_shim/common_ops.py"
printf '%s\n' "$SITECUSTOMIZE" > "$ENV_DIR/cpu_shim/sitecustomize.py"
printf '%s\n' "$LAUNCHER" > "$ENV_DIR/bin/sglang-server"
chmod +x "$ENV_DIR/bin/sglang-server"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$SITE/gyre-checkout.pth"
PYTHONPATH="$ENV_DIR/cpu_shim" SGLANG_USE_CPU_ENGINE=1 "$PY" -W ignore -c \
  "import sglang, torch, mooncake, megatron.core, sglang.srt.entrypoints.http_server; print('sglang', sglang.__version__, 'torch', torch.__version__)" >&2 \
  || { say "error: SGLang $VERSION does not import in $ENV_DIR"; exit 1; }
ready || { say "error: $ENV_DIR lacks what it needs after the install:"; "$PY" "$ROOT/tools/requirements_check.py" \
  "$ROOT/requirements-sglang-env.txt" --also "sglang==$VERSION" $(printf -- '--also %s ' "${EXTRAS[@]}" "${NO_DEPS[@]}"); exit 1; }
echo "$ENV_DIR"
