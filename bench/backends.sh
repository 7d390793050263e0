#!/usr/bin/env bash
# The sandbox backends side by side in one run (bench/backends): the same
# steps through the runtime.Runtime contract the node uses, against
# container (the reference row), gvisor, vm (QEMU under the accelerator
# kvmprobe decides: TCG without hardware KVM, KVM with it) and microvm
# (Firecracker; a row saying why it is skipped where it cannot open):
#   boot (create) to agent ready; snapshot: the call and the source's pause;
#   restore to agent ready; fork of 1 (source pause, clone ready) and of 4
#   (call, source pause, each clone's Start to agent ready with the 4
#   started at once, all ready); each of the 4 clones' memory while all run
#   (smaps_rollup of the clone's processes: Pss, Private, shared = Rss -
#   Private); and whether a fork kept the source's memory (a shell holding
#   a random value rewrites it in the clone).
# Runs as root; N (default 3) iterations; ONLY=container,gvisor,vm,microvm
# picks backends. The guest assets come from scripts/build-guest-assets.sh
# (OPENDSEC_GUEST_CACHE), runsc from /var/cache/opendsec/gvisor/runsc
# (OPENDSEC_RUNSC). Results: bench/results/<date>-backends.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/backends.sh must run as root (runc, runsc, QEMU, cgroups)" >&2; exit 1; }
N=${N:-3}
ONLY=${ONLY:-container,gvisor,vm,microvm}
T=$(mktemp -d /tmp/odbench-backends.XXXXXX)
trap 'rm -rf "$T"' EXIT
echo "== machine: $(uname -r), $(nproc) cores, $(qemu-system-x86_64 --version 2>/dev/null | head -1), load before: $(cut -d' ' -f1-3 /proc/loadavg)"
go test -c -o "$T/backends.test" ./bench/backends/
(cd bench/backends && OPENDSEC_BENCH_BACKENDS=1 OPENDSEC_BENCH_N="$N" OPENDSEC_BENCH_ONLY="$ONLY" \
  "$T/backends.test" -test.run '^TestBackends$' -test.v -test.timeout 60m 2>&1) \
  | grep -v '^=== RUN\|^--- PASS\|^PASS$\|INFO vm backend\|msg="accelerator detected"'
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
