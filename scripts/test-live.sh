#!/usr/bin/env bash
# Runs the Python SDK's tests (unit and live) and the CLI and quickstart
# example against a real `opendsec up` started here with a throwaway data dir
# and free loopback ports. Used by `make test`; runs as root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BIN=$ROOT/bin
[ -x "$BIN/opendsec" ] || make build

# Base images, built once and cached (deploy/images/build.sh).
bash deploy/images/build.sh --no-import

VENV=${OPENDSEC_TEST_VENV:-/var/cache/opendsec/test/venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check -e "./sdk/python[test]"

DD=$(mktemp -d /tmp/odlive.XXXXXX)
UP_PID=""
cleanup() {
  if [ -n "$UP_PID" ] && kill -0 "$UP_PID" 2>/dev/null; then
    kill -TERM "$UP_PID"; wait "$UP_PID" || true
  fi
  if [ "${KEEP:-}" != 1 ]; then rm -rf "$DD"; fi
}
trap cleanup EXIT

port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
API=$(port); NODE=$(port); WATCH=$(port); E2B=$(port)
cat > "$DD/opendsec.json" <<JSON
{
  "version": 1,
  "data_dir": "$DD",
  "apiserver": {"listen": "127.0.0.1:$API", "watcher_address": "http://127.0.0.1:$WATCH", "placement_sample": 2},
  "watcher": {"listen": "127.0.0.1:$WATCH", "poll_interval_ms": 200},
  "node": {"id": "n001", "listen": "127.0.0.1:$NODE", "agent_path": "$BIN/opendsec-agent",
           "image_dir": "$DD/images", "default_backend": "container", "max_sandboxes": 200, "max_upload_mb": 64},
  "nodes": [{"id": "n001", "address": "http://127.0.0.1:$NODE"}],
  "e2b": {"listen": "127.0.0.1:$E2B"}
}
JSON
CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
"$BIN/opendsec" image import-rootfs --config "$DD/opendsec.json" --data-dir "$DD" --name root/busybox --rootfs "$CACHE/busybox" --user root >/dev/null
"$BIN/opendsec" image import-rootfs --config "$DD/opendsec.json" --data-dir "$DD" --name root/py:3.11 --rootfs "$CACHE/py-3.11" --user root >/dev/null

"$BIN/opendsec" up --config "$DD/opendsec.json" --data-dir "$DD" --ready-file "$DD/ready" >"$DD/up.log" 2>&1 &
UP_PID=$!
for _ in $(seq 1 600); do
  [ -s "$DD/ready" ] && break
  kill -0 "$UP_PID" 2>/dev/null || { cat "$DD/up.log"; echo "opendsec up exited" >&2; exit 1; }
  sleep 0.1
done
[ -s "$DD/ready" ] || { cat "$DD/up.log"; echo "opendsec up did not become ready" >&2; exit 1; }

export OPENDSEC_ENDPOINT="127.0.0.1:$API"
export OPENDSEC_TOKEN="$(cat "$DD/bootstrap.token")"
export OPENDSEC_LIVE=1
export OPENDSEC_BACKEND=container

echo "== python sdk tests (unit + live)"
rc=0
"$VENV/bin/python" -m pytest -q sdk/python/tests || rc=$?
echo "== quickstart example"
out=$("$VENV/bin/python" sdk/python/examples/quickstart.py) || rc=1
echo "$out"
[ "$(echo "$out" | tail -n1)" = "42" ] || { echo "quickstart printed '$out', want 42" >&2; rc=1; }
echo "== cli"
id=$("$BIN/opendsecctl" sandbox create --image root/busybox -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])') || rc=1
if [ -n "${id:-}" ]; then
  got=$("$BIN/opendsecctl" sandbox exec "$id" -- sh -c 'echo $((6*7))') || rc=1
  [ "$got" = "42" ] || { echo "cli exec printed '$got', want 42" >&2; rc=1; }
  "$BIN/opendsecctl" sandbox stop "$id" || rc=1
fi
if [ $rc != 0 ]; then echo "--- opendsec up log (tail)"; tail -n 60 "$DD/up.log"; fi
exit $rc
