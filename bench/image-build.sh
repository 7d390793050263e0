#!/usr/bin/env bash
# Measures `image build` of the multi-stage Dockerfile of
# internal/daemon TestBuildImageMultiStage (ARG, ENV, WORKDIR, COPY,
# COPY --from, RUN, USER; 3 RUN steps in build sandboxes) through the public
# API, the three builds side by side in every iteration: a cold build (new
# store), the same build again (every layer from the cache), and a build
# after one changed context file (the COPY reading it and the steps after
# it run; the layers under it, and the other stage, from the cache).
# Runs as root; N (default 7) iterations, each on a fresh `opendsec up`.
# The results doc is bench/results/2026-12-02-image-build.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/image-build.sh must run as root (runc, mounts)" >&2; exit 1; }
N=${N:-7}
T=$(mktemp -d /tmp/odbench-build.XXXXXX)
trap 'rm -rf "$T"' EXIT
go test -c -o "$T/daemon.test" ./internal/daemon/
for i in $(seq "$N"); do
  (cd internal/daemon && OPENDSEC_ROOT_TESTS=1 OPENDSEC_BUILD_BENCH_OUT="$T/times" \
    "$T/daemon.test" -test.run '^TestBuildImageMultiStage$' -test.count=1 >"$T/log" 2>&1) ||
    { tail -40 "$T/log" >&2; exit 1; }
done
python3 - "$T/times" <<'PY'
import re, statistics, sys
def secs(s):
    m = re.fullmatch(r"([\d.]+)(ms|s)", s)
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
rows = [[secs(x) for x in l.split()] for l in open(sys.argv[1]) if l.strip()]
cold, same, one = (statistics.median(c) for c in zip(*rows))
print(f"iterations: {len(rows)}")
print("| build | median | vs cold |")
print("|---|---|---|")
for name, v in (("cold (new store)", cold), ("unchanged rebuild", same), ("one changed file (its COPY and the 2 RUNs after it run)", one)):
    print(f"| {name} | {v*1000:.0f} ms | {v/cold:.2f} |")
PY
