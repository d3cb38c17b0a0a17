#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the GPU check installs on a GPU machine
# without internet access: Python 3.12, x86_64, torch preinstalled there.  Two folders, each under
# 64 MiB so that each can travel with one command: .gpu_wheels/core (transformers, megatron-core,
# the HTTP stack, ...) and .gpu_wheels/mooncake (Mooncake's TCP build, for weight snapshots).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
get() {  # folder, packages...
  local dir="$ROOT/.gpu_wheels/$1"; shift
  mkdir -p "$dir"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 --platform any -d "$dir" "$@"
  du -sh "$dir"
}
get core transformers==5.24.0 tokenizers==0.23.3 safetensors megatron-core==0.16.1 huggingface-hub \
  fastapi starlette pydantic pydantic-core typing-inspection annotated-types uvicorn click h11 httpx httpcore \
  anyio idna certifi sniffio sse-starlette pyyaml regex tqdm packaging filelock dashscope simpy
get mooncake mooncake-transfer-engine-non-cuda==0.3.13.post1
# Mooncake's TCP build links libibverbs (Debian packages; unpacked, not installed, on the GPU machine)
if command -v apt-get >/dev/null; then
  (cd "$ROOT/.gpu_wheels/mooncake" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 2>/dev/null) || \
    echo "prepare_wheels: apt-get download failed; the GPU machine then needs libibverbs1 installed" >&2
fi
