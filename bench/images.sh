#!/usr/bin/env bash
# Images benchmark (issue 3): N sandboxes of one image with a large layer
# through our store vs extracting the layer tarball per sandbox, side by
# side; plus time to the first sandbox from a freshly imported image.
# Builds OpenDsec and bench/images, starts a throwaway `opendsec up` (free
# loopback ports, temp data dir), runs the benchmark against it and stops
# it. Runs as root. Extra arguments go to the benchmark program (e.g.
# -rounds 1 -big-mib 256; `go run ./bench/images -h` lists them). The report
# is printed and written to bench/results/<YYYY-MM-DD>-images.md.
# Not part of `make test`: it writes tens of GiB to the disk.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/images.sh must run as root (runc, mounts, cgroups)" >&2; exit 1; }

. scripts/lib/system.sh
BIN=$(mktemp -d /tmp/odbench-images-bin.XXXXXX)
DD=$(mktemp -d /tmp/odbench-images-dd.XXXXXX)
cleanup() {
  stop_system # up runs with --stop-sandboxes: nothing of this run outlives it
  # The node's mount dir of this store (internal/image: sha256 of the store
  # path), empty once its layers are unmounted.
  local mnt=/run/opendsec/image-mounts/$(printf %s "$DD/images" | sha256sum | cut -c1-12)
  if [ -d "$mnt" ] && ! grep -q " $mnt/" /proc/self/mountinfo; then rm -rf "$mnt"; fi
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD and $BIN" >&2; else rm -rf "$DD" "$BIN"; fi
}
trap cleanup EXIT

echo "== build" >&2
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS="-s -w -X github.com/kernflux/opendsec/internal/version.Version=$VERSION"
go build -ldflags "$LDFLAGS" -o "$BIN/" ./cmd/opendsec ./bench/images
CGO_ENABLED=0 go build -ldflags "$LDFLAGS" -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
bash scripts/build-init.sh "$BIN/opendsec-init"

# The busybox rootfs, the base layer of the benchmark's images.
CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
[ -d "$CACHE/busybox" ] || bash deploy/images/build.sh --no-import

echo "== opendsec up (data dir $DD)" >&2
OPENDSEC_LOG_LEVEL=${OPENDSEC_BENCH_LOG_LEVEL:-info} start_system "$BIN" "$DD" -- --stop-sandboxes

echo "== bench" >&2
rc=0
# The layouts are imported through the API, which reads archives only from
# the node's import dir (node.import_dir, <data dir>/import by default).
"$BIN/images" -endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" -data-dir "$DD" -work "$DD/import" \
  -busybox "$CACHE/busybox" -command "bench/images.sh $*" -revision "$VERSION" "$@" || rc=$?
if [ $rc != 0 ]; then echo "--- opendsec up log (tail)" >&2; tail -n 40 "$DD/up.log" >&2; fi
exit $rc
