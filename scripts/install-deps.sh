#!/usr/bin/env bash
# Installs what OpenDsec needs from Debian's packages (and, with --dev, the
# code generators and test tools). Idempotent. Runs as root.
set -euo pipefail
dev=0
[ "${1:-}" = "--dev" ] && dev=1
need=()
# e2fsprogs: every sandbox's writable layer is an ext4 image (mkfs.ext4); xfsprogs:
# XFS state dirs with project quotas (and the tests that make one). crun: the
# container backend's default OCI runtime (oci_runtime auto; a create costs
# about a third of runc's CPU), runc: its fallback (docs/operations.md).
# musl-tools (or gcc and libc6-dev): opendsec-init, every container sandbox's PID 1, is static C
# (scripts/build-init.sh).
for p in runc crun iproute2 nftables debootstrap busybox-static erofs-utils e2fsprogs xfsprogs ca-certificates curl git make gcc libc6-dev musl-tools python3-venv qemu-system-x86 cpio python3; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ $dev = 1 ]; then
  for p in protobuf-compiler libprotobuf-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
  done
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "installing from Debian: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then export PATH=/usr/local/go/bin:$PATH; fi
command -v go >/dev/null 2>&1 || { echo "Go 1.26 is required (https://go.dev/doc/install); install it and re-run" >&2; exit 1; }
if [ $dev = 1 ]; then
  gobin="$(go env GOPATH)/bin"
  [ -x "$gobin/protoc-gen-go" ] || go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.10
  "$gobin/golangci-lint" version 2>/dev/null | grep -q "version 2.15.0 " || go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0
  [ -x "$gobin/protoc-gen-connect-go" ] || go install connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.19.1
  python3 -c 'import grpc_tools' 2>/dev/null || python3 -m pip install -q grpcio-tools==1.76.0
fi
# gVisor's runsc for the gvisor backend, built from the Go module proxy (the
# proxy's pseudo-version of the buildable `go` branch), pinned, and cached per
# machine: later runs, CI included, find it built. OPENDSEC_SKIP_RUNSC=1 skips it.
RUNSC_VERSION=v0.0.0-20260905035102-160fafc42237
runsc_dir=/var/cache/opendsec/gvisor
if [ "${OPENDSEC_SKIP_RUNSC:-0}" != 1 ] && [ "$(cat "$runsc_dir/runsc.version" 2>/dev/null)" != "$RUNSC_VERSION" ]; then
  echo "building runsc $RUNSC_VERSION into $runsc_dir (once per machine, a few minutes)"
  mkdir -p "$runsc_dir"
  GOFLAGS=-mod=mod GOBIN="$runsc_dir" CGO_ENABLED=0 go install "gvisor.dev/gvisor/runsc@$RUNSC_VERSION"
  echo "$RUNSC_VERSION" > "$runsc_dir/runsc.version"
fi
