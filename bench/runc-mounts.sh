#!/usr/bin/env bash
# How the host's mount table size slows `runc run --detach`: for each N in
# MOUNTS (default "0 2000 4000 0 2000 4000"), a private mount namespace
# (unshare -m) gets N extra 4 KiB tmpfs mounts, then R (default 30) `runc
# run --detach` of the busybox rootfs run one after another; prints the p50.
# The extra mounts live only in that namespace: nothing else on the host sees
# them. A node with 1000 sandboxes has about 4 mounts each in its namespace
# (ext4 layer, tmpfs, overlay, netns): bench/results/2026-12-02-burst-profile.md.
# Runs as root; run it under /tmp/opendsec-root.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/runc-mounts.sh must run as root" >&2; exit 1; }
CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
[ -d "$CACHE/busybox" ] || bash deploy/images/build.sh --no-import
W=$(mktemp -d /tmp/odbench-runcmounts.XXXXXX)
trap 'rm -rf "$W"' EXIT
mkdir "$W/bundle" && (cd "$W/bundle" && runc spec)
python3 - "$W/bundle/config.json" "$CACHE/busybox" <<'PY'
import json, sys
p, root = sys.argv[1], sys.argv[2]
s = json.load(open(p))
s['root'] = {'path': root, 'readonly': True}
s['process']['terminal'] = False
s['process']['args'] = ['sleep', '100']
json.dump(s, open(p, 'w'))
PY
cat >"$W/inner.sh" <<'IN'
set -euo pipefail
W=$1 N=$2 R=$3
for i in $(seq 1 "$N"); do mkdir -p "$W/m/$i"; mount -t tmpfs -o size=4k t "$W/m/$i"; done
ts=()
for i in $(seq 1 "$R"); do
  t=$(date +%s%N)
  runc --root "$W/runc" run --detach -b "$W/bundle" "rm$$-$i" >/dev/null 2>&1 </dev/null
  ts+=($(( ($(date +%s%N) - t) / 1000000 )))
done
for i in $(seq 1 "$R"); do runc --root "$W/runc" delete --force "rm$$-$i" >/dev/null 2>&1 || true; done
p50=$(printf '%s\n' "${ts[@]}" | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
echo "| $(wc -l </proc/self/mountinfo) | $R | $p50 ms |"
IN
echo "| mounts in the namespace | runs | runc run --detach p50 |"
echo "|---|---|---|"
for n in ${MOUNTS:-0 2000 4000 0 2000 4000}; do
  unshare -m --propagation private bash "$W/inner.sh" "$W" "$n" "${R:-30}"
done
