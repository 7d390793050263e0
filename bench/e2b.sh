#!/usr/bin/env bash
# E2B benchmark: Sandbox.create + commands.run("echo hi") + kill through the
# E2B JS SDK (npm e2b, pinned as in scripts/test-e2b.sh) against OpenDsec's
# E2B gateway, side by side (interleaved) with the same through OpenDsec's
# own Python SDK (sdk/python), on one throwaway `opendsec up`. Runs as root;
# not part of `make test`. Arguments go to bench/e2b/driver.py (-n 30,
# -warmup 3). The report is printed and written to
# bench/results/<YYYY-MM-DD>-e2b.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/e2b.sh must run as root" >&2; exit 1; }
E2B_JS_VERSION=$(sed -n 's/^E2B_JS_VERSION=//p' scripts/test-e2b.sh)
NPM_DIR=${OPENDSEC_E2B_NPM:-/var/cache/opendsec/test/e2b-npm}
VENV=${OPENDSEC_TEST_VENV:-/var/cache/opendsec/test/venv}

. scripts/lib/system.sh
BIN=${OPENDSEC_BIN_DIR:-}
DD=$(mktemp -d /tmp/ode2bbench.XXXXXX)
TMPBIN=""
cleanup() {
  stop_system
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD" >&2; else rm -rf "$DD" $TMPBIN; fi
}
trap cleanup EXIT

if [ -z "$BIN" ]; then
  echo "== build" >&2
  TMPBIN=$(mktemp -d /tmp/ode2bbench-bin.XXXXXX); BIN=$TMPBIN
  go build -o "$BIN/" ./cmd/opendsec
  CGO_ENABLED=0 go build -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
  bash scripts/build-init.sh "$BIN/opendsec-init"
fi
bash deploy/images/build.sh --no-import >/dev/null
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
"$VENV/bin/python" -c 'import opendsec' 2>/dev/null || "$VENV/bin/pip" install -q --disable-pip-version-check -e ./sdk/python
if [ "$(node -p "try{require('$NPM_DIR/node_modules/e2b/package.json').version}catch(e){''}")" != "$E2B_JS_VERSION" ]; then
  mkdir -p "$NPM_DIR"; [ -f "$NPM_DIR/package.json" ] || echo '{"private":true}' > "$NPM_DIR/package.json"
  (cd "$NPM_DIR" && npm install --no-audit --no-fund --silent "e2b@$E2B_JS_VERSION")
fi

echo "== opendsec up (data dir $DD)" >&2
OPENDSEC_LOG_LEVEL=warn start_system "$BIN" "$DD" base -- --stop-sandboxes
KEY=$("$BIN/opendsec" e2b key create --config "$DD/opendsec.json" --data-dir "$DD")
OUT=bench/results/$(date -u +%F)-e2b.md
SDKPY=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("opendsec"))' 2>/dev/null || echo '?')

echo "== bench" >&2
env -u E2B_DEBUG -u E2B_ACCESS_TOKEN \
  OPENDSEC_ENDPOINT="127.0.0.1:$API" OPENDSEC_TOKEN="$(cat "$DD/bootstrap.token")" \
  E2B_API_URL="http://127.0.0.1:$E2B" E2B_SANDBOX_URL="http://127.0.0.1:$E2B" E2B_API_KEY="$KEY" \
  E2B_DOMAIN=opendsec.local E2B_NPM_DIR="$NPM_DIR" \
  "$VENV/bin/python" bench/e2b/driver.py -out "$OUT" -command "bash bench/e2b.sh $*" \
  -versions "npm e2b $E2B_JS_VERSION on Node $(node --version); opendsec Python SDK $SDKPY (grpc.aio); OpenDsec $(git describe --always --dirty 2>/dev/null || echo dev)" "$@"
echo "wrote $OUT" >&2
