#!/usr/bin/env bash
# Fork through the public API: ForkSandbox of count 1 and 8 (wall time and
# the source's frozen time) side by side with making the same number of
# sandboxes from the image (CreateSandbox, BatchCreate 8; cold), interleaved
# in every iteration, on one throwaway `opendsec up` with the container
# backend (bench/forkapi). The backend's own Fork against bare copies of the
# layer is bench/fork.sh. Runs as root; not part of `make test`. Arguments go
# to bench/forkapi (-n 10). The report is printed and written to
# bench/results/<YYYY-MM-DD>-fork-api.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/fork-api.sh must run as root" >&2; exit 1; }
. scripts/lib/system.sh
BIN=$(mktemp -d /tmp/odforkbench-bin.XXXXXX)
DD=$(mktemp -d /tmp/odforkbench.XXXXXX)
cleanup() {
  stop_system
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT
echo "== build" >&2
go build -o "$BIN/" ./cmd/opendsec ./bench/forkapi
CGO_ENABLED=0 go build -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
bash scripts/build-init.sh "$BIN/opendsec-init"
bash deploy/images/build.sh --no-import >/dev/null
start_system "$BIN" "$DD" busybox -- --stop-sandboxes
OUT=bench/results/$(date -u +%F)-fork-api.md
{
  echo "# Fork through the API ($(date -u +%F))"
  echo
  echo "Command: \`bash bench/fork-api.sh $*\`; machine: $(uname -r), $(nproc) cores, data dir on $(df -T "$DD" | awk 'NR==2{print $2}')."
  echo
} > "$OUT"
OPENDSEC_ENDPOINT="127.0.0.1:$API" OPENDSEC_TOKEN="$(cat "$DD/bootstrap.token")" "$BIN/forkapi" -o "$DD/report.md" "$@"
cat "$DD/report.md" >> "$OUT"
echo "written: $OUT" >&2
