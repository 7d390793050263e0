#!/usr/bin/env bash
# Runs test/e2b/clients: third-party software built on E2B's JS SDK, from
# npm at the versions pinned below, used as a new user would, with only
# E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_DOMAIN set:
#   - Mastra's E2B workspace (@mastra/e2b's E2BSandbox in @mastra/core's
#     Workspace) with its defaults: it looks up its template
#     (`mastra-<hash>`), builds it from `base` with `apt-get install s3fs
#     fuse` when it is missing, and starts its sandbox from it;
#   - ComputeSDK's E2B provider (computesdk + @computesdk/e2b): its
#     benchmark's time-to-interactive loop, create + `node -v`, 10 times.
# On a throwaway `opendsec up` whose template builds reach a Debian archive
# (node.build.rule_sets: a rule set allowing deb.debian.org:80), as an
# operator's would: here deb.debian.org is a server of this script's
# (test/e2b/clients/fakenet.py) in a network namespace of its own next to
# the system's, answering the node's DNS upstream, and serving a tiny copy
# of bookworm (test/e2b/clients/debmirror.sh, made once with apt-get and
# cached). No traffic leaves the machine. Runs as root; arguments are
# passed to `node --test` (e.g. --test-name-pattern=Mastra).
# E2B_CLIENTS_INSTALL_ONLY=1 installs the pinned clients, prints their npm
# dir and exits (bench/e2b-tti.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BIN=${OPENDSEC_BIN_DIR:-$ROOT/bin}
[ -x "$BIN/opendsec" ] && [ -x "$BIN/opendsec-init" ] || make build
command -v node >/dev/null || { echo "test-e2b-clients: node is not installed" >&2; exit 1; }

# Pinned clients. Bump deliberately and re-run. e2b is test-e2b.sh's.
E2B_JS_VERSION=$(sed -n 's/^E2B_JS_VERSION=\([0-9.]*\).*/\1/p' scripts/test-e2b.sh)
MASTRA_E2B_VERSION=0.8.0
MASTRA_CORE_VERSION=1.71.0
COMPUTESDK_VERSION=4.1.4
COMPUTESDK_E2B_VERSION=1.7.52
NPM_DIR=${OPENDSEC_E2B_CLIENTS_NPM:-/var/cache/opendsec/test/e2b-npm-clients}
PINS=("e2b@$E2B_JS_VERSION" "@mastra/e2b@$MASTRA_E2B_VERSION" "@mastra/core@$MASTRA_CORE_VERSION"
  "computesdk@$COMPUTESDK_VERSION" "@computesdk/e2b@$COMPUTESDK_E2B_VERSION")
npmv() { node -p "try{require('$NPM_DIR/node_modules/$1/package.json').version}catch(e){''}"; }
want=""
for p in "${PINS[@]}"; do want+="${p##*@} "; done
mkdir -p "$NPM_DIR"
exec 9>"$NPM_DIR.lock" # one install at a time (other trees' runs share the dir)
flock 9
have=""
for p in "${PINS[@]}"; do have+="$(npmv "${p%@*}") "; done
if [ "$have" != "$want" ]; then
  [ -f "$NPM_DIR/package.json" ] || echo '{"private":true}' >"$NPM_DIR/package.json"
  (cd "$NPM_DIR" && npm install --no-audit --no-fund --silent --save-exact --engine-strict=false "${PINS[@]}")
  # Every client shares the pinned e2b (no second copy under a client).
  [ -z "$(cd "$NPM_DIR" && find node_modules -mindepth 2 -path '*/node_modules/e2b/package.json')" ] ||
    { echo "test-e2b-clients: a client brought its own e2b; pin one both accept" >&2; exit 1; }
fi
exec 9>&-

# bench/e2b-tti.sh only wants the clients installed.
[ "${E2B_CLIENTS_INSTALL_ONLY:-}" != 1 ] || { echo "$NPM_DIR"; exit 0; }

# The Debian packages Mastra's default template installs, over root/base.
bash deploy/images/build.sh --no-import >/dev/null
CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}
MIRROR=$CACHE/test/debmirror-base$(sed "s/.*=//" "$CACHE/rootfs/base.stamp")-s3fs-fuse
bash test/e2b/clients/debmirror.sh "$MIRROR" s3fs fuse

. scripts/lib/system.sh
unset OPENDSEC_HOST_NETWORK # the "internet" below sits next to the system's own namespace
DD=$(mktemp -d /tmp/ode2b.XXXXXX)
INET_NS=odinet$$
INET_PID=""
cleanup() {
  [ -z "$INET_PID" ] || { kill "$INET_PID" 2>/dev/null; wait "$INET_PID" 2>/dev/null || true; }
  stop_system
  ip netns delete "$INET_NS" 2>/dev/null || true
  if [ "${KEEP:-}" != 1 ]; then rm -rf "$DD"; fi
}
trap cleanup EXIT
INET_IP=198.18.0.2 # a public-looking address (benchmarking range)
SYSTEM_NETWORK_EXTRA='"dns_upstream": ["'$INET_IP':53"], "rule_sets": {"debian": [{"domain": "deb.debian.org", "protocol": "tcp", "ports": "80"}]}' \
SYSTEM_NODE_EXTRA='"build": {"rule_sets": ["debian"]}' \
  start_system "$BIN" "$DD" base -- --stop-sandboxes
ip netns add "$INET_NS"
ip link add uplink netns "$SYSTEM_NETNS" type veth peer name peer netns "$INET_NS"
ip -n "$SYSTEM_NETNS" addr add 198.18.0.1/24 dev uplink
ip -n "$SYSTEM_NETNS" link set uplink up
ip -n "$INET_NS" link set lo up
ip -n "$INET_NS" addr add "$INET_IP/24" dev peer
ip -n "$INET_NS" link set peer up
ip -n "$INET_NS" route add default via 198.18.0.1
mkfifo "$DD/inet.ready"
ip netns exec "$INET_NS" python3 test/e2b/clients/fakenet.py "$INET_IP" "$MIRROR/mirror" "$DD/mirror.log" deb.debian.org \
  >"$DD/inet.ready" 2>"$DD/inet.err" &
INET_PID=$!
read -r _ <"$DD/inet.ready" || { cat "$DD/inet.err" >&2; exit 1; }

KEY=$("$BIN/opendsec" e2b key create --config "$DD/opendsec.json" --data-dir "$DD")
echo "== third-party clients: @mastra/e2b $MASTRA_E2B_VERSION (@mastra/core $MASTRA_CORE_VERSION), computesdk $COMPUTESDK_VERSION + @computesdk/e2b $COMPUTESDK_E2B_VERSION, e2b $E2B_JS_VERSION"
rc=0
env -u E2B_DEBUG -u E2B_ACCESS_TOKEN \
  E2B_API_URL="http://127.0.0.1:$E2B" E2B_SANDBOX_URL="http://127.0.0.1:$E2B" \
  E2B_API_KEY="$KEY" E2B_DOMAIN=opendsec.local \
  E2B_NPM_DIR="$NPM_DIR" E2B_TEST_MIRROR_LOG="$DD/mirror.log" MASTRA_TELEMETRY_DISABLED=1 \
  node --test "$@" test/e2b/clients/ || rc=$?
if [ $rc != 0 ]; then
  echo "--- opendsec up log (tail)"; tail -n 60 "$DD/up.log"
  echo "--- mirror requests (tail)"; tail -n 20 "$DD/mirror.log" 2>/dev/null || true
fi
exit $rc
