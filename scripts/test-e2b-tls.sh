#!/usr/bin/env bash
# Runs test/e2b/python-tls and test/e2b/js-tls: the real E2B Python SDK
# (the venv of scripts/test-e2b.sh) and JS SDK (its npm dir; skipped
# without node or with E2B_SKIP_JS=1) against a throwaway `opendsec up` whose E2B gateway
# serves TLS and HTTP/2 (e2b.tls.enabled: a certificate from OpenDsec's CA)
# on port 443 of a random 127/8 address, with E2B's own endpoint resolution:
# neither E2B_API_URL nor E2B_SANDBOX_URL is set, so the SDK calls
# https://api.opendsec.local and https://49983-<id>.opendsec.local. The CA is
# trusted through SSL_CERT_FILE (Python) and NODE_EXTRA_CA_CERTS (JS)
# (`opendsec e2b ca`); the names resolve through a DNS server the test runs
# (test/e2b/python-tls/conftest.py, test/e2b/js-tls/tls.test.mjs), the
# only nameserver of the test process: it runs in a private mount namespace
# whose /etc/resolv.conf is a bind mount (the machine's is untouched).
# Runs as root (port 443, unshare). Arguments are passed to pytest (and
# then the JS suite is left out).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BIN=${OPENDSEC_BIN_DIR:-$ROOT/bin}
[ -x "$BIN/opendsec" ] && [ -x "$BIN/opendsec-init" ] || make build
VENV=${OPENDSEC_E2B_VENV:-/var/cache/opendsec/test/e2b-venv}
[ -x "$VENV/bin/python" ] || { echo "no E2B SDK venv at $VENV; run scripts/test-e2b.sh once" >&2; exit 1; }
NPM_DIR=${OPENDSEC_E2B_NPM:-/var/cache/opendsec/test/e2b-npm}

. scripts/lib/system.sh
DD=$(mktemp -d /tmp/ode2b.XXXXXX)
cleanup() {
  stop_system
  if [ "${KEEP:-}" != 1 ]; then rm -rf "$DD"; fi
}
trap cleanup EXIT
# A loopback address of its own: port 443 (and the test's DNS on 53) do not
# collide with other systems on this machine.
IP=127.$((RANDOM % 200 + 20)).$((RANDOM % 250 + 1)).$((RANDOM % 250 + 1))
SYSTEM_E2B_LISTEN=$IP:443 SYSTEM_E2B_EXTRA='"tls": {"enabled": true}' \
  start_system "$BIN" "$DD" base -- --stop-sandboxes
CA=$("$BIN/opendsec" e2b ca --config "$DD/opendsec.json" --data-dir "$DD")
KEY=$("$BIN/opendsec" e2b key create --config "$DD/opendsec.json" --data-dir "$DD")
echo "nameserver $IP" >"$DD/resolv.conf"

echo "== e2b python sdk over TLS + HTTP/2 (gateway https://$IP:443, CA $CA)"
rc=0
env -u E2B_DEBUG -u E2B_ACCESS_TOKEN -u E2B_API_URL -u E2B_SANDBOX_URL \
  -u REQUESTS_CA_BUNDLE -u SSL_CERT_DIR -u HTTPS_PROXY -u https_proxy -u ALL_PROXY -u all_proxy \
  E2B_API_KEY="$KEY" E2B_DOMAIN=opendsec.local E2B_TEST_GATEWAY_IP="$IP" SSL_CERT_FILE="$CA" \
  unshare --mount --propagation private -- sh -c 'mount --bind "$0" /etc/resolv.conf && exec "$@"' "$DD/resolv.conf" \
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -c test/e2b/python-tls/pytest.ini test/e2b/python-tls "$@" || rc=$?
if [ "${E2B_SKIP_JS:-}" != 1 ] && [ $# = 0 ] && command -v node >/dev/null; then
  # test-e2b.sh installs into the shared dir under an exclusive lock.
  exec 8>"$NPM_DIR.lock"
  flock -s 8
  [ -f "$NPM_DIR/node_modules/e2b/package.json" ] || { echo "no E2B JS SDK in $NPM_DIR; run scripts/test-e2b.sh once" >&2; exit 1; }
  echo "== e2b npm sdk $(node -p "require('$NPM_DIR/node_modules/e2b/package.json').version") over TLS (NODE_EXTRA_CA_CERTS $CA)"
  env -u E2B_DEBUG -u E2B_ACCESS_TOKEN -u E2B_API_URL -u E2B_SANDBOX_URL \
    -u HTTPS_PROXY -u https_proxy -u ALL_PROXY -u all_proxy -u NODE_TLS_REJECT_UNAUTHORIZED \
    E2B_API_KEY="$KEY" E2B_DOMAIN=opendsec.local E2B_TEST_GATEWAY_IP="$IP" NODE_EXTRA_CA_CERTS="$CA" E2B_NPM_DIR="$NPM_DIR" \
    unshare --mount --propagation private -- sh -c 'mount --bind "$0" /etc/resolv.conf && exec "$@"' "$DD/resolv.conf" \
    node --test test/e2b/js-tls/ || rc=$?
  exec 8>&-
fi
if [ $rc != 0 ]; then echo "--- opendsec up log (tail)"; tail -n 60 "$DD/up.log"; fi
exit $rc
