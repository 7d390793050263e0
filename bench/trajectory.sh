#!/usr/bin/env bash
# Trajectory log figures of issue 15: exec round trip p50 with the log off,
# on, and on with fsync, side by side in interleaved rounds in one process
# (three nodes over a real opendsec agent running real processes), and the
# replay of a recorded call. Runs as root (the agent starts processes as
# users). Extra arguments go to bench/trajectory (-rounds N, -cmd LINE).
# The report is printed and written to bench/results/<YYYY-MM-DD>-trajectory.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/trajectory.sh must run as root" >&2; exit 1; }
BIN=$(mktemp -d /tmp/odbench-trajbin.XXXXXX)
trap 'rm -rf "$BIN"' EXIT
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
go build -o "$BIN/" ./bench/trajectory
OUT=bench/results/$(date -u +%Y-%m-%d)-trajectory.md
"$BIN/trajectory" -command "bench/trajectory.sh $*" -revision "$VERSION" -out "$OUT" "$@"
