#!/usr/bin/env bash
# Builds OpenDsec and the benchmark, starts a throwaway `opendsec up` (free
# loopback ports, temp data dir), runs bench/sandbox against it, and stops it.
# Runs as root. Extra arguments go to the benchmark (e.g. -creates 100,
# -first-command 50, -settle 0); the node runs with its default warm pool.
# The report is printed and written to bench/results/<YYYY-MM-DD>-core.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
[ "$(id -u)" = 0 ] || { echo "bench/run.sh must run as root (runc, mounts, cgroups)" >&2; exit 1; }

. scripts/lib/system.sh
BIN=$(mktemp -d /tmp/odbench-bin.XXXXXX)
DD=$(mktemp -d /tmp/odbench-dd.XXXXXX)
cleanup() {
  stop_system # up runs with --stop-sandboxes: nothing of this run outlives it
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD and $BIN" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT

echo "== build" >&2
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS="-s -w -X github.com/kernflux/opendsec/internal/version.Version=$VERSION"
go build -ldflags "$LDFLAGS" -o "$BIN/" ./cmd/opendsec ./bench/sandbox
CGO_ENABLED=0 go build -ldflags "$LDFLAGS" -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
bash scripts/build-init.sh "$BIN/opendsec-init"

# The busybox rootfs, built once and cached (deploy/images/build.sh).
CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
[ -d "$CACHE/busybox" ] || bash deploy/images/build.sh --no-import

echo "== opendsec up (data dir $DD)" >&2
OPENDSEC_LOG_LEVEL=${OPENDSEC_BENCH_LOG_LEVEL:-info} start_system "$BIN" "$DD" busybox -- --stop-sandboxes

echo "== bench" >&2
rc=0
"$BIN/sandbox" -endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" -rootfs "$CACHE/busybox" \
  -command "bench/run.sh $*" -revision "$VERSION" "$@" || rc=$?
if [ $rc != 0 ]; then echo "--- opendsec up log (tail)" >&2; tail -n 40 "$DD/up.log" >&2; fi
exit $rc
