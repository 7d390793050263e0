#!/usr/bin/env bash
# Measures the container backend's Fork (internal/runtime/container/fork_linux.go)
# side by side with bare copies of the same layer, in one run (the modes take
# turns in every iteration): a running sandbox that wrote ~50 MiB (one 40 MiB
# file, 100 of 100 KiB) is forked into 1 and 8 prepared sandboxes; reported are
# the Fork call's p50 and the source's frozen time p50, and beside them
# `cp --sparse=always` of its layer image (ext4), `cp --reflink=always` of it
# on XFS, and `cp -a` of its upper directory. Layer kinds: image (disk_mb 256)
# and dir (no quota), on the temp dir's file system and on a 4 GiB sparse XFS
# (reflink=1) made and loop-mounted here. "8-allfrozen" makes all 8 copies
# while the source is frozen, to compare with the default (one copy frozen,
# the others from it after the thaw). Runs as root; N (default 10) iterations.
# The results doc is bench/results/2026-12-02-fork.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/fork.sh must run as root (mounts, loop devices, runc)" >&2; exit 1; }
N=${N:-10}
T=$(mktemp -d /tmp/odbench-fork.XXXXXX)
cleanup() {
  umount "$T/xfs" 2>/dev/null || true
  rm -rf "$T"
}
trap cleanup EXIT
echo "== machine: $(uname -r), $(nproc) cores, temp fs: $(df -T /tmp | awk 'NR==2{print $2}')" >&2
truncate -s 4G "$T/xfs.img" && mkfs.xfs -q -m reflink=1 "$T/xfs.img" && mkdir "$T/xfs"
mount -o loop "$T/xfs.img" "$T/xfs"
export OPENDSEC_BENCH_XFS_DIR="$T/xfs"
go test -c -o "$T/container.test" ./internal/runtime/container/
(cd internal/runtime/container && OPENDSEC_ROOT_TESTS=1 "$T/container.test" -test.run '^$' -test.bench '^BenchmarkFork$' -test.benchtime "${N}x" 2>&1) \
  | grep -v '^goos\|^goarch\|^pkg\|^cpu\|^PASS'
