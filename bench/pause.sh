#!/usr/bin/env bash
# Task pause figures of issue 12 against a throwaway system (free loopback
# ports, temp data dir, its own node network namespace, stopped by its PID):
#   - PauseSandbox / ResumeSandbox p50 vs a bare cgroup freezer write, side
#     by side in interleaved rounds;
#   - a task of 200 sandboxes, each holding 20 MiB of written anonymous
#     memory, paused with reclaim in one call: node memory before and after,
#     bytes freed as reported vs measured, resume_task, every counter and
#     memory checksum checked; once per run of -runs (default
#     zram/text,zram/random,file/random: zram swap or a swap file on disk,
#     each made here and removed after, only on a host without swap; memhog
#     data log-like text or random).
# Runs as root. Extra arguments go to bench/pause (e.g. -sandboxes 50
# -runs zram/random). The report is printed and written to
# bench/results/<YYYY-MM-DD>-pause.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/pause.sh must run as root (cgroups, swap)" >&2; exit 1; }
. scripts/lib/system.sh
BIN=$(mktemp -d /tmp/odbench-pausebin.XXXXXX)
DD=$(mktemp -d /tmp/odbench-pausedd.XXXXXX)
cleanup() {
  stop_system # up runs with --stop-sandboxes: nothing of this run outlives it
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD and $BIN" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT

echo "== build" >&2
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
go build -o "$BIN/" ./bench/pause ./cmd/opendsec
CGO_ENABLED=0 go build -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
bash scripts/build-init.sh "$BIN/opendsec-init"
CGO_ENABLED=0 go build -trimpath -o "$BIN/memhog" ./internal/testutil/memhog
bash deploy/images/build.sh --no-import

# scripts/lib/system.sh's node takes 200 sandboxes: the latency phase's one
# is stopped before the task's 200 are made.
echo "== opendsec up (data dir $DD)" >&2
start_system "$BIN" "$DD" busybox -- --stop-sandboxes

OUT=bench/results/$(date -u +%Y-%m-%d)-pause.md
"$BIN/pause" -command "bench/pause.sh $*" -revision "$VERSION" -out "$OUT" \
  -endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" -memhog "$BIN/memhog" "$@"
