#!/usr/bin/env bash
# Runs the Python SDK's tests (unit and live) and the CLI and quickstart
# example against a real `opendsec up` started here with a throwaway data dir
# and free loopback ports. Used by `make test`; runs as root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BIN=$ROOT/bin
[ -x "$BIN/opendsec" ] && [ -x "$BIN/opendsec-init" ] || make build

# Base images, built once and cached (deploy/images/build.sh).
bash deploy/images/build.sh --no-import

VENV=${OPENDSEC_TEST_VENV:-/var/cache/opendsec/test/venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check -e "./sdk/python[test]"

. scripts/lib/system.sh
# The gvisor backend too (runsc from scripts/install-deps.sh), for the fork
# example with memory.
RUNSC=${OPENDSEC_RUNSC:-/var/cache/opendsec/gvisor/runsc}
BACKENDS='"container": {}'
if [ "${OPENDSEC_SKIP_RUNSC:-0}" != 1 ]; then
  [ -x "$RUNSC" ] || { echo "no runsc at $RUNSC: run scripts/install-deps.sh (or OPENDSEC_SKIP_RUNSC=1 to leave gvisor out)" >&2; exit 1; }
  BACKENDS+=', "gvisor": {"runsc_path": "'"$RUNSC"'", "agent_path": "'"$BIN"'/opendsec-agent"}'
fi
# And the vm backend (QEMU; under TCG here: no hardware KVM), with the guest
# kernel and initramfs of scripts/build-guest-assets.sh (cached), for the
# fork example with memory on VMs (root/py:3.11's layers are the VM's root);
# its RAM files go to a memory dir of its own, checked empty at the end.
if [ "${OPENDSEC_SKIP_VM:-0}" != 1 ]; then
  command -v qemu-system-x86_64 >/dev/null || { echo "no qemu-system-x86_64: run scripts/install-deps.sh (or OPENDSEC_SKIP_VM=1 to leave the vm backend out)" >&2; exit 1; }
  GUEST=$(scripts/build-guest-assets.sh --cache "${OPENDSEC_GUEST_CACHE:-/var/cache/opendsec/guest}" | tail -n1)
  VMMEM=/dev/shm/odlive-vm-$$
  BACKENDS+=', "vm": {"assets_dir": "'"$GUEST"'", "accel": "tcg", "memory_dir": "'"$VMMEM"'", "boot_timeout_sec": 120}'
fi
export SYSTEM_NODE_EXTRA='"backends": {'"$BACKENDS"'}'
DD=$(mktemp -d /tmp/odlive.XXXXXX)
cleanup() {
  stop_system
  if [ -n "${VMMEM:-}" ] && [ -d "$VMMEM" ] && ! rmdir "$VMMEM"; then
    echo "guest RAM files left in $VMMEM: $(ls "$VMMEM")" >&2
    exit 1
  fi
  if [ "${KEEP:-}" != 1 ]; then rm -rf "$DD"; fi
}
trap cleanup EXIT
start_system "$BIN" "$DD" busybox py -- --stop-sandboxes

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
echo "== fork example"
out=$("$VENV/bin/python" sdk/python/examples/fork.py) || rc=1
echo "$out"
[ "$(echo "$out" | head -n1)" = "42" ] && [ "$(echo "$out" | grep -c '^fork .*: 4[2-5] (memory_preserved=False)$')" = 4 ] ||
  { echo "fork example printed '$out', want 42 then 4 forks printing 42..45" >&2; rc=1; }
if [ "${OPENDSEC_SKIP_RUNSC:-0}" != 1 ]; then
  echo "== fork example on gvisor (forks keep their memory)"
  out=$(OPENDSEC_BACKEND=gvisor "$VENV/bin/python" sdk/python/examples/fork.py) || rc=1
  echo "$out"
  [ "$(echo "$out" | head -n1)" = "42" ] && [ "$(echo "$out" | grep -c '^fork .*: 4[2-5] (memory_preserved=True)$')" = 4 ] ||
    { echo "fork example on gvisor printed '$out', want 42 then 4 forks printing 42..45 with memory_preserved=True" >&2; rc=1; }
fi
if [ "${OPENDSEC_SKIP_VM:-0}" != 1 ]; then
  echo "== fork example on vm (QEMU; forks keep their memory)"
  out=$(OPENDSEC_BACKEND=vm "$VENV/bin/python" sdk/python/examples/fork.py) || rc=1
  echo "$out"
  [ "$(echo "$out" | head -n1)" = "42" ] && [ "$(echo "$out" | grep -c '^fork .*: 4[2-5] (memory_preserved=True)$')" = 4 ] ||
    { echo "fork example on vm printed '$out', want 42 then 4 forks printing 42..45 with memory_preserved=True" >&2; rc=1; }
fi
echo "== cli"
id=$("$BIN/opendsecctl" sandbox create --image root/busybox -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])') || rc=1
if [ -n "${id:-}" ]; then
  got=$("$BIN/opendsecctl" sandbox exec "$id" -- sh -c 'echo $((6*7))') || rc=1
  [ "$got" = "42" ] || { echo "cli exec printed '$got', want 42" >&2; rc=1; }
  "$BIN/opendsecctl" sandbox stop "$id" || rc=1
fi
if [ $rc != 0 ]; then echo "--- opendsec up log (tail)"; tail -n 60 "$DD/up.log"; fi
exit $rc
