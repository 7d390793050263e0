#!/usr/bin/env bash
# Runs the E2B compatibility acceptance suite (test/e2b) with the real E2B
# SDKs, pinned below: Python from PyPI (e2b and e2b-code-interpreter, sync and
# async) and JS from npm (e2b and @e2b/code-interpreter)
# (skipped without node, or with E2B_SKIP_JS=1), against a throwaway `opendsec up`
# (which serves the E2B gateway) started here with its own data dir and free
# loopback ports. Only E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and
# E2B_DOMAIN are set for the SDK. Used by `make test`; runs as root.
#
# Environment: OPENDSEC_BIN_DIR (default ./bin), OPENDSEC_E2B_VENV (default
# /var/cache/opendsec/test/e2b-venv), OPENDSEC_E2B_NPM (default
# /var/cache/opendsec/test/e2b-npm), E2B_JS_TESTS (the JS test files to run,
# default all of test/e2b/js/), KEEP=1 keeps the data dir, and any
# arguments are passed to pytest (e.g. -k files). Without arguments it then
# runs scripts/test-e2b-tls.sh (the Python and JS SDKs over TLS;
# E2B_SKIP_TLS=1 skips it) and scripts/test-e2b-clients.sh (third-party
# clients: Mastra's E2B workspace, ComputeSDK's TTI loop; E2B_SKIP_CLIENTS=1
# skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BIN=${OPENDSEC_BIN_DIR:-$ROOT/bin}
[ -x "$BIN/opendsec" ] && [ -x "$BIN/opendsec-init" ] || make build

# Pinned SDK and test tools. Bump deliberately and re-run the suite.
E2B_PY_VERSION=2.63.0
E2B_CI_PY_VERSION=2.11.5 # e2b-code-interpreter
E2B_JS_VERSION=2.51.0
E2B_CI_JS_VERSION=2.8.0 # @e2b/code-interpreter
E2B_CLI_VERSION=2.19.0   # @e2b/cli (template list, sandbox logs)
NPM_DIR=${OPENDSEC_E2B_NPM:-/var/cache/opendsec/test/e2b-npm}
SMOLAGENTS_VERSION=1.26.0
PY_PINS=("e2b==$E2B_PY_VERSION" "e2b-code-interpreter==$E2B_CI_PY_VERSION" "smolagents==$SMOLAGENTS_VERSION" "httpx==0.28.1" "pytest==8.3.4" "pytest-asyncio==0.24.0")

bash deploy/images/build.sh --no-import

VENV=${OPENDSEC_E2B_VENV:-/var/cache/opendsec/test/e2b-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('e2b') != '$E2B_PY_VERSION' or m.version('e2b-code-interpreter') != '$E2B_CI_PY_VERSION' or m.version('smolagents') != '$SMOLAGENTS_VERSION')" 2>/dev/null; then
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PY_PINS[@]}"
fi

. scripts/lib/system.sh
DD=$(mktemp -d /tmp/ode2b.XXXXXX)
cleanup() {
  stop_system
  if [ "${KEEP:-}" != 1 ]; then rm -rf "$DD"; fi
}
trap cleanup EXIT
# base and code-interpreter back the templates base and code-interpreter-v1
# (the SDKs' defaults); py (no pip) and busybox (no python) for the tests of
# images without them.
start_system "$BIN" "$DD" busybox py base code-interpreter -- --stop-sandboxes

KEY=$("$BIN/opendsec" e2b key create --config "$DD/opendsec.json" --data-dir "$DD")
# A key of another principal, for the isolation tests (not an SDK variable).
OTHER_KEY=$("$BIN/opendsec" e2b key create --principal other --config "$DD/opendsec.json" --data-dir "$DD")

echo "== e2b python sdk $E2B_PY_VERSION (sync + async)"
rc=0
env -u E2B_DEBUG -u E2B_ACCESS_TOKEN \
  E2B_API_URL="http://127.0.0.1:$E2B" E2B_SANDBOX_URL="http://127.0.0.1:$E2B" \
  E2B_API_KEY="$KEY" E2B_DOMAIN=opendsec.local E2B_TEST_OTHER_KEY="$OTHER_KEY" \
  E2B_TEST_OPENDSEC_API="http://127.0.0.1:$API" E2B_TEST_OPENDSEC_TOKEN="$(cat "$DD/bootstrap.token")" \
  "$VENV/bin/python" -m pytest -q -c test/e2b/python/pytest.ini test/e2b/python "$@" || rc=$?
if [ "${E2B_SKIP_JS:-}" != 1 ] && command -v node >/dev/null; then
  echo "== e2b npm sdk $E2B_JS_VERSION, @e2b/code-interpreter $E2B_CI_JS_VERSION"
  npmv() { node -p "try{require('$NPM_DIR/node_modules/$1/package.json').version}catch(e){''}"; }
  mkdir -p "$NPM_DIR"
  # One install at a time, and none while a run (other trees' too, and
  # test-e2b-tls.sh) reads the shared dir: exclusive to install, shared to
  # run.
  exec 8>"$NPM_DIR.lock"
  flock 8
  if [ "$(npmv e2b)" != "$E2B_JS_VERSION" ] || [ "$(npmv @e2b/code-interpreter)" != "$E2B_CI_JS_VERSION" ] || [ "$(npmv @e2b/cli)" != "$E2B_CLI_VERSION" ]; then
    [ -f "$NPM_DIR/package.json" ] || echo '{"private":true}' > "$NPM_DIR/package.json"
    (cd "$NPM_DIR" && npm install --no-audit --no-fund --silent "e2b@$E2B_JS_VERSION" "@e2b/code-interpreter@$E2B_CI_JS_VERSION" "@e2b/cli@$E2B_CLI_VERSION")
  fi
  flock -s 8
  env -u E2B_DEBUG -u E2B_ACCESS_TOKEN \
    E2B_API_URL="http://127.0.0.1:$E2B" E2B_SANDBOX_URL="http://127.0.0.1:$E2B" \
    E2B_API_KEY="$KEY" E2B_DOMAIN=opendsec.local E2B_NPM_DIR="$NPM_DIR" E2B_TEST_OTHER_KEY="$OTHER_KEY" \
    node --test ${E2B_JS_TESTS:-test/e2b/js/} || rc=$?
  exec 8>&-
fi
if [ $rc != 0 ]; then echo "--- opendsec up log (tail)"; tail -n 60 "$DD/up.log"; fi
# TLS and HTTP/2 with the SDKs' own https://<port>-<id>.<domain> hosts, on a
# system of its own (~15 s); E2B_SKIP_TLS=1 skips it.
if [ "${E2B_SKIP_TLS:-}" != 1 ] && [ $# = 0 ]; then
  bash scripts/test-e2b-tls.sh || rc=$?
fi
# Third-party software built on E2B's JS SDK, pinned there, on a system of
# its own whose template builds reach a Debian archive the script serves
# (~25 s; the first run also installs the clients and fetches the archive's
# indexes and packages once, ~40 s); E2B_SKIP_CLIENTS=1 skips it.
if [ "${E2B_SKIP_CLIENTS:-}" != 1 ] && [ "${E2B_SKIP_JS:-}" != 1 ] && [ $# = 0 ] && command -v node >/dev/null; then
  bash scripts/test-e2b-clients.sh || rc=$?
fi
exit $rc
