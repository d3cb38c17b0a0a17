#!/usr/bin/env bash
# Install what Gyre's sandboxed executions and their tests use, once per machine (idempotent):
#   - Debian's bubblewrap, podman, runc, catatonit and mmdebstrap (apt-get, as root)
#   - the test image localhost/gyre-test:bookworm: a Debian bookworm root file system built by
#     mmdebstrap from Debian's packages (no container registry), imported into podman and also
#     tagged docker.io/library/debian:bookworm, so a Dockerfile `FROM debian:bookworm` builds offline.
#     The root file system is cached under ~/.cache/gyre/sandbox (rebuilt when its package list changes).
# Usage: bash tools/setup_sandbox.sh          (prints one summary line; exit 0 even where a tool cannot
#        be installed -- the tests of that backend then skip with the reason)
#        bash tools/setup_sandbox.sh --bwrap    (bubblewrap only: what the main job's default needs)
set -uo pipefail
CACHE="${GYRE_SANDBOX_CACHE:-$HOME/.cache/gyre/sandbox}"
IMAGE=localhost/gyre-test:bookworm
PACKAGES="python3,git,ca-certificates,procps"
say() { echo "[gyre sandbox setup] $*" >&2; }

TOOLS="bwrap:bubblewrap podman:podman runc:runc catatonit:catatonit mmdebstrap:mmdebstrap"
[ "${1:-}" = "--bwrap" ] && TOOLS="bwrap:bubblewrap"
need=()
for tool in $TOOLS; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${need[@]}" >/dev/null 2>&1; } \
      || say "warning: apt-get could not install ${need[*]}"
  else
    say "warning: ${need[*]} missing and not root: those backends' tests will skip"
  fi
fi

if [ "${1:-}" = "--bwrap" ]; then
  command -v bwrap >/dev/null || say "warning: bubblewrap is missing: executions will run unsandboxed (local)"
  exit 0
fi
image=absent
if command -v podman >/dev/null && command -v mmdebstrap >/dev/null; then
  mkdir -p "$CACHE"
  stamp="$(echo "bookworm minbase $PACKAGES" | sha256sum | cut -c1-16)"
  tar="$CACHE/rootfs-$stamp.tar"
  if podman image exists "$IMAGE" && [ "$(podman image inspect --format '{{index .Labels "gyre.rootfs"}}' "$IMAGE" 2>/dev/null)" = "$stamp" ]; then
    image=present
  else
    if [ ! -s "$tar" ]; then
      say "building the test root file system (mmdebstrap bookworm: $PACKAGES; ~1 min)"
      mmdebstrap --quiet --format=tar --variant=minbase --include="$PACKAGES" bookworm "$tar.part" >"$CACHE/mmdebstrap.log" 2>&1 \
        && mv "$tar.part" "$tar" || { say "warning: mmdebstrap failed (see $CACHE/mmdebstrap.log)"; rm -f "$tar.part"; }
    fi
    if [ -s "$tar" ]; then
      podman import --change "LABEL gyre.rootfs=$stamp" --change 'CMD ["/bin/bash"]' "$tar" "$IMAGE" >"$CACHE/import.log" 2>&1 \
        && podman tag "$IMAGE" docker.io/library/debian:bookworm && image=built \
        || say "warning: podman import failed (see $CACHE/import.log)"
    fi
  fi
fi
echo "[gyre sandbox setup] bwrap: $(command -v bwrap || echo missing); podman: $(command -v podman || echo missing); image $IMAGE: $image"
