#!/usr/bin/env bash
# Builds OpenDsec and the benchmark, starts a throwaway `opendsec up` (free
# loopback ports, temp data dir), runs bench/sandbox against it, and stops it.
# Runs as root. Extra arguments go to the benchmark (e.g. -creates 100).
# The report is printed and written to bench/results/<YYYY-MM-DD>-core.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
[ "$(id -u)" = 0 ] || { echo "bench/run.sh must run as root (runc, mounts, cgroups)" >&2; exit 1; }

BIN=$(mktemp -d /tmp/odbench-bin.XXXXXX)
DD=$(mktemp -d /tmp/odbench-dd.XXXXXX)
UP_PID=""
cleanup() {
  if [ -n "$UP_PID" ] && kill -0 "$UP_PID" 2>/dev/null; then
    # --stop-sandboxes: nothing of this run may outlive it.
    kill -TERM "$UP_PID"; wait "$UP_PID" || true
  fi
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD and $BIN" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT

echo "== build" >&2
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS="-s -w -X github.com/kernflux/opendsec/internal/version.Version=$VERSION"
go build -ldflags "$LDFLAGS" -o "$BIN/" ./cmd/opendsec ./bench/sandbox
CGO_ENABLED=0 go build -ldflags "$LDFLAGS" -o "$BIN/opendsec-agent" ./cmd/opendsec-agent

# The busybox rootfs, built once and cached (deploy/images/build.sh).
CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
[ -d "$CACHE/busybox" ] || bash deploy/images/build.sh --no-import

port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
API=$(port); NODE=$(port); WATCH=$(port); E2B=$(port)
cat > "$DD/opendsec.json" <<JSON
{
  "version": 1,
  "data_dir": "$DD",
  "log": {"level": "${OPENDSEC_BENCH_LOG_LEVEL:-info}"},
  "apiserver": {"listen": "127.0.0.1:$API", "watcher_address": "http://127.0.0.1:$WATCH", "placement_sample": 2},
  "watcher": {"listen": "127.0.0.1:$WATCH", "poll_interval_ms": 200},
  "node": {"id": "n001", "listen": "127.0.0.1:$NODE", "agent_path": "$BIN/opendsec-agent",
           "image_dir": "$DD/images", "default_backend": "container", "max_sandboxes": 200, "max_upload_mb": 64},
  "nodes": [{"id": "n001", "address": "http://127.0.0.1:$NODE"}],
  "e2b": {"listen": "127.0.0.1:$E2B"}
}
JSON
"$BIN/opendsec" image import-rootfs --config "$DD/opendsec.json" --data-dir "$DD" --name root/busybox --rootfs "$CACHE/busybox" --user root >/dev/null

echo "== opendsec up (data dir $DD)" >&2
"$BIN/opendsec" up --config "$DD/opendsec.json" --data-dir "$DD" --ready-file "$DD/ready" --stop-sandboxes >"$DD/up.log" 2>&1 &
UP_PID=$!
for _ in $(seq 1 600); do
  [ -s "$DD/ready" ] && break
  kill -0 "$UP_PID" 2>/dev/null || { cat "$DD/up.log"; echo "opendsec up exited" >&2; exit 1; }
  sleep 0.1
done
[ -s "$DD/ready" ] || { tail -n 50 "$DD/up.log"; echo "opendsec up did not become ready" >&2; exit 1; }

echo "== bench" >&2
rc=0
"$BIN/sandbox" -endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" -rootfs "$CACHE/busybox" \
  -command "bench/run.sh $*" -revision "$VERSION" "$@" || rc=$?
if [ $rc != 0 ]; then echo "--- opendsec up log (tail)" >&2; tail -n 40 "$DD/up.log" >&2; fi
exit $rc
