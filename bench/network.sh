#!/usr/bin/env bash
# Builds and runs bench/network: per-sandbox network setup time
# (internal/netpolicy) and TCP latency/throughput through the policy vs
# unpoliced veth paths, interleaved in one run. Everything happens in network
# namespaces the benchmark makes and removes; no packet leaves them. Runs as
# root. Extra arguments go to the benchmark (e.g. -rounds 3). The report is
# printed and written to bench/results/<YYYY-MM-DD>-network.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/network.sh must run as root (namespaces, veths, nftables)" >&2; exit 1; }
BIN=$(mktemp -d /tmp/odbench-netbin.XXXXXX)
trap 'rm -rf "$BIN"' EXIT
echo "== build" >&2
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
go build -o "$BIN/network" ./bench/network
echo "== bench" >&2
"$BIN/network" -command "bench/network.sh $*" -revision "$VERSION" \
  -out "bench/results/$(date -u +%Y-%m-%d)-network.md" "$@"
