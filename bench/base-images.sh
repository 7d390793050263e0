#!/usr/bin/env bash
# Base images benchmark (issue 14): what root/base and root/code-interpreter
# cost CI. Builds both from scratch on the cached py-3.11 root (hard-linked
# into a scratch cache, so the real cache is never touched), then imports
# each of busybox, py, base and code-interpreter into an empty store, and
# times what a test system does on later runs instead (scripts/lib/system.sh
# cached_store: a hard-linked copy of the imported store). Sizes are du of
# the root and of the store. Runs as root; about 10 min. The report is
# printed and written to bench/results/<YYYY-MM-DD>-base-images.md.
# Not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/base-images.sh must run as root (chroot, mounts)" >&2; exit 1; }
REAL=${OPENDSEC_CACHE:-/var/cache/opendsec}
bash deploy/images/build.sh --no-import --only py >/dev/null

W=$(mktemp -d /var/tmp/odbench-base.XXXXXX)
trap 'rm -rf --one-file-system "$W"' EXIT
go build -o "$W/bin/opendsec" ./cmd/opendsec
mkdir -p "$W/cache/rootfs"
cp -a "$REAL/rootfs/py-3.11" "$W/cache/rootfs/py-3.11"
cp "$REAL/rootfs/py-3.11.stamp" "$W/cache/rootfs/"

ms() { echo $(( $(date +%s%N) / 1000000 )); }
t0=$(ms)
OPENDSEC_CACHE=$W/cache bash deploy/images/build.sh --no-import --only base >"$W/base.log" 2>&1
t1=$(ms)
OPENDSEC_CACHE=$W/cache bash deploy/images/build.sh --no-import --only code-interpreter >"$W/ci.log" 2>&1
t2=$(ms)
again0=$(ms)
OPENDSEC_CACHE=$W/cache bash deploy/images/build.sh --no-import --only code-interpreter >/dev/null 2>&1
again1=$(ms)

imp() { # name dir -> seconds and store MiB
  local d=$W/store-$1
  mkdir -p "$d"
  printf '{"version": 1, "data_dir": "%s", "node": {"image_dir": "%s/images"}}\n' "$d" "$d" >"$d/c.json"
  local a b
  a=$(ms)
  "$W/bin/opendsec" image import-rootfs -q --config "$d/c.json" --data-dir "$d" --name "$1" --rootfs "$2" --user root >/dev/null 2>&1
  b=$(ms)
  echo "$(( b - a )) $(du -sm "$d/images" | cut -f1)"
}
declare -A IMP
IMP[busybox]=$(imp root/busybox "$REAL/rootfs/busybox")
IMP[py]=$(imp root/py:3.11 "$W/cache/rootfs/py-3.11")
IMP[base]=$(imp root/base "$W/cache/rootfs/base")
IMP[ci]=$(imp root/code-interpreter "$W/cache/rootfs/code-interpreter")
c0=$(ms)
cp -al "$W/store-root/code-interpreter/images" "$W/linked"
c1=$(ms)

size() { du -sm "$1" | cut -f1; }
OUT=bench/results/$(date -u +%F)-base-images.md
{
  echo "# Base images: build, size, import ($(date -u +%F))"
  echo
  echo "Command: \`bash bench/base-images.sh\` on $(nproc) CPUs ($(uname -r)), mirror $(grep -h -m1 -o 'from http[^ ]*' "$W/base.log" | cut -d' ' -f2)."
  echo "One run; builds start from the cached py-3.11 root (its debootstrap is not timed)."
  echo
  echo "| image | build | root size | import into an empty store | store size |"
  echo "|---|---|---|---|---|"
  read -r ib sb <<<"${IMP[busybox]}"; echo "| root/busybox | (cached) | $(size "$REAL/rootfs/busybox") MiB | $ib ms | $sb MiB |"
  read -r ip sp <<<"${IMP[py]}"; echo "| root/py:3.11 | (cached) | $(size "$W/cache/rootfs/py-3.11") MiB | $ip ms | $sp MiB |"
  read -r ia sa <<<"${IMP[base]}"; echo "| root/base | $(( (t1 - t0) / 1000 )) s | $(size "$W/cache/rootfs/base") MiB | $ia ms | $sa MiB |"
  read -r ic sc <<<"${IMP[ci]}"; echo "| root/code-interpreter | $(( (t2 - t1) / 1000 )) s | $(size "$W/cache/rootfs/code-interpreter") MiB | $ic ms | $sc MiB |"
  echo
  echo "- build.sh again with every root cached: $(( again1 - again0 )) ms."
  echo "- A test system's store on later runs (hard-linked copy of the cached imported store, cached_store): $(( c1 - c0 )) ms, vs $ic ms importing root/code-interpreter ($(( ic / (c1 - c0 > 0 ? c1 - c0 : 1) ))x)."
} | tee "$OUT"
