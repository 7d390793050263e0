#!/usr/bin/env bash
# What parts of a sandbox-like config.json cost crun: CPU (task-clock of
# `crun run` and the container's /bin/true, attached) of four variants,
# interleaved run by run: "full" (crun spec's defaults plus a cgroup
# namespace and the sandbox's memory, cpu and pids limits), "nocg" (no
# /sys/fs/cgroup mount), "nomask" (no masked or read-only paths), "nores"
# (no resources). On a hybrid cgroup host it runs in a private mount
# namespace without /sys/fs/cgroup/unified, as the node runs crun.
#
# usage (root): flock /tmp/opendsec-root.lock bash bench/crun-spec-cost.sh [N]
set -euo pipefail
N=${1:-150}
cd "$(dirname "$0")/.."
. bench/lib/crunbundle.sh
crun_bench_bundle crun-spec-cost
python3 - "$W" <<'PY'
import copy, json, os, sys
w = sys.argv[1]
s = json.load(open(f"{w}/config.json"))
v = {"full": s}
v["nocg"] = copy.deepcopy(s); v["nocg"]["mounts"] = [m for m in s["mounts"] if m["destination"] != "/sys/fs/cgroup"]
v["nomask"] = copy.deepcopy(s); v["nomask"]["linux"]["maskedPaths"] = []; v["nomask"]["linux"]["readonlyPaths"] = []
v["nores"] = copy.deepcopy(s); v["nores"]["linux"]["resources"] = {}
for k, c in v.items():
    os.makedirs(f"{w}/{k}", exist_ok=True)
    json.dump(c, open(f"{w}/{k}/config.json", "w"))
PY
hide=
mountpoint -q /sys/fs/cgroup/unified && hide="umount /sys/fs/cgroup/unified;"
unshare -m --propagation private bash -c "$hide
for i in \$(seq $N); do for v in full nocg nomask nores; do
  perf stat -x, -e task-clock -o $W/ps.\$v.\$i crun --root $W/state run --bundle $W/\$v t-\$v-\$i >/dev/null 2>&1 || echo \"failed: \$v\" >&2
done; done"
echo "crun run of /bin/true, task-clock p50 over $N runs each (crun $(crun --version | head -1 | awk '{print $3}')):"
for v in full nocg nomask nores; do
  cat "$W"/ps.$v.* | awk -F, '/task-clock/{print $1}' | sort -n | awk -v v=$v '{a[NR]=$1} END{printf "%-7s %.2f ms\n", v, a[int(NR/2)+1]}'
done
