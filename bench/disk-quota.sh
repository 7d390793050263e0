#!/usr/bin/env bash
# Measures the writable-layer quota (internal/runtime/container/disk_linux.go)
# side by side with no quota, in one run (the modes take turns in every
# iteration): Create latency and Create+Start+agent ready, a 128 MiB fsync'd
# write inside the sandbox, and how (errno) and how fast a 256 MiB quota
# fills. Modes: none, image (sparse ext4 image, loop with direct I/O: the
# default), image-buffered (loop through the page cache), and project when
# the kernel can mount XFS with prjquota (a 1 GiB sparse XFS image is made
# and loop-mounted for it; this is skipped, and said so, on kernels without
# CONFIG_XFS_QUOTA). Runs as root; N (default 15) iterations.
# The results doc is bench/results/2026-12-01-disk-quota.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/disk-quota.sh must run as root (mounts, loop devices, runc)" >&2; exit 1; }
N=${N:-15}
T=$(mktemp -d /tmp/odbench-disk.XXXXXX)
cleanup() {
  umount "$T/xfs" 2>/dev/null || true
  rm -rf "$T"
}
trap cleanup EXIT
echo "== machine: $(uname -r), $(nproc) cores, state fs: $(df -T /tmp | awk 'NR==2{print $2}')" >&2
if zcat /proc/config.gz 2>/dev/null | grep -q '^CONFIG_XFS_QUOTA=y'; then
  truncate -s 1G "$T/xfs.img" && mkfs.xfs -q "$T/xfs.img" && mkdir "$T/xfs"
  mount -o loop,prjquota "$T/xfs.img" "$T/xfs"
  export OPENDSEC_BENCH_PRJQUOTA_DIR="$T/xfs"
else
  echo "== project: skipped, this kernel has no XFS quota support (CONFIG_XFS_QUOTA is not set)" >&2
fi
go test -c -o "$T/container.test" ./internal/runtime/container/
OPENDSEC_ROOT_TESTS=1 "$T/container.test" -test.run '^$' -test.bench '^BenchmarkDiskQuota$' -test.benchtime "${N}x" 2>&1 \
  | grep -v '^goos\|^goarch\|^pkg\|^cpu\|^PASS'
