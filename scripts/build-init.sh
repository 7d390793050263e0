#!/usr/bin/env bash
# Builds opendsec-init (cmd/opendsec-init/init.c), the PID 1 of every
# container sandbox, into OUT: a static, stripped C binary. With musl
# (Debian: musl-tools, which scripts/install-deps.sh installs) when there is
# a musl-gcc, else with the system's C compiler and static glibc (gcc and
# libc6-dev): musl's start costs a sandbox ~0.05 ms of CPU against glibc's
# ~0.3 (CPU feature probes and its relocations; bench/results/2026-12-06-init-c.md).
# CC overrides the compiler.
#
# Beside it, in OUT's directory, it builds opendsec-crun-libsystemd.so
# (internal/runtime/container/crunlib): the libsystemd.so.0 without
# systemd the node preloads into crun (docs/operations.md, "OCI runtime:
# crun or runc").
#
# usage: scripts/build-init.sh OUT [SRC_ROOT]
set -euo pipefail
out=${1:?usage: scripts/build-init.sh OUT [SRC_ROOT]}
root=${2:-$(cd "$(dirname "$0")/.." && pwd)}
cc=${CC:-}
if [ -z "$cc" ]; then
  if command -v musl-gcc >/dev/null; then cc=musl-gcc; else cc=cc; fi
fi
if ! command -v "$cc" >/dev/null; then
  echo "build-init: no C compiler ($cc); install musl-tools, or gcc and libc6-dev (apt-get install musl-tools gcc libc6-dev)" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# Static and not position-independent: a static-pie start relocates itself
# (and Debian's musl has no static-pie start file). The text's address is
# fixed; stack, heap and mappings are still randomized, and init holds
# nothing a root process of its sandbox does not have anyway.
"$cc" -std=gnu11 -O2 -Wall -Wextra -Werror -Wno-unused-parameter -Wno-format-truncation \
  -fstack-protector-strong -D_FORTIFY_SOURCE=2 -static -s \
  -o "$tmp" "$root/cmd/opendsec-init/init.c"
mv -f "$tmp" "$out"
# A shared object of its own symbols only (no libc, no start files),
# bound at load and read-only after it.
lib="$(dirname "$out")/opendsec-crun-libsystemd.so"
"$cc" -std=gnu11 -O2 -Wall -Wextra -Werror -shared -fPIC -nostdlib -s \
  -Wl,-soname,libsystemd.so.0 -Wl,--version-script="$root/internal/runtime/container/crunlib/libsystemd.map" \
  -Wl,-z,now -Wl,-z,relro -Wl,-z,noexecstack \
  -o "$tmp" "$root/internal/runtime/container/crunlib/libsystemd.c"
mv -f "$tmp" "$lib"
