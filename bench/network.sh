#!/usr/bin/env bash
# Builds and runs bench/network:
#  - per-sandbox network setup, rule change and teardown time (internal/netpolicy);
#  - TCP latency/throughput from a sandbox's namespace through the policy vs
#    unpoliced veth paths, interleaved;
#  - a port inside a real sandbox through the API (ConnectPort) vs from inside
#    the sandbox, against a throwaway `opendsec up` (free loopback ports, temp
#    data dir, its own node network namespace); NO_API=1 skips this part.
# Everything happens in network namespaces the benchmark makes and removes; no
# packet leaves them. Runs as root. Extra arguments go to the benchmark (e.g.
# -rounds 3). The report is printed and written to
# bench/results/<YYYY-MM-DD>-network.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/network.sh must run as root (namespaces, veths, nftables)" >&2; exit 1; }
. scripts/lib/system.sh
BIN=$(mktemp -d /tmp/odbench-netbin.XXXXXX)
DD=$(mktemp -d /tmp/odbench-netdd.XXXXXX)
cleanup() {
  stop_system # up runs with --stop-sandboxes: nothing of this run outlives it
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD and $BIN" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT

echo "== build" >&2
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
go build -o "$BIN/" ./bench/network
api=()
if [ "${NO_API:-}" != 1 ]; then
  go build -o "$BIN/" ./cmd/opendsec
  CGO_ENABLED=0 go build -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
  bash scripts/build-init.sh "$BIN/opendsec-init"
  CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
  [ -d "$CACHE/busybox" ] || bash deploy/images/build.sh --no-import
  echo "== opendsec up (data dir $DD)" >&2
  start_system "$BIN" "$DD" busybox -- --stop-sandboxes
  api=(-endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" -netns-dir "$DD/netns")
fi
echo "== bench" >&2
"$BIN/network" -command "bench/network.sh $*" -revision "$VERSION" \
  -out "bench/results/$(date -u +%Y-%m-%d)-network.md" "${api[@]}" "$@"
