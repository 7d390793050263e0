#!/usr/bin/env bash
# Builds opendsec-init (cmd/opendsec-init/init.c), the PID 1 of every
# container sandbox, into OUT: a static, position-independent, stripped C
# binary. Needs a C compiler and the static C library (Debian: gcc and
# libc6-dev; scripts/install-deps.sh installs them). CC overrides the
# compiler.
#
# usage: scripts/build-init.sh OUT [SRC_ROOT]
set -euo pipefail
out=${1:?usage: scripts/build-init.sh OUT [SRC_ROOT]}
root=${2:-$(cd "$(dirname "$0")/.." && pwd)}
cc=${CC:-cc}
if ! command -v "$cc" >/dev/null; then
  echo "build-init: no C compiler ($cc); install gcc and libc6-dev (apt-get install gcc libc6-dev)" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
"$cc" -std=gnu11 -O2 -Wall -Wextra -Werror -Wno-unused-parameter -Wno-format-truncation \
  -fstack-protector-strong -D_FORTIFY_SOURCE=2 -fPIE -static-pie -s \
  -o "$tmp" "$root/cmd/opendsec-init/init.c"
mv -f "$tmp" "$out"
