#!/usr/bin/env bash
# The GPU check (docs/backends.md): installs what is missing into .gpu_venv (the machine's torch is
# kept: --system-site-packages), from the wheels tests/gpu/prepare_wheels.sh downloaded, offline,
# then runs tests/gpu/gpu_check.py and writes its JSON to $OUT/gpu_check.json (or ./gpu_check.json).
#
#   bash tests/gpu/gpu_check.sh                 # every phase (a-f)
#   bash tests/gpu/gpu_check.sh --phases a,c    # some
#   GPU_CHECK_INSTALL_ONLY=1 bash tests/gpu/gpu_check.sh   # install the wheels present, run nothing
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.gpu_venv"
[[ -x "$VENV/bin/python" ]] || "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
shopt -s nullglob
for dir in "$ROOT"/.gpu_wheels/*/; do
  wheels=("$dir"*.whl)
  if (( ${#wheels[@]} )); then
    "$VENV/bin/python" -m pip install -q --no-index --no-deps "${wheels[@]}"
  fi
done
debs=("$ROOT"/.gpu_wheels/*/*.deb)
if (( ${#debs[@]} )) && ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1' >/dev/null; then
  if command -v dpkg-deb >/dev/null; then
    for deb in "${debs[@]}"; do dpkg-deb -x "$deb" "$VENV/sysroot"; done  # libibverbs for Mooncake's TCP build
  else
    echo "gpu_check: no libibverbs and no dpkg-deb to unpack it: Mooncake's TCP build will not load" >&2
  fi
fi
for lib in "$VENV/sysroot/usr/lib/x86_64-linux-gnu" "$VENV/sysroot/lib/x86_64-linux-gnu"; do  # libnl is under /lib
  if [[ -d "$lib" ]]; then export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
[[ "${GPU_CHECK_INSTALL_ONLY:-0}" == 1 ]] && { echo "gpu_check: installed"; exit 0; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" PYTHONWARNINGS=ignore GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
exec "$VENV/bin/python" tests/gpu/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
