# Sourced by bench/crun-*.sh: a crun bundle of the busybox rootfs's
# /bin/true shaped like a sandbox (read-only root, a cgroup namespace, the
# memory, cpu and pids limits of a small sandbox, cgroupsPath $CG/c), in a
# temp work dir, removed with its cgroups at exit.
#
# crun_bench_bundle NAME sets ROOTFS, W (the work dir, whose config.json
# is the bundle's) and CG (/NAME-<pid>), and traps EXIT for the cleanup.
crun_bench_bundle() {
  ROOTFS=${ROOTFS:-${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs/busybox}
  [ -x "$ROOTFS/bin/true" ] || { echo "no busybox rootfs at $ROOTFS: run deploy/images/build.sh --no-import" >&2; exit 1; }
  W=$(mktemp -d "/tmp/$1.XXXXXX")
  CG=/$1-$$
  trap crun_bench_cleanup EXIT
  (cd "$W" && crun spec)
  python3 - "$W" "$ROOTFS" "$CG" <<'PY'
import json, sys
w, rootfs, cg = sys.argv[1:4]
s = json.load(open(f"{w}/config.json"))
s["root"] = {"path": rootfs, "readonly": True}
s["process"]["args"], s["process"]["terminal"] = ["/bin/true"], False
s["linux"]["namespaces"].append({"type": "cgroup"})
s["linux"]["resources"] = {"memory": {"limit": 134217728, "swap": 134217728}, "cpu": {"quota": 10000}, "pids": {"limit": 128}}
s["linux"]["cgroupsPath"] = cg + "/c"
json.dump(s, open(f"{w}/config.json", "w"))
PY
}

crun_bench_cleanup() {
  for d in /sys/fs/cgroup/*"$CG"; do
    [ -d "$d" ] && { find "$d" -mindepth 1 -depth -type d -exec rmdir {} \; 2>/dev/null; rmdir "$d" 2>/dev/null; }
  done
  rm -rf "$W"
}
