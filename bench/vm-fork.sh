#!/usr/bin/env bash
# Measures the vm backend's memory snapshots and fork with memory under the
# accelerator this machine has (TCG here), in one run on one booted guest
# (internal/runtime/vm BenchmarkGuestFork): every iteration takes in turn a
# Snapshot (call, source pause), a Restore + Start of it (to the identity
# set), a Fork of 1 and of 4 (call, source pause, each fork's Start, the 4
# started at once), and the memory of the 4 forks' QEMUs from
# /proc/<pid>/smaps_rollup (Rss, Pss, Private) beside the booted source's.
# Runs as root; N (default 3) iterations; the guest assets come from
# scripts/build-guest-assets.sh (OPENDSEC_GUEST_CACHE). The results doc is
# bench/results/2026-12-02-vm-fork.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/vm-fork.sh must run as root (netns, taps, cgroups, QEMU)" >&2; exit 1; }
N=${N:-3}
T=$(mktemp -d /tmp/odbench-vmfork.XXXXXX)
trap 'rm -rf "$T"' EXIT
echo "== machine: $(uname -r), $(nproc) cores, $(qemu-system-x86_64 --version | head -1), load: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
go test -c -o "$T/vm.test" ./internal/runtime/vm/
(cd internal/runtime/vm && OPENDSEC_ROOT_TESTS=1 "$T/vm.test" -test.run '^$' -test.bench '^BenchmarkGuestFork$' -test.benchtime "${N}x" -test.v -test.timeout 30m 2>&1) \
  | grep -v '^goos\|^goarch\|^pkg\|^cpu\|^PASS\|INFO vm backend\|^=== RUN'
