#!/usr/bin/env bash
# What Debian's libsystemd costs crun: CPU (task-clock) of `crun run` of the
# busybox rootfs's /bin/true, attached, with the sandbox's limits and a
# cgroup namespace, crun executed from a sealed memfd as the node does
# (no re-exec of its own), interleaved run by run:
#   deb   crun as installed (libsystemd and its five libraries);
#   stub  with the node's opendsec-crun-libsystemd.so preloaded.
#
# usage (root): flock /tmp/opendsec-root.lock bash bench/crun-preload.sh [N]
# (builds the library with scripts/build-init.sh into a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-60}
. bench/lib/crunbundle.sh
crun_bench_bundle crun-preload
chmod 755 "$W"
bash scripts/build-init.sh "$W/lib/opendsec-init" >/dev/null
LIB=$W/lib/opendsec-crun-libsystemd.so
cat > $W/run.py <<'PY'
import os, sys, fcntl
out, lib = sys.argv[1], sys.argv[2]
fd = os.memfd_create("crun", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
os.write(fd, open("/usr/bin/crun", "rb").read())
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
os.set_inheritable(fd, True)
env = dict(os.environ)
if lib != "-": env["LD_PRELOAD"] = lib
os.execve("/usr/bin/perf", ["perf", "stat", "-x,", "-e", "task-clock", "-o", out, f"/proc/self/fd/{fd}"] + sys.argv[3:], env)
PY
for i in $(seq $N); do
  for v in deb stub; do
    lib=-; [ $v = stub ] && lib=$LIB
    unshare -m --propagation private bash -c "mountpoint -q /sys/fs/cgroup/unified && umount /sys/fs/cgroup/unified; python3 $W/run.py $W/ps.$v.$i $lib --root $W/state run --bundle $W t-$v-$i >/dev/null 2>$W/err.$v" || { echo "failed $v"; cat $W/err.$v; }
  done
done
echo "crun run of /bin/true, task-clock over $N runs each (crun $(crun --version | head -1 | awk '{print $3}')):"
for v in deb stub; do
  cat "$W"/ps.$v.* | awk -F, '/task-clock/{print $1}' | sort -n | awk -v v=$v '{a[NR]=$1} END{printf "%-5s n %d p50 %.2f ms (p25 %.2f p75 %.2f)\n", v, NR, a[int(NR/2)+1], a[int(NR/4)+1], a[int(3*NR/4)+1]}'
done
