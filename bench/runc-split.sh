#!/usr/bin/env bash
# `runc run --detach` against `runc create` + `runc start` of the same
# busybox bundle, side by side: R (default 40) rounds, each one of both in
# alternating order; prints the p50 wall time and the mean CPU (user+sys of
# the runc processes, from RUSAGE_CHILDREN) of each. The container backend
# runs one `runc run --detach` per cold create and `runc create` only to
# prestart a warm-pool sandbox (whose start is a read of runc's exec fifo, no
# runc): bench/results/2026-12-02-runc-invocations.md.
# Runs as root; run it under /tmp/opendsec-root.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/runc-split.sh must run as root" >&2; exit 1; }
CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
[ -d "$CACHE/busybox" ] || bash deploy/images/build.sh --no-import
W=$(mktemp -d /tmp/odbench-runcsplit.XXXXXX)
trap 'rm -rf "$W"' EXIT
mkdir "$W/bundle" && (cd "$W/bundle" && runc spec)
python3 - "$W" "$CACHE/busybox" "${R:-40}" <<'PY'
import json, os, resource, statistics, subprocess, sys, time
w, root, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = os.path.join(w, 'bundle', 'config.json')
s = json.load(open(p))
s['root'] = {'path': root, 'readonly': True}
s['process']['terminal'] = False
s['process']['args'] = ['sleep', '100']
json.dump(s, open(p, 'w'))
base = ['runc', '--root', os.path.join(w, 'runc')]
null = subprocess.DEVNULL

def timed(*cmds):
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    for c in cmds:
        subprocess.run(base + c, check=True, stdin=null, stdout=null, stderr=null)
    t1 = time.monotonic()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (t1 - t0) * 1000, (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1000

res = {'run': [], 'split': []}
ids = []
for i in range(rounds):
    a, b = f'rs{os.getpid()}-r{i}', f'rs{os.getpid()}-s{i}'
    ids += [a, b]
    one = lambda: res['run'].append(timed(['run', '--detach', '-b', os.path.join(w, 'bundle'), a]))
    two = lambda: res['split'].append(timed(['create', '-b', os.path.join(w, 'bundle'), b], ['start', b]))
    for f in ((one, two) if i % 2 == 0 else (two, one)):
        f()
for i in ids:
    subprocess.run(base + ['delete', '--force', i], stdin=null, stdout=null, stderr=null)
print('| | runs | wall p50 | runc CPU mean |')
print('|---|---|---|---|')
for k, name in (('run', '`runc run --detach`'), ('split', '`runc create` + `runc start`')):
    print(f"| {name} | {len(res[k])} | {statistics.median(x[0] for x in res[k]):.1f} ms | {statistics.mean(x[1] for x in res[k]):.1f} ms |")
r = statistics.median(x[0] for x in res['split']) / statistics.median(x[0] for x in res['run'])
c = statistics.mean(x[1] for x in res['split']) / statistics.mean(x[1] for x in res['run'])
print(f"\ncreate+start / run: wall {r:.2f}x, CPU {c:.2f}x")
PY
