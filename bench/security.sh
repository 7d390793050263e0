#!/usr/bin/env bash
# Repeats the red-team figures of issue 11 against a throwaway system (free
# loopback ports, temp data dir, its own node network namespace, stopped by
# its PID):
#   - `yes` for 60 s through the Python SDK: the client's peak RSS
#     (bench/security-output.py);
#   - 120k DNS queries for one allowed name: the node's RSS growth;
#   - a fork bomb in each of 4 sandboxes: host tasks against the sandboxes'
#     PID ceiling, and a new sandbox meanwhile;
#   - a disk and inode fill in one sandbox: another sandbox's create.
# Runs as root. PHASES=dns,forkbomb,disk,output picks phases; extra arguments
# go to bench/security (e.g. -queries 20000). The report is printed and
# written to bench/results/<YYYY-MM-DD>-security.md. Exit status 2: a bound
# did not hold.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/security.sh must run as root (namespaces, cgroups, nftables)" >&2; exit 1; }
. scripts/lib/system.sh
BIN=$(mktemp -d /tmp/odbench-secbin.XXXXXX)
DD=$(mktemp -d /tmp/odbench-secdd.XXXXXX)
DNS_PID=
cleanup() {
  stop_system # up runs with --stop-sandboxes: nothing of this run outlives it
  [ -n "$DNS_PID" ] && kill "$DNS_PID" 2>/dev/null || true
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD and $BIN" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT
PHASES=${PHASES:-output,dns,forkbomb,disk}

echo "== build" >&2
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
go build -o "$BIN/" ./bench/security ./cmd/opendsec
CGO_ENABLED=0 go build -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
bash scripts/build-init.sh "$BIN/opendsec-init"
bash deploy/images/build.sh --no-import

# The DNS upstream is this benchmark's own server on the node namespace's
# loopback; the per-sandbox query rate limit is lifted so that every query
# reaches the answer cache (the figure is about that cache).
DNS_PORT=$(free_port)
export SYSTEM_NETWORK_EXTRA='"dns_upstream": ["127.0.0.1:'"$DNS_PORT"'"], "dns_queries_per_second": 1000000, "dns_query_burst": 1000000'
echo "== opendsec up (data dir $DD)" >&2
start_system "$BIN" "$DD" busybox py -- --stop-sandboxes
if [ -n "${SYSTEM_NETNS:-}" ]; then
  ip netns exec "$SYSTEM_NETNS" "$BIN/security" -serve-dns "127.0.0.1:$DNS_PORT" &
else
  "$BIN/security" -serve-dns "127.0.0.1:$DNS_PORT" &
fi
DNS_PID=$!

OUT=bench/results/$(date -u +%Y-%m-%d)-security.md
rc=0
go_phases=$(echo "$PHASES" | tr ',' '\n' | grep -v '^output$' | paste -sd, || true)
if [ -n "$go_phases" ]; then
  echo "== bench ($go_phases)" >&2
  "$BIN/security" -command "bench/security.sh $*" -revision "$VERSION" -out "$OUT" \
    -endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" -netns-dir "$DD/netns" \
    -node-pid "$UP_PID" -phases "$go_phases" "$@" || rc=$?
fi
if echo "$PHASES" | tr ',' '\n' | grep -qx output; then
  if [ -f bench/security-output.py ]; then
    echo "== output (python sdk, yes 60 s)" >&2
    VENV=${OPENDSEC_TEST_VENV:-/var/cache/opendsec/test/venv}
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check -e "./sdk/python"
    out=$(OPENDSEC_ENDPOINT="127.0.0.1:$API" OPENDSEC_TOKEN="$(cat "$DD/bootstrap.token")" \
      "$VENV/bin/python" bench/security-output.py) || rc=2
    printf '\n## `yes` for 60 s through the Python SDK\n\n%s\n' "$out" | tee -a "$OUT"
  else
    echo "bench/security-output.py is missing: no output figure" >&2; rc=1
  fi
fi
exit $rc
