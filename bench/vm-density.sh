#!/usr/bin/env bash
# VM density (issue 13 part 7): N idle VMs of MEM MiB (1 vCPU, one image:
# the py-3.11 base image as an EROFS layer) per configuration, side by side
# in one run (internal/runtime/vm TestVMDensity): baseline (microvm, layers
# on virtio-blk, no balloon); + virtio-balloon free page reporting; the
# same on q35 (the machine virtio-pmem needs); + layers on virtio-pmem with
# DAX; + zram swap (cold guest pages pushed into it once). Each VM boots,
# runs one Python process (imports, 128 MiB filled and freed) and idles;
# reported are the sum of the QEMUs' Pss and Rss (smaps_rollup), the guest
# RAM files' allocated size, zram's RAM, and the node's MemAvailable drop.
# Runs as root, alone: take the lock (flock /tmp/opendsec-root.lock bash
# bench/vm-density.sh). Env: N (16), MEM (512), BATCH (VMs booted at once,
# 4), SETTLE (s, 20); OPENDSEC_GUEST_CACHE (the guest assets' cache). When
# the machine has no swap, zram swap is made for the run and removed after
# (deploy/zram-swap.sh). The report is bench/results/<date>-vm-density.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/vm-density.sh must run as root (QEMU, cgroups, zram)" >&2; exit 1; }
N=${N:-16}; MEM=${MEM:-512}; BATCH=${BATCH:-4}; SETTLE=${SETTLE:-20}
T=$(mktemp -d /tmp/odbench-density.XXXXXX)
export OPENDSEC_ZRAM_MARK=$T/zram.mark
cleanup() {
  if [ -s "$OPENDSEC_ZRAM_MARK" ]; then bash deploy/zram-swap.sh down >&2 || true; fi
  rm -rf "$T"
}
trap cleanup EXIT
zram=0
if [ "$(awk '/^SwapTotal:/ {print $2}' /proc/meminfo)" -eq 0 ]; then
  bash deploy/zram-swap.sh up 4096 >&2 && zram=1
elif grep -q '^/dev/zram' /proc/swaps; then
  zram=1
else
  echo "the machine has swap that is not zram: no zram row" >&2
fi
go test -c -o "$T/vm.test" ./internal/runtime/vm/
OUT=bench/results/$(date -u +%F)-vm-density.md
start=$(date +%s)
(cd internal/runtime/vm && OPENDSEC_ROOT_TESTS=1 OPENDSEC_BENCH_DENSITY=1 OPENDSEC_DENSITY_N=$N OPENDSEC_DENSITY_MEM=$MEM \
  OPENDSEC_DENSITY_BATCH=$BATCH OPENDSEC_DENSITY_SETTLE=$SETTLE OPENDSEC_DENSITY_ZRAM=$zram OPENDSEC_DENSITY_OUT=$T/table.md \
  "$T/vm.test" -test.run '^TestVMDensity$' -test.v -test.timeout 60m 2>&1) | grep -v '^20[0-9][0-9]/' >&2
{
  echo "# VM density: $N idle VMs of $MEM MiB ($(date -u +%F))"
  echo
  echo "Command: \`flock /tmp/opendsec-root.lock env N=$N MEM=$MEM BATCH=$BATCH SETTLE=$SETTLE bash bench/vm-density.sh\`"
  echo "($(( $(date +%s) - start )) s); machine: $(uname -r), $(nproc) cores, $(awk '/^MemTotal:/ {printf "%d", $2/1048576}' /proc/meminfo) GiB,"
  echo "$(qemu-system-x86_64 --version | head -1), accel tcg, 1 vCPU each, image py-3.11 (EROFS), VMs booted $BATCH at a time, settle ${SETTLE} s."
  echo
  cat "$T/table.md"
} > "$OUT"
cat "$OUT"
echo "written: $OUT" >&2
