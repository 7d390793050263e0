#!/usr/bin/env bash
# Measures task pause with reclaim on the vm backend (QEMU under the
# accelerator this machine has: TCG here) and on gvisor, in one run:
# internal/runtime/vm BenchmarkGuestReclaim and internal/runtime/gvisor
# BenchmarkReclaim. Each holds 96 MiB in a tmpfs of its guest and a
# counter, and every iteration does a pause and resume in place, then a
# pause, Reclaim (the guest's state to disk, the VMM or sandbox process
# gone: time, memory charged before and after) and Resume (the restore);
# the counter must count on. Runs as root; N (default 3) iterations. The
# results doc is bench/results/2026-12-06-vm-reclaim.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/reclaim.sh must run as root (netns, taps, cgroups, QEMU, runsc)" >&2; exit 1; }
N=${N:-3}
T=$(mktemp -d /tmp/odbench-reclaim.XXXXXX)
trap 'rm -rf "$T"' EXIT
echo "== machine: $(uname -r), $(nproc) cores, $(qemu-system-x86_64 --version | head -1), load: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
go test -c -o "$T/vm.test" ./internal/runtime/vm/
go test -c -o "$T/gvisor.test" ./internal/runtime/gvisor/
filter() { grep -v '^goos\|^goarch\|^pkg\|^cpu\|^PASS\|INFO vm backend\|^=== RUN'; }
(cd internal/runtime/vm && OPENDSEC_ROOT_TESTS=1 "$T/vm.test" -test.run '^$' -test.bench '^BenchmarkGuestReclaim$' -test.benchtime "${N}x" -test.v -test.timeout 30m 2>&1) | filter
(cd internal/runtime/gvisor && OPENDSEC_ROOT_TESTS=1 "$T/gvisor.test" -test.run '^$' -test.bench '^BenchmarkReclaim$' -test.benchtime "${N}x" -test.v -test.timeout 30m 2>&1) | filter
