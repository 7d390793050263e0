#!/usr/bin/env bash
# Compressed swap in RAM (zram) for task pause with reclaim: a paused
# sandbox's memory is pushed out to swap, and a machine with none can only
# drop page cache. deploy/quickstart.sh runs "up" when the machine has no
# swap; docs/operations.md ("Swap for task pause") explains it.
#
# Usage: deploy/zram-swap.sh up [SIZE_MIB]   make zram swap if there is no swap
#                                            (default: 25% of RAM, at most 8 GiB)
#        deploy/zram-swap.sh down            remove the zram swap "up" made
#        deploy/zram-swap.sh status          say what swap there is
# Idempotent: "up" leaves any existing swap alone (its own included) and
# "down" removes only the device "up" made (recorded in $MARK).
set -euo pipefail
MARK=${OPENDSEC_ZRAM_MARK:-/run/opendsec-zram-swap}

swap_total_kib() { awk '/^SwapTotal:/ {print $2}' /proc/meminfo; }

status() {
  local kib; kib=$(swap_total_kib)
  if [ "${kib:-0}" -eq 0 ]; then echo "swap: none"; return; fi
  echo "swap: $((kib / 1024)) MiB"
  tail -n +2 /proc/swaps | awk '{printf "  %s (%s, %d MiB, priority %s)\n", $1, $2, $3/1024, $5}'
  if [ -s "$MARK" ]; then echo "  $(cat "$MARK") was made by deploy/zram-swap.sh"; fi
}

up() {
  if [ "$(swap_total_kib)" -gt 0 ]; then
    echo "swap present ($(( $(swap_total_kib) / 1024 )) MiB): left as it is"
    return 0
  fi
  local mem_kib size_mib id dev sys
  mem_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
  size_mib=${1:-$(( mem_kib / 4 / 1024 ))}
  [ "$size_mib" -gt 8192 ] && size_mib=8192
  [ "$size_mib" -ge 64 ] || { echo "zram-swap: size ${size_mib} MiB is too small (give at least 64)" >&2; return 1; }
  if [ ! -e /sys/class/zram-control/hot_add ]; then
    modprobe zram num_devices=0 2>/dev/null || modprobe zram || { echo "zram-swap: the kernel has no zram module (CONFIG_ZRAM); set up a swap file instead (docs/operations.md)" >&2; return 1; }
  fi
  if [ -e /sys/class/zram-control/hot_add ]; then
    id=$(cat /sys/class/zram-control/hot_add)
  else
    id=0 # an old zram without hot_add: its first device
  fi
  dev=/dev/zram$id; sys=/sys/block/zram$id
  # lz4 where the kernel has it (fast); the default otherwise.
  if grep -qw lz4 "$sys/comp_algorithm"; then echo lz4 > "$sys/comp_algorithm"; fi
  echo "$((size_mib * 1024 * 1024))" > "$sys/disksize"
  mkswap "$dev" >/dev/null
  swapon -p 100 "$dev"
  echo "$dev" > "$MARK"
  echo "no swap on this machine: made $dev, ${size_mib} MiB of zram swap ($(cat "$sys/comp_algorithm" | grep -o '\[[^]]*\]' | tr -d '[]'), priority 100)"
}

down() {
  [ -s "$MARK" ] || { echo "no zram swap made by deploy/zram-swap.sh"; return 0; }
  local dev id
  dev=$(cat "$MARK"); id=${dev#/dev/zram}
  if grep -q "^$dev " /proc/swaps; then swapoff "$dev"; fi
  echo 1 > "/sys/block/zram$id/reset" 2>/dev/null || true
  if [ -e /sys/class/zram-control/hot_remove ] && [ "$id" != 0 ]; then echo "$id" > /sys/class/zram-control/hot_remove 2>/dev/null || true; fi
  rm -f "$MARK"
  echo "removed the zram swap $dev"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  status) status ;;
  *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
