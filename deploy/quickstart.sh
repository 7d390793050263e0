#!/usr/bin/env bash
# OpenDsec quickstart: checks this machine, installs what is missing from
# Debian's packages, builds, installs the binaries, builds the offline base
# images, starts the system, runs one sandbox as a check and writes
# /root/opendsec-ops/demo.env. Idempotent: running it again upgrades and
# restarts in place (sandboxes keep running across the restart).
#
# Usage: deploy/quickstart.sh [--uninstall] [--skip-images]
#
# OPENDSEC_E2B_TLS=1 serves the E2B gateway over TLS with HTTP/2 (e2b.tls
# in the config, a certificate from OpenDsec's own CA for the domain and
# *.<domain>); demo.env then trusts the CA (docs/E2B.md, "TLS").
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DATA_DIR=/var/lib/opendsec
LIB_DIR=/usr/local/lib/opendsec
LOG_DIR=/var/log/opendsec
RUN_DIR=/run/opendsec
OPS_DIR=/root/opendsec-ops
PID_FILE=$RUN_DIR/opendsec.pid
ENDPOINT=127.0.0.1:7070
E2B_ADDR=127.0.0.1:3000
E2B_DOMAIN=opendsec.local
E2B_TLS=${OPENDSEC_E2B_TLS:-0}
BINS="opendsec opendsec-node opendsec-apiserver opendsec-watcher opendsec-e2b opendsecctl"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() { printf 'quickstart: %s\n' "$*" >&2; exit 1; }

CONFIG=/etc/opendsec/opendsec.json
# The configuration the quickstart writes when there is none: the defaults,
# except that an allowed name never opens a private address (see
# docs/network.md, "Domains").
quickstart_config() {
  cat <<'JSON'
{
  "version": 1,
  "node": {"network": {"refuse_private_dns_answers": true}}
}
JSON
}

systemd_pid1() { [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ]; }

stop_running() {
  if systemd_pid1 && systemctl list-unit-files opendsec.service >/dev/null 2>&1; then
    systemctl stop opendsec.service 2>/dev/null || true
  fi
  if [ -s "$PID_FILE" ]; then
    pid=$(cat "$PID_FILE")
    if kill -0 "$pid" 2>/dev/null && grep -q opendsec "/proc/$pid/cmdline" 2>/dev/null; then
      note "stopping opendsec (pid $pid)"
      kill -TERM "$pid"
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$PID_FILE"
  fi
}

uninstall() {
  say "uninstalling OpenDsec"
  if [ -s "$PID_FILE" ] && [ -f "$OPS_DIR/demo.env" ] && command -v opendsecctl >/dev/null; then
    # Stop every sandbox through the API so nothing is left behind.
    ( . "$OPS_DIR/demo.env"
      for id in $(opendsecctl sandbox list -o json 2>/dev/null | python3 -c 'import json,sys
d=json.load(sys.stdin); d=d if isinstance(d,list) else d.get("sandboxes",[])
print(" ".join(s["id"] for s in d))' 2>/dev/null); do opendsecctl sandbox stop "$id" || true; done ) || true
  fi
  stop_running
  if systemd_pid1; then
    systemctl disable opendsec.service 2>/dev/null || true
    rm -f /etc/systemd/system/opendsec.service
    systemctl daemon-reload 2>/dev/null || true
  fi
  if systemd_pid1 && [ -f /etc/systemd/system/opendsec-zram-swap.service ]; then
    systemctl disable --now opendsec-zram-swap.service 2>/dev/null || true
    rm -f /etc/systemd/system/opendsec-zram-swap.service
    systemctl daemon-reload 2>/dev/null || true
  fi
  # Only the zram swap the quickstart made (never other swap).
  if [ -x "$LIB_DIR/zram-swap.sh" ]; then note "$("$LIB_DIR/zram-swap.sh" down)"; fi
  for b in $BINS; do rm -f "/usr/local/bin/$b"; done
  # Only the configuration the quickstart wrote, never an edited one.
  if [ -f "$CONFIG" ] && [ "$(cat "$CONFIG")" = "$(quickstart_config)" ]; then
    rm -f "$CONFIG"; rmdir /etc/opendsec 2>/dev/null || true
  fi
  # --one-file-system: never descend into a mount (a layer still mounted by
  # another OpenDsec on this machine, e.g. a test system); say what is left.
  rm -rf --one-file-system "$LIB_DIR" "$DATA_DIR" "$LOG_DIR" "$RUN_DIR" /var/cache/opendsec "$OPS_DIR/demo.env" 2>/dev/null || true
  left=$(awk -v a="$DATA_DIR" -v b="$RUN_DIR" '$2 ~ "^"a"/" || $2 ~ "^"b"/" {print $2}' /proc/self/mounts)
  if [ -n "$left" ]; then
    note "still mounted (another OpenDsec on this machine uses them; left alone):"
    printf '      %s\n' $left
  fi
  note "removed binaries, data ($DATA_DIR), logs, caches and $OPS_DIR/demo.env"
  exit 0
}

SKIP_IMAGES=0
for a in "$@"; do
  case "$a" in
    --uninstall) [ "$(id -u)" = 0 ] || die "run as root"; uninstall ;;
    --skip-images) SKIP_IMAGES=1 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $a (see --help)" ;;
  esac
done

say "checking this machine"
[ "$(id -u)" = 0 ] || die "run as root: sandboxes need namespaces, cgroups and mounts"
arch=$(uname -m); note "architecture: $arch"
[ "$arch" = x86_64 ] || die "x86_64 is required (found $arch)"
kver=$(uname -r); note "kernel: $kver"
kmaj=${kver%%.*}; kmin=${kver#*.}; kmin=${kmin%%.*}
if [ "$kmaj" -lt 5 ] || { [ "$kmaj" -eq 5 ] && [ "$kmin" -lt 15 ]; }; then die "kernel >= 5.15 is required (found $kver)"; fi
if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then cg="v2 (unified)";
elif [ -d /sys/fs/cgroup/unified ]; then cg="v1 with an empty v2 hierarchy (hybrid)"; else cg="v1"; fi
note "cgroups: $cg"
for c in memory pids cpu; do
  if [ "$cg" = "v2 (unified)" ]; then grep -qw "$c" /sys/fs/cgroup/cgroup.controllers || die "cgroup v2 controller '$c' is not enabled";
  else [ -d "/sys/fs/cgroup/$c" ] || [ -d "/sys/fs/cgroup/cpu,cpuacct" ] || die "cgroup v1 controller '$c' is not mounted"; fi
done
if [ -c /dev/kvm ]; then note "/dev/kvm: present (whether VMs may use it is probed after the build: PVM or an emulating KVM is not hardware KVM)";
else note "/dev/kvm: absent (VMs would run under TCG; the default backend is container)"; fi
note "init: $(ps -p 1 -o comm= 2>/dev/null || echo unknown)$(systemd_pid1 && echo ' (systemd units will be installed)' || echo ' (not systemd: opendsec up runs in the background with a pid file)')"

say "installing what is missing"
bash "$REPO/scripts/install-deps.sh"
export PATH=/usr/local/go/bin:$PATH
gov=$(go env GOVERSION 2>/dev/null || true); note "go: ${gov:-missing}"
# crun (Debian's package, installed above) is the container backend's default
# OCI runtime where a probe container runs; else runc (docs/operations.md).
note "oci runtimes: $(crun --version 2>/dev/null | head -1 || echo 'crun missing'); $(runc --version 2>/dev/null | head -1 || echo 'runc missing') (container backend: oci_runtime auto picks crun where it works; the node's log and Info say which)"
if [ -x /var/cache/opendsec/gvisor/runsc ]; then note "runsc: $(cat /var/cache/opendsec/gvisor/runsc.version) at /var/cache/opendsec/gvisor/runsc (gvisor backend, systrap platform, no KVM needed)";
else note "runsc: not built (OPENDSEC_SKIP_RUNSC=1?): the gvisor backend is unavailable"; fi

say "building"
make -C "$REPO" build >/dev/null
# VM guest kernel + initramfs (docs/vm-guest.md); cached, so a rerun takes seconds.
if gdir=$(make -s -C "$REPO" guest-assets 2>/dev/null | tail -1) && [ -f "$gdir/manifest.json" ]; then
  note "vm guest assets: $gdir ($(python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); print(m["kernel_package"], m["kernel_package_version"], len(m["modules"]), "modules")' "$gdir/manifest.json"))"
else note "vm guest assets: not built (make guest-assets failed; the vm backend needs them)"; fi
install -d "$LIB_DIR" "$LOG_DIR" "$RUN_DIR" "$OPS_DIR"
for b in $BINS; do install -m 0755 "$REPO/bin/$b" "/usr/local/bin/$b"; done
# The agent and its init are replaced by rename so running sandboxes keep
# their copies.
for b in opendsec-agent opendsec-init opendsec-crun-libsystemd.so; do
  install -m 0755 "$REPO/bin/$b" "$LIB_DIR/$b.new" && mv -f "$LIB_DIR/$b.new" "$LIB_DIR/$b"
done
note "installed $(echo $BINS) to /usr/local/bin, the agent, opendsec-init and crun's libsystemd without systemd to $LIB_DIR"

say "vm accelerator"
# The detector the node uses (cached per boot in /run/opendsec): /dev/kvm
# opens and creates a VM, the vendor module, and a timed real-mode probe.
if accel=$(/usr/local/bin/opendsec accel --data-dir "$DATA_DIR" 2>/dev/null); then
  printf '%s\n' "$accel" | grep -v '^default backend:' | sed 's/^/      /'
  case "$(printf '%s\n' "$accel" | sed -n 's/^accel: *//p')" in
    kvm) note "VMs can use KVM here" ;;
    *) note "VMs would run under TCG (emulated)" ;;
  esac
else
  note "accelerator detection failed (run: opendsec accel); VMs would run under TCG"
fi

# --- firecracker (microvm backend) --------------------------------------
# Only where the detector above says hardware KVM. The release is pinned by
# version and sha256; with no checksum pinned, or no way to download it,
# nothing is installed and this says so.
FIRECRACKER_VERSION=v1.16.1
FIRECRACKER_SHA256="${OPENDSEC_FIRECRACKER_SHA256:-}" # sha256 of firecracker-$FIRECRACKER_VERSION-x86_64.tgz
say "firecracker (microvm backend)"
if [ "$(printf '%s\n' "${accel:-}" | sed -n 's/^kind: *//p')" != hardware ]; then
  note "not installed: no hardware KVM here, so the microvm backend is not offered"
elif [ -x /usr/local/bin/firecracker ] && [ -x /usr/local/bin/jailer ]; then
  note "present: $(/usr/local/bin/firecracker --version 2>/dev/null | head -1)"
elif [ -z "$FIRECRACKER_SHA256" ]; then
  note "not installed: no sha256 pinned for Firecracker $FIRECRACKER_VERSION (set OPENDSEC_FIRECRACKER_SHA256); an unchecked binary is never installed"
else
  fc_url="https://github.com/firecracker-microvm/firecracker/releases/download/$FIRECRACKER_VERSION/firecracker-$FIRECRACKER_VERSION-x86_64.tgz"
  fc_tmp=$(mktemp -d)
  if curl -fsSL --max-time 120 -o "$fc_tmp/fc.tgz" "$fc_url" 2>/dev/null; then
    if echo "$FIRECRACKER_SHA256  $fc_tmp/fc.tgz" | sha256sum -c --quiet - >/dev/null 2>&1; then
      tar -xzf "$fc_tmp/fc.tgz" -C "$fc_tmp"
      install -m 0755 "$fc_tmp/release-$FIRECRACKER_VERSION-x86_64/firecracker-$FIRECRACKER_VERSION-x86_64" /usr/local/bin/firecracker
      install -m 0755 "$fc_tmp/release-$FIRECRACKER_VERSION-x86_64/jailer-$FIRECRACKER_VERSION-x86_64" /usr/local/bin/jailer
      note "installed Firecracker $FIRECRACKER_VERSION (sha256 checked) to /usr/local/bin"
    else
      note "not installed: the download's sha256 is not the pinned $FIRECRACKER_SHA256"
    fi
  else
    note "not installed: cannot download $fc_url from this machine"
  fi
  rm -rf "$fc_tmp"
fi
# --- end firecracker ----------------------------------------------------

say "swap for task pause with reclaim"
# A paused task's memory goes to swap (pause_task(reclaim=True)); without
# swap only page cache can go. Existing swap is left as it is.
install -m 0755 "$REPO/deploy/zram-swap.sh" "$LIB_DIR/zram-swap.sh"
if [ "$(awk '/^SwapTotal:/ {print $2}' /proc/meminfo)" -gt 0 ] && ! systemctl is-enabled opendsec-zram-swap.service >/dev/null 2>&1; then
  note "$("$LIB_DIR/zram-swap.sh" up)"
elif systemd_pid1; then
  install -m 0644 "$REPO/deploy/systemd/opendsec-zram-swap.service" /etc/systemd/system/opendsec-zram-swap.service
  systemctl daemon-reload
  systemctl enable --now opendsec-zram-swap.service
  note "$("$LIB_DIR/zram-swap.sh" status | head -n1) (opendsec-zram-swap.service makes it at boot; undo: docs/operations.md)"
else
  note "$("$LIB_DIR/zram-swap.sh" up) (not kept across a reboot: run the quickstart again; undo: $LIB_DIR/zram-swap.sh down)"
fi

if [ $SKIP_IMAGES = 0 ]; then
  say "building the offline base images (cached after the first run)"
  bash "$REPO/deploy/images/build.sh" --data-dir "$DATA_DIR" --opendsec /usr/local/bin/opendsec
fi

if [ ! -e "$CONFIG" ]; then
  install -d /etc/opendsec
  quickstart_config > "$CONFIG"
  note "wrote $CONFIG: domain rules never resolve to private addresses (node.network.refuse_private_dns_answers)"
elif ! grep -q '"refuse_private_dns_answers"' "$CONFIG"; then
  note "$CONFIG (yours, left alone) does not set node.network.refuse_private_dns_answers: an allowed name may open a private address (docs/network.md)"
fi
if [ "$E2B_TLS" = 1 ]; then
  # Opted in: e2b.tls.enabled in the config, the rest of it kept.
  python3 - "$CONFIG" <<'PY'
import json, os, sys
p = sys.argv[1]
c = json.load(open(p))
tls = c.setdefault("e2b", {}).setdefault("tls", {})
if not tls.get("enabled"):
    tls["enabled"] = True
    tmp = p + ".tmp"
    with open(tmp, "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    os.replace(tmp, p)
    print(f"    {p}: set e2b.tls.enabled (OPENDSEC_E2B_TLS=1)")
PY
fi

say "default backend"
# node.default_backend "auto" (the default) is microvm where that backend
# can run (hardware KVM, Firecracker installed), else container; the node
# makes the same choice at start and reports it in its Info.
DEFAULT_BACKEND=container
if db=$(/usr/local/bin/opendsec accel --data-dir "$DATA_DIR" 2>/dev/null | grep '^default backend:'); then
  note "$db"
  DEFAULT_BACKEND=$(printf '%s\n' "$db" | sed -n 's/^default backend: \([a-z0-9]*\) .*/\1/p')
else
  note "default backend: unknown (run: opendsec accel)"
fi

say "starting OpenDsec"
stop_running
for p in 7070 7071 7072 ${E2B_ADDR##*:}; do
  if ss -Hltn "sport = :$p" 2>/dev/null | grep -q .; then
    who=$(ss -Hltnp "sport = :$p" 2>/dev/null | sed -n 's/.*users:((\(.*\)))/\1/p' | head -n1)
    die "port $p is already in use (${who:-unknown process}); stop it or set other ports in /etc/opendsec/opendsec.json"
  fi
done
rm -f "$RUN_DIR/ready"
if systemd_pid1; then
  install -m 0644 "$REPO/deploy/systemd/opendsec.service" /etc/systemd/system/opendsec.service
  systemctl daemon-reload
  systemctl enable --now opendsec.service
  note "systemd unit opendsec.service enabled and started"
else
  nohup /usr/local/bin/opendsec up --data-dir "$DATA_DIR" --pid-file "$PID_FILE" --ready-file "$RUN_DIR/ready" \
    >>"$LOG_DIR/opendsec.log" 2>&1 </dev/null &
  note "opendsec up started in the background (pid $!), log $LOG_DIR/opendsec.log"
fi
for _ in $(seq 1 300); do [ -s "$RUN_DIR/ready" ] && break; sleep 0.1; done
[ -s "$RUN_DIR/ready" ] || { tail -n 30 "$LOG_DIR/opendsec.log" >&2 || true; die "OpenDsec did not come up; see $LOG_DIR/opendsec.log"; }

TOKEN=$(cat "$DATA_DIR/bootstrap.token")
E2B_SCHEME=http
E2B_CURL=()
if grep -q '"tls"' "$CONFIG" && python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get("e2b",{}).get("tls",{}).get("enabled") else 1)' "$CONFIG"; then
  E2B_SCHEME=https
  E2B_CA=$(/usr/local/bin/opendsec e2b ca --data-dir "$DATA_DIR")
  # Python's SSL_CERT_FILE replaces the system's CAs: a bundle of both.
  cat /etc/ssl/certs/ca-certificates.crt "$E2B_CA" > "$OPS_DIR/e2b-ca-bundle.pem" 2>/dev/null || cp "$E2B_CA" "$OPS_DIR/e2b-ca-bundle.pem"
  E2B_CURL=(--cacert "$E2B_CA")
  note "E2B gateway serves TLS + HTTP/2; its CA: $E2B_CA"
fi
# One E2B API key per install: reuse the one demo.env has while the gateway
# still knows it (keys live in the data dir), else create one.
E2B_KEY=""
if [ -f "$OPS_DIR/demo.env" ]; then
  E2B_KEY=$(sed -n 's/^export E2B_API_KEY=//p' "$OPS_DIR/demo.env")
  if [ -n "$E2B_KEY" ] && [ "$(curl -s "${E2B_CURL[@]}" -o /dev/null -w '%{http_code}' -H "X-API-KEY: $E2B_KEY" "$E2B_SCHEME://$E2B_ADDR/sandboxes")" != 200 ]; then
    E2B_KEY=""
  fi
fi
[ -n "$E2B_KEY" ] || E2B_KEY=$(/usr/local/bin/opendsec e2b key create --data-dir "$DATA_DIR")
cat > "$OPS_DIR/demo.env" <<ENV
# Written by deploy/quickstart.sh. Use: . $OPS_DIR/demo.env
export OPENDSEC_ENDPOINT=$ENDPOINT
export OPENDSEC_TOKEN=$TOKEN
export OPENDSEC_BACKEND=container
# E2B's SDKs run unchanged against OpenDsec's gateway with these:
export E2B_API_URL=$E2B_SCHEME://$E2B_ADDR
export E2B_SANDBOX_URL=$E2B_SCHEME://$E2B_ADDR
export E2B_API_KEY=$E2B_KEY
export E2B_DOMAIN=$E2B_DOMAIN
ENV
if [ "$E2B_SCHEME" = https ]; then
  cat >> "$OPS_DIR/demo.env" <<ENV
# The gateway's certificate is from OpenDsec's CA (opendsec e2b ca):
export SSL_CERT_FILE=$OPS_DIR/e2b-ca-bundle.pem
export REQUESTS_CA_BUNDLE=$OPS_DIR/e2b-ca-bundle.pem
export NODE_EXTRA_CA_CERTS=$E2B_CA
ENV
fi
chmod 600 "$OPS_DIR/demo.env"
note "wrote $OPS_DIR/demo.env"

say "checking: one sandbox"
export OPENDSEC_ENDPOINT=$ENDPOINT OPENDSEC_TOKEN=$TOKEN
img=root/busybox; [ $SKIP_IMAGES = 0 ] && img=root/py:3.11
id=$(opendsecctl sandbox create --image "$img" -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
if [ "$img" = root/py:3.11 ]; then out=$(opendsecctl sandbox exec "$id" -- python3 -c 'print(6*7)');
else out=$(opendsecctl sandbox exec "$id" -- sh -c 'echo $((6*7))'); fi
opendsecctl sandbox stop "$id" >/dev/null
[ "$out" = 42 ] || die "check sandbox printed '$out', want 42"
note "sandbox $id ($img) printed $out and was stopped"

say "OpenDsec is running"
cat <<TXT
    endpoint: $ENDPOINT   E2B gateway: $E2B_SCHEME://$E2B_ADDR   default backend: ${DEFAULT_BACKEND:-container}
    data: $DATA_DIR   log: $LOG_DIR/opendsec.log
    Try it:
      python3 -m venv .venv && .venv/bin/pip install ./sdk/python
      . $OPS_DIR/demo.env
      .venv/bin/python sdk/python/examples/quickstart.py
TXT
