#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the GPU check installs on a GPU machine
# without internet access: Python 3.12, x86_64, torch preinstalled there.  Two folders, each under
# 64 MiB so that each can travel with one command: .gpu_wheels/core (transformers, megatron-core,
# the HTTP stack, pytest and everything they import, resolved by pip for CPython 3.12) and
# .gpu_wheels/mooncake (Mooncake's TCP build, for weight snapshots, with the Debian libraries it links).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
          --platform any)
get() {  # folder, pinned packages... (no dependencies: the list is complete)
  local dir="$ROOT/.gpu_wheels/$1"; shift
  rm -rf "$dir"  # made anew: a wheel of an earlier pin left beside the new one would fail the install
  mkdir -p "$dir"
  "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$dir" "$@"
  du -sh "$dir"
}
# What the check imports, resolved as a whole for CPython 3.12; torch and what comes with it
# (CUDA libraries, triton, sympy, networkx, mpmath, setuptools) are the machine's own.
# megatron-core is the GPU environment's (requirements-gpu.txt, Python >= 3.12), downloaded on its
# own: pip's dry run judges Requires-Python by the Python running it (3.11 here), and megatron-core
# 0.17 and newer require 3.12; what it needs besides torch (numpy, packaging) is in the resolved set.
MEGATRON_CORE=megatron-core==0.19.2
REPORT="$(mktemp)"
trap 'rm -f "$REPORT"' EXIT
"$PY" -m pip install -q --dry-run --ignore-installed --report "$REPORT" "${PLATFORM[@]}" --target "$(mktemp -d)" \
  transformers==5.24.0 tokenizers==0.23.3 safetensors numpy packaging pyyaml filelock==4.3.1 jinja2 \
  fastapi uvicorn httpx sse-starlette simpy tqdm pytest 2>/dev/null
mapfile -t CORE < <("$PY" - "$REPORT" <<'PY'
import json, re, sys
skip = re.compile(r"^(torch|triton|nvidia-.*|sympy|networkx|mpmath|setuptools)$")
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if not skip.match(name.lower().replace("_", "-")):
        print(f"{name}=={version}")
PY
)
# dashscope only carries the offline Qwen tokenizer file: without its dependencies, as on CPU
get core "${CORE[@]}" "$MEGATRON_CORE" dashscope==2.0.2
get mooncake mooncake-transfer-engine-non-cuda==0.3.13.post1
# Mooncake's TCP build links libibverbs (Debian packages; unpacked, not installed, on the GPU machine)
if command -v apt-get >/dev/null; then
  (cd "$ROOT/.gpu_wheels/mooncake" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 2>/dev/null) || \
    echo "prepare_wheels: apt-get download failed; the GPU machine then needs libibverbs1 installed" >&2
fi
