#!/usr/bin/env bash
# Snapshot benchmark (issue 12): CreateSnapshot vs PackDiff of the same
# sandbox, and creates from a snapshot vs from an image, side by side in one
# run (bench/snapshot). Builds OpenDsec and the benchmark, starts a
# throwaway `opendsec up` (free loopback ports, temp data dir), runs it and
# stops it. Runs as root. Extra arguments go to the benchmark (e.g.
# -rounds 5 -write-mib 1,16). The report is printed and written to
# bench/results/<YYYY-MM-DD>-snapshot.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/snapshot.sh must run as root (runc, mounts, cgroups)" >&2; exit 1; }
. scripts/lib/system.sh
BIN=$(mktemp -d /tmp/odbench-snap-bin.XXXXXX)
DD=$(mktemp -d /tmp/odbench-snap-dd.XXXXXX)
cleanup() {
  stop_system
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD and $BIN" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS="-s -w -X github.com/kernflux/opendsec/internal/version.Version=$VERSION"
go build -ldflags "$LDFLAGS" -o "$BIN/" ./cmd/opendsec ./bench/snapshot
CGO_ENABLED=0 go build -ldflags "$LDFLAGS" -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
bash scripts/build-init.sh "$BIN/opendsec-init"
[ -d "${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs/busybox" ] || bash deploy/images/build.sh --no-import
start_system "$BIN" "$DD" busybox -- --stop-sandboxes
rc=0
"$BIN/snapshot" -endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" -command "bench/snapshot.sh $*" "$@" || rc=$?
if [ $rc != 0 ]; then tail -n 40 "$DD/up.log" >&2; fi
exit $rc
