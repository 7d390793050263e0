#!/usr/bin/env bash
# What a cpuset cgroup per container costs crun on cgroup v1: CPU
# (task-clock) of `crun run` of the busybox rootfs's /bin/true, attached,
# with the sandbox's limits and a cgroup namespace, in two ways,
# interleaved run by run, each beside SIB (default 1000) idle sibling
# cgroups in every hierarchy (the node's other sandboxes):
#   own     as before cgview_linux.go: the cgroup2 mount unmounted, the
#           container's cpuset made first without load balancing (the
#           node's quietCpuset), crun copying the CPUs and memory nodes in;
#   shared  crun's /sys/fs/cgroup without the cpuset hierarchy (a tmpfs of
#           clones of the other mounts), the process that starts crun
#           moved first into one shared cpuset cgroup.
# Both count the shell that does the step before crun (same in both).
#
# usage (root, cgroup v1 or hybrid, cpuset on its own at /sys/fs/cgroup/cpuset):
#   flock /tmp/opendsec-root.lock env SIB=1000 bash bench/crun-cpuset-view.sh [N]
set -euo pipefail
N=${1:-100}; SIB=${SIB:-1000}
cd "$(dirname "$0")/.."
mountpoint -q /sys/fs/cgroup/cpuset || { echo "no cgroup v1 cpuset hierarchy at /sys/fs/cgroup/cpuset" >&2; exit 1; }
. bench/lib/crunbundle.sh
crun_bench_bundle crun-cpuset-view
for h in $(cd /sys/fs/cgroup && for d in *; do [ "$d" != unified ] && mountpoint -q "$d" && echo "$d"; done); do
  mkdir -p /sys/fs/cgroup/$h$CG
  [ $h = cpuset ] && { cat /sys/fs/cgroup/cpuset/cpuset.cpus > /sys/fs/cgroup/cpuset$CG/cpuset.cpus; cat /sys/fs/cgroup/cpuset/cpuset.mems > /sys/fs/cgroup/cpuset$CG/cpuset.mems; }
  for i in $(seq $SIB); do mkdir /sys/fs/cgroup/$h$CG/s$i; done
  [ $h = cpuset ] && for i in $(seq $SIB); do echo 0 > /sys/fs/cgroup/cpuset$CG/s$i/cpuset.sched_load_balance; done
done
mkdir /sys/fs/cgroup/cpuset$CG/shared
echo 0 > /sys/fs/cgroup/cpuset$CG/shared/cpuset.sched_load_balance
cat /sys/fs/cgroup/cpuset/cpuset.cpus > /sys/fs/cgroup/cpuset$CG/shared/cpuset.cpus; cat /sys/fs/cgroup/cpuset/cpuset.mems > /sys/fs/cgroup/cpuset$CG/shared/cpuset.mems
mkdir $W/orig
VIEW="mount --rbind /sys/fs/cgroup $W/orig; mount -t tmpfs -o mode=755,size=64k v /sys/fs/cgroup; for h in \$(cd $W/orig && for d in *; do [ \$d != cpuset ] && [ \$d != unified ] && mountpoint -q \$d && echo \$d; done); do mkdir /sys/fs/cgroup/\$h; mount --bind $W/orig/\$h /sys/fs/cgroup/\$h; done;"
for i in $(seq $N); do
  for v in own shared; do
    if [ $v = own ]; then
      h="mountpoint -q /sys/fs/cgroup/unified && umount /sys/fs/cgroup/unified;"
      pre="mkdir /sys/fs/cgroup/cpuset$CG/c && echo 0 > /sys/fs/cgroup/cpuset$CG/c/cpuset.sched_load_balance"
    else
      h="$VIEW"
      pre="echo \\\$\\\$ > $W/orig/cpuset$CG/shared/tasks"
    fi
    unshare -m --propagation private bash -c "$h perf stat -x, -e task-clock -o $W/ps.$v.$i sh -c \"$pre; exec crun --root $W/state run --bundle $W t-$v-$i\" >/dev/null 2>$W/err.$v" || { echo "failed $v" >&2; cat $W/err.$v >&2; }
  done
done
echo "crun run of /bin/true beside $SIB sibling cgroups, task-clock over $N runs each (crun $(crun --version | head -1 | awk '{print $3}')):"
for v in own shared; do
  cat "$W"/ps.$v.* | awk -F, '/task-clock/{print $1}' | sort -n | awk -v v=$v '{a[NR]=$1} END{printf "%-7s n %d  p50 %.2f ms  (p25 %.2f, p75 %.2f)\n", v, NR, a[int(NR/2)+1], a[int(NR/4)+1], a[int(3*NR/4)+1]}'
done
