#!/usr/bin/env bash
# 1000-sandbox burst against a throwaway system (free loopback ports, temp
# data dir, its own node network namespace, stopped by its PID):
#   1. a sequential `runc run --detach` loop of the same rootfs (RUNC_N,
#      default 100) side by side with one BatchCreateSandboxes of COUNT
#      (default 1000) sandboxes of cpu 0.1 and 128 MiB; then StopSandbox of
#      all of them;
#   2. a batch of COUNT with a request_id whose `opendsec up` gets SIGKILL
#      after KILL_AFTER (default 300) results; the system is started again
#      and the same request sent again: exactly COUNT sandboxes, distinct,
#      all running.
# Before the runc loop and again before the batch, bench/burst syncs and
# waits until the kernel's count of network namespaces (/proc/slabinfo) is
# steady for 2 s: neither side pays for the cleanup of what ran before it
# (the runc loop's containers, an earlier system's sandboxes).
# Every create of part 1 is cold: the batch has skip_warm_pool and the warm
# pool is off (size 0), so no prestart refill competes with it either.
# BASE_REV="<git rev>..." runs part 1 first with opendsec built from each
# revision in turn ("before") and then with the work tree ("after"), each on a fresh
# system and each with its own runc loop right before its batch: before and
# after side by side in one run.
# PREWARM=1 runs part 1 (cold, as above) and then, on a fresh system whose
# warm pool is on (node.warm_pool.max_sandboxes >= COUNT), its own runc loop
# and PrewarmSandboxes of COUNT (waiting until the pool holds them, timed)
# followed by the same batch without skip_warm_pool: cold and prewarmed side
# by side, with the prewarm's time and the total (prewarm + batch); part 2
# is skipped.
# BASE_INIT=1 builds each BASE_REV's opendsec-init too (by default every
# side runs the work tree's agent and init): before and after of a change
# to init.
# SETTLE=<seconds> waits that long before each system starts; by default
# vm.dirty_expire_centisecs (30 s) plus 5 s: an ext4 without a journal
# skips, when it allocates an inode, every inode freed within that time
# (recently_deleted), so a system started right after another's teardown
# (its sandboxes' state dirs and layer images: ~4000 inodes for 1000)
# paid for it on every new inode of its own (up to ~0.5 ms of CPU per
# create here): with BASE_REV the work tree's batch, which came second.
# SETTLE=0 skips the wait.
# REPEAT=<k> runs part 1 of the work tree k times, each on a fresh system
# (after SETTLE) with its own runc loop right before its batch, and reports
# every run and the medians (ratio, runc loop p50, batch throughput);
# part 2 is skipped.
# PERF=<file> records a perf call-graph profile of the work tree's
# `opendsec up` during part 1. PERF_SCHED=<file> records every context
# switch and wakeup on the host (with call graphs, on CLOCK_MONOTONIC)
# during the work tree's part 1, and CLOCK_REALTIME minus CLOCK_MONOTONIC
# in <file>.clockoff: with KEEP=1, `bench/sched-idle.py <file> <data
# dir>/up.log COUNT $(cat <file>.clockoff)` says why a CPU was idle during
# the batch.
# Runs as root. SKIP_KILL=1 runs only part 1; OUT names the report; KEEP=1
# keeps the data dir (up.log). Extra arguments go to bench/burst. The report is printed and
# written to bench/results/<YYYY-MM-DD>-burst.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/burst.sh must run as root (runc, mounts, cgroups, nftables)" >&2; exit 1; }
. scripts/lib/system.sh
BIN=$(mktemp -d /tmp/odbench-burstbin.XXXXXX)
DD=$(mktemp -d /tmp/odbench-burstdd.XXXXXX)
COUNT=${COUNT:-1000} RUNC_N=${RUNC_N:-100} KILL_AFTER=${KILL_AFTER:-300}
cleanup() {
  stop_system # up runs with --stop-sandboxes: nothing of this run outlives it
  if [ "${KEEP:-}" = 1 ]; then echo "kept $DD and $BIN" >&2; else rm -rf "$DD" "$DD".base-* "$DD".rep* "$DD".prewarm "$BIN"; fi
}
trap cleanup EXIT

echo "== build" >&2
VERSION=$(git describe --always --dirty 2>/dev/null || echo dev)
go build -o "$BIN/" ./bench/burst ./cmd/opendsec
CGO_ENABLED=0 go build -o "$BIN/opendsec-agent" ./cmd/opendsec-agent
bash scripts/build-init.sh "$BIN/opendsec-init"
for rev in ${BASE_REV:-}; do
  # The same agent and init: only the node and apiserver differ.
  mkdir -p "$BIN/base-$rev" "$BIN/src-$rev"
  git archive "$rev" | tar -x -C "$BIN/src-$rev"
  (cd "$BIN/src-$rev" && go build -o "$BIN/base-$rev/" ./cmd/opendsec)
  cp "$BIN/opendsec-agent" "$BIN/opendsec-init" "$BIN/base-$rev/"
  # Its own init with BASE_INIT=1, and always before init was C (the Go
  # init's node passes it --own-env, which the C init refuses).
  if [ "${BASE_INIT:-}" = 1 ] || [ ! -f "$BIN/src-$rev/cmd/opendsec-init/init.c" ]; then
    if [ -f "$BIN/src-$rev/cmd/opendsec-init/init.c" ]; then
      bash "$BIN/src-$rev/scripts/build-init.sh" "$BIN/base-$rev/opendsec-init" "$BIN/src-$rev"
    else
      (cd "$BIN/src-$rev" && CGO_ENABLED=0 go build -trimpath -o "$BIN/base-$rev/opendsec-init" ./cmd/opendsec-init)
    fi
  fi
  rm -rf "$BIN/src-$rev"
done
CACHE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
[ -d "$CACHE/busybox" ] || bash deploy/images/build.sh --no-import

# 1000 × (cpu 0.1, 128 MiB) is more than this machine has: the overcommits let
# the limits add up past it (docs/operations.md, "Capacity").
# The warm pool is off: its refills would be cold creates competing with
# the batch, and its takes warm ones (docs/operations.md, "Warm pool").
SYSTEM_NODE_EXTRA=${SYSTEM_NODE_EXTRA:-'"max_sandboxes": 2000, "cpu_overcommit": 50, "memory_overcommit": 8, "warm_pool": {"size": 0}'}
export SYSTEM_NODE_EXTRA
ARGS=(-rootfs "$CACHE/busybox" -count "$COUNT" "$@")
SETTLE=${SETTLE:-$(( $(cat /proc/sys/vm/dirty_expire_centisecs 2>/dev/null || echo 3000) / 100 + 5 ))}
MAINS=()
for rev in ${BASE_REV:-}; do
  # SETTLE: the last system's deletions (its sandboxes' files) no longer
  # slow this one's inode allocations on a file system without a journal.
  echo "== settle ${SETTLE} s" >&2
  sleep "$SETTLE"
  DDB=$DD.base-$rev
  mkdir "$DDB"
  echo "== before: opendsec of $rev up (data dir $DDB)" >&2
  start_system "$BIN/base-$rev" "$DDB" busybox -- --stop-sandboxes
  echo "== before: runc loop, batch create, stop" >&2
  "$BIN/burst" -endpoint "127.0.0.1:$API" -token-file "$DDB/bootstrap.token" "${ARGS[@]}" -mode main -up-pid "$UP_PID" \
    -name "$rev" -runc-n "$RUNC_N" -node-log "$DDB/up.log" -out-json "$DD/before-$rev.json"
  stop_system
  UP_PID=
  MAINS+=("$DD/before-$rev.json")
  [ "${KEEP:-}" = 1 ] || rm -rf "$DDB"
done
echo "== settle ${SETTLE} s" >&2
sleep "$SETTLE"
echo "== opendsec up (data dir $DD)" >&2
start_system "$BIN" "$DD" busybox -- --stop-sandboxes

# restart_system starts `opendsec up` again on the same config and data dir.
restart_system() {
  rm -f "$DD/ready"
  "$BIN/opendsec" up --config "$DD/opendsec.json" --data-dir "$DD" --ready-file "$DD/ready" --stop-sandboxes \
    >>"$DD/up.log" 2>&1 &
  UP_PID=$!
  local _
  # Recovery re-attaches every sandbox (a runc state each): give it time.
  for _ in $(seq 1 6000); do
    [ -s "$DD/ready" ] && return 0
    kill -0 "$UP_PID" 2>/dev/null || { tail -n 50 "$DD/up.log" >&2; echo "opendsec up exited" >&2; return 1; }
    sleep 0.1
  done
  echo "opendsec up did not become ready in 600 s" >&2
  return 1
}

B=("$BIN/burst" -endpoint "127.0.0.1:$API" -token-file "$DD/bootstrap.token" "${ARGS[@]}")
echo "== runc loop, batch create, stop" >&2
PERF_PID= PERF_SCHED_PID=
if [ -n "${PERF_SCHED:-}" ]; then
  # perf 6.1 refuses -k realtime with tracepoints: monotonic, and the
  # offset to place up.log's wall-clock times on it.
  perf record -a -g -e sched:sched_switch -e sched:sched_wakeup -k mono -o "$PERF_SCHED" >/dev/null 2>&1 &
  PERF_SCHED_PID=$!
  python3 -c 'import time; print(time.clock_gettime(time.CLOCK_REALTIME) - time.clock_gettime(time.CLOCK_MONOTONIC))' >"$PERF_SCHED.clockoff"
fi
if [ -n "${PERF:-}" ]; then
  # PERF=<file>: a call-graph CPU profile of the work tree's `opendsec up`
  # across part 1 (perf report -i <file> --no-children).
  perf record -F 999 -g -p "$UP_PID" -o "$PERF" >/dev/null 2>&1 &
  PERF_PID=$!
fi
REPEAT=${REPEAT:-1}
NAME="$VERSION (work tree)"
if [ "$REPEAT" -gt 1 ]; then NAME="$NAME #1"; fi
"${B[@]}" -mode main -up-pid "$UP_PID" -name "$NAME" -runc-n "$RUNC_N" -node-log "$DD/up.log" -out-json "$DD/main.json"
if [ -n "$PERF_PID" ]; then kill -INT "$PERF_PID"; wait "$PERF_PID" || true; fi
if [ -n "${PERF_SCHED_PID:-}" ]; then kill -INT "$PERF_SCHED_PID"; wait "$PERF_SCHED_PID" || true; fi
MAINS+=("$DD/main.json")
# REPEAT=<k>: part 1 of the work tree k times, each on a fresh system after
# SETTLE, with its own runc loop right before its batch (part 2 is skipped).
for i in $(seq 2 "$REPEAT"); do
  stop_system
  UP_PID=
  # The last repeat's data dir, once its system is down (the exit trap
  # removes the one still up at the end).
  if [ "$i" -gt 2 ] && [ "${KEEP:-}" != 1 ]; then rm -rf "$DD.rep$((i - 1))"; fi
  DDR=$DD.rep$i
  mkdir "$DDR"
  echo "== settle ${SETTLE} s" >&2
  sleep "$SETTLE"
  echo "== repeat $i of $REPEAT: opendsec up (data dir $DDR)" >&2
  start_system "$BIN" "$DDR" busybox -- --stop-sandboxes
  "$BIN/burst" -endpoint "127.0.0.1:$API" -token-file "$DDR/bootstrap.token" "${ARGS[@]}" -mode main -up-pid "$UP_PID" \
    -name "$VERSION (work tree) #$i" -runc-n "$RUNC_N" -node-log "$DDR/up.log" -out-json "$DD/main-$i.json"
  MAINS+=("$DD/main-$i.json")
done
REPEAT_TXT=
if [ "$REPEAT" -gt 1 ]; then SKIP_KILL=1; REPEAT_TXT="REPEAT=$REPEAT "; fi
CMD="${BASE_REV:+BASE_REV='$BASE_REV' }${BASE_INIT:+BASE_INIT=$BASE_INIT }${PREWARM:+PREWARM=$PREWARM }${REPEAT_TXT}SETTLE=$SETTLE COUNT=$COUNT RUNC_N=$RUNC_N bench/burst.sh $*"
if [ "${PREWARM:-}" = 1 ]; then
  stop_system
  UP_PID=
  DDP=$DD.prewarm
  mkdir "$DDP"
  # The pool on, bounded to hold the whole batch (and prestarting at most
  # its normal size, 2, for any other shape).
  POOL_MAX=$(( COUNT > 8 ? COUNT : 8 ))
  SYSTEM_NODE_EXTRA='"max_sandboxes": 2000, "cpu_overcommit": 50, "memory_overcommit": 8, "warm_pool": {"size": 2, "max_sandboxes": '$POOL_MAX'}'
  echo "== prewarm: opendsec up with the warm pool on (data dir $DDP)" >&2
  start_system "$BIN" "$DDP" busybox -- --stop-sandboxes
  echo "== prewarm: runc loop, prewarm, batch create, stop" >&2
  "$BIN/burst" -endpoint "127.0.0.1:$API" -token-file "$DDP/bootstrap.token" "${ARGS[@]}" -mode main -up-pid "$UP_PID" \
    -name "$VERSION prewarmed" -prewarm -skip-warm-pool=false -runc-n "$RUNC_N" -node-log "$DDP/up.log" -out-json "$DD/prewarm.json"
  MAINS+=("$DD/prewarm.json")
  "$BIN/burst" -mode report -command "$CMD" -out "${OUT:-bench/results/$(date -u +%F)-burst-prewarm.md}" "${MAINS[@]}"
  exit 0
fi
if [ "${SKIP_KILL:-}" = 1 ]; then
  "$BIN/burst" -mode report -command "$CMD" -out "${OUT:-bench/results/$(date -u +%F)-burst.md}" "${MAINS[@]}"
  exit 0
fi
echo "== batch, kill -9 after $KILL_AFTER results" >&2
RID=burst-kill-$$
"${B[@]}" -mode kill -request-id "$RID" -kill-after "$KILL_AFTER" -kill-pid "$UP_PID" -out-json "$DD/kill.json"
wait "$UP_PID" 2>/dev/null || true
echo "== restart, the same batch again" >&2
T0=$(date +%s%N)
restart_system
RESTART_MS=$(( ($(date +%s%N) - T0) / 1000000 ))
rc=0
"${B[@]}" -mode retry -request-id "$RID" -restart-ms "$RESTART_MS" -out-json "$DD/retry.json" || rc=$?
# Every part-1 result (BASE_REV's "before" ones too), then part 2's.
"$BIN/burst" -mode report -command "$CMD" -out "${OUT:-bench/results/$(date -u +%F)-burst.md}" \
  "${MAINS[@]}" "$DD/kill.json" "$DD/retry.json"
exit $rc
