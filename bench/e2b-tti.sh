#!/usr/bin/env bash
# Time to interactive as ComputeSDK's benchmark defines it (create + an
# identity probe + `node -v`, 10 iterations, destroy untimed) through
# ComputeSDK's E2B provider (npm computesdk + @computesdk/e2b, pinned in
# scripts/test-e2b-clients.sh) against OpenDsec's E2B gateway, side by side
# (interleaved) with the same loop through OpenDsec's Go client, on one
# throwaway `opendsec up` (bench/e2btti). Runs as root; not part of `make
# test`. Arguments go to bench/e2btti (-n 10). The report is printed and
# written to bench/results/<YYYY-MM-DD>-e2b-tti.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/e2b-tti.sh must run as root" >&2; exit 1; }
NPM_DIR=$(E2B_CLIENTS_INSTALL_ONLY=1 bash scripts/test-e2b-clients.sh)
npmv() { node -p "require('$NPM_DIR/node_modules/$1/package.json').version"; }

. scripts/lib/system.sh
DD=$(mktemp -d /tmp/ode2bbench.XXXXXX)
BIN=$(mktemp -d /tmp/ode2bbench-bin.XXXXXX)
cleanup() {
  stop_system
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT

echo "== build" >&2
go build -o "$BIN/" ./cmd/opendsec ./bench/e2btti
CGO_ENABLED=0 go build -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
bash scripts/build-init.sh "$BIN/opendsec-init"
bash deploy/images/build.sh --no-import >/dev/null

echo "== opendsec up (data dir $DD)" >&2
OPENDSEC_LOG_LEVEL=warn start_system "$BIN" "$DD" base -- --stop-sandboxes
KEY=$("$BIN/opendsec" e2b key create --config "$DD/opendsec.json" --data-dir "$DD")
OUT=bench/results/$(date -u +%F)-e2b-tti.md

echo "== bench" >&2
env -u E2B_DEBUG -u E2B_ACCESS_TOKEN \
  E2B_API_URL="http://127.0.0.1:$E2B" E2B_SANDBOX_URL="http://127.0.0.1:$E2B" E2B_API_KEY="$KEY" \
  E2B_DOMAIN=opendsec.local E2B_NPM_DIR="$NPM_DIR" \
  "$BIN/e2btti" -endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" -out "$OUT" \
  -command "bash bench/e2b-tti.sh${*:+ $*}" \
  -versions "npm computesdk $(npmv computesdk), @computesdk/e2b $(npmv @computesdk/e2b), e2b $(npmv e2b) on Node $(node --version); OpenDsec Go client (sdk/go); OpenDsec $(git describe --always --dirty 2>/dev/null || echo dev)" "$@"
echo "wrote $OUT" >&2
