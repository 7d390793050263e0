#!/usr/bin/env python3
"""Why a CPU is idle during a burst's batch: scheduler trace analysis.

Usage: sched-idle.py SCHED_DATA UP_LOG COUNT CLOCK_OFFSET [NCPU]

SCHED_DATA is `perf record -a -g -e sched:sched_switch -e sched:sched_wakeup
-k mono` over the batch (perf 6.1 refuses -k realtime for tracepoints);
CLOCK_OFFSET is CLOCK_REALTIME minus CLOCK_MONOTONIC in seconds, taken when
the recording started (python3 -c 'import time; print(time.clock_gettime(0)
- time.clock_gettime(1))'), to place the batch window of UP_LOG (KEEP=1 of
bench/burst.sh: from the first create's start to the last "sandbox
running") on the trace's clock. COUNT divides into ms per create.

It replays the trace: which CPUs are idle, each CPU's queue of runnable
tasks (woken or preempted, not yet running) and every sleeping thread's
kernel and user stack at the moment it slept. Every instant a CPU is idle
counts as one of:
  - another CPU had runnable tasks waiting: the scheduler left a CPU idle
    with work queued next door (split by how the oldest waiter got there:
    woken while this CPU was busy, woken while it was idle, preempted);
  - nothing runnable anywhere: every thread was asleep, and then the idle
    is split evenly over what the sleeping threads of the node, crun
    (comm "64"), opendsec-init and kworkers waited on (their kernel stack,
    and the node's Go frames), leaving out waits on each other (waitid,
    pipe and socket reads, futex).
It also prints the length of idle periods and, for latency, the off-CPU
time (sleeping, not preempted) per create by wait stack.
"""
import collections
import os
import re
import subprocess
import sys

from burstlog import creates

SKIP = re.compile(
    r'^(__schedule|schedule|schedule_timeout|schedule_hrtimeout_range|schedule_hrtimeout_range_clock|io_schedule|'
    r'io_schedule_timeout|schedule_preempt_disabled|__wait_for_common|wait_for_completion|wait_for_completion_state|'
    r'wait_for_completion_killable|__rt_mutex|preempt_schedule.*|__cond_resched|_cond_resched|bit_wait.*|__wait_on_bit.*|'
    r'out_of_line_wait_on_bit.*|schedule_idle|futex_wait_queue|__futex_wait|futex_wait|do_futex|do_nanosleep|'
    r'hrtimer_nanosleep|rcu_momentary.*|wait_rcu_gp|__wait_rcu_gp|exit_to_user_mode.*|irqentry_exit.*|asm_sysvec.*|'
    r'sysvec_.*|syscall_exit_to_user_mode.*|do_syscall_64|entry_SYSCALL_64.*|x64_sys_call|__x64_sys_.*|ep_poll|'
    r'do_epoll_wait|do_epoll_pwait.*|\[unknown\]|retint_.*|asm_exc_page_fault)$')
# Waits that are idle by nature (a parked thread, a worker with no work).
IDLEWAIT = re.compile(r'futex|epoll|worker_thread|rescuer_thread|smpboot_thread|rcu_gp_kthread|kthreadd|ksoftirqd|'
                      r'rcu_.*kthread|kswapd|khugepaged|kcompactd|poll_schedule|do_select|do_sys_poll|kdamond|'
                      r'devtmpfsd|io_wq|do_task_dead')
# Waits on another process or thread of the batch: not a cause of their own.
IPC = re.compile(r'do_wait|anon_pipe_read|pipe_read|unix_dgram_recvmsg|unix_stream_read|futex|wait_for_vfork_done|'
                 r'^clone: kernel_clone$|^clone: kernel_clone  ')
# A waiter older than this is taken as a lost event, not a queued task.
MAXWAIT = float(os.environ.get('MAXWAIT_MS', '4')) / 1000
SWITCH = re.compile(r'prev_comm=(.*?) prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)')
WAKEUP = re.compile(r'comm=(.*?) pid=(\d+) prio=\d+ target_cpu=(\d+)')
HEAD = re.compile(r'\s*(.*?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s*(.*)')


def window(log, offset):
    starts, ends = creates(log)
    return min(starts) - offset, ends[-1] - offset


def klass(comm):
    if comm == 'opendsec':
        return 'node'
    if comm == '64':
        return 'crun'
    if comm == 'init':
        return 'init'
    if comm.startswith('kworker'):
        return 'kworker'
    return 'other'


def key_of(stack):
    k, user, sysc = [], [], ''
    for ip, sym in stack:
        s = sym.split('+')[0]
        if not sysc and (s.startswith('__x64_sys_') or s.startswith('__do_sys_')):
            sysc = s.replace('__x64_sys_', '').replace('__do_sys_', '')
        if ip.startswith('ffffffff'):
            if not SKIP.match(s) and len(k) < 4:
                k.append(s)
        elif not (s == '[unknown]' or s.startswith(('runtime.', 'syscall.', 'internal/runtime', 'golang.org/x/sys'))):
            if len(user) < 2:
                user.append(s.replace('github.com/kernflux/opendsec/internal/', ''))
    return f"{sysc}: {' < '.join(k)}" + (f"  [{' < '.join(user)}]" if user else '')


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    data, log, count, offset = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    ncpu = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    t0, t1 = window(log, offset)
    p = subprocess.Popen(['perf', 'script', '-i', data, '-F', 'comm,tid,cpu,time,event,trace,ip,sym', '--no-inline'],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1 << 20)
    idle = {}                                 # cpu -> idle since
    running = {}                              # cpu -> tid on it
    names = {}                                # tid -> comm
    left = {}                                 # tid -> when it last left a CPU
    hot = collections.Counter()               # the oldest waiter had run within 0.5 ms -> cpu-s
    pairs = collections.Counter()             # waiter (waker) / running -> cpu-s
    rq = {c: {} for c in range(ncpu)}         # cpu -> tid -> (t, how)
    asleep = {}                               # tid -> (t, state, key, comm)
    cls = collections.Counter()               # idle classification -> cpu-s
    blocked_at_idle = collections.Counter()   # (class, state, key) -> cpu-s
    offcpu = collections.Counter()            # (class, state, key) -> s
    lengths = collections.Counter()
    span = [None, None]
    last = [None]

    def advance(t):
        a = last[0]
        last[0] = t
        if a is None:
            return
        a, b = max(a, t0), min(t, t1)
        if b <= a or not idle:
            return
        d = b - a
        for c in idle:
            on = set(running.values())
            waiting = [w for o in rq if o != c for tid, w in rq[o].items() if tid not in on and a - w[0] < MAXWAIT]
            if waiting:
                cls['another CPU had runnable tasks waiting'] += d
                oldest = min(waiting)
                hot['had run within 0.5 ms of the moment this CPU went idle' if idle[c] - oldest[5] < 0.0005 else 'had not run for 0.5 ms or more when this CPU went idle'] += d
                cls['  the oldest waiter ' + oldest[1]] += d
                pairs[f"{oldest[2]} (woken by {oldest[3]}) waited behind {oldest[4]}"] += d
                continue
            cls['nothing runnable anywhere'] += d
            blocked = [(klass(cm), st, k) for (_, st, k, cm) in asleep.values()
                       if klass(cm) != 'other' and st[:1] in 'SD' and not IDLEWAIT.search(k) and not IPC.search(k)]
            if not blocked:
                blocked_at_idle[('-', '-', 'only idle or IPC waits')] += d
            for x in blocked:
                blocked_at_idle[x] += d / len(blocked)

    def event(comm, tid, cpu, t, ev, tr, stack):
        advance(t)
        if t0 <= t <= t1:
            span[0] = t if span[0] is None else span[0]
            span[1] = t
        if ev == 'sched_wakeup':
            m = WAKEUP.search(tr)
            if not m:
                return
            pid, tc = int(m.group(2)), int(m.group(3))
            for q in rq.values():
                q.pop(pid, None)
            others_idle = any(o in idle for o in rq if o != tc)
            rq.setdefault(tc, {})[pid] = (t, 'was woken while another CPU idled' if others_idle else 'was woken while every CPU was busy',
                                         klass(m.group(1)), klass(comm), klass(names.get(running.get(tc), '?')), left.get(pid, -1e9))
            return
        m = SWITCH.search(tr)
        if not m:
            return
        pcomm, ppid, pstate, npid = m.group(1), int(m.group(2)), m.group(3), int(m.group(5))
        for q in rq.values():
            q.pop(npid, None)
            q.pop(ppid, None)
        if npid in asleep:
            ts, st, k, c = asleep.pop(npid)
            a, b = max(ts, t0), min(t, t1)
            if b > a:
                offcpu[(klass(c), st, k)] += b - a
        left[ppid] = t
        if ppid != 0:
            if pstate.startswith('R'):
                rq.setdefault(cpu, {})[ppid] = (t, 'was preempted', klass(pcomm), klass(m.group(4)), klass(m.group(4)), t)
            else:
                asleep[ppid] = (t, pstate, key_of(stack), pcomm)
        running[cpu] = npid
        names[npid] = m.group(4)
        if npid == 0:
            idle[cpu] = t
        elif cpu in idle:
            s = idle.pop(cpu)
            if t0 <= s and t <= t1:
                d = t - s
                b = '<50us' if d < 50e-6 else '50-200us' if d < 200e-6 else '0.2-1ms' if d < 1e-3 else '1-5ms' if d < 5e-3 else '>=5ms'
                lengths[b] += d

    cur = None
    for line in p.stdout:
        if not line.strip():
            continue
        if line[0] == '\t':
            if cur is not None:
                parts = line.split(None, 1)
                if len(parts) == 2:
                    cur[6].append((parts[0], parts[1].strip()))
            continue
        if cur is not None:
            event(*cur)
        m = HEAD.match(line)
        cur = (m.group(1), int(m.group(2)), int(m.group(3)), float(m.group(4)), m.group(5), m.group(6), []) if m else None
    if cur is not None:
        event(*cur)
    p.wait()
    w = (span[1] - span[0]) if span[0] is not None else 0
    total = sum(v for k, v in cls.items() if not k.startswith(' '))
    per = 1000.0 / count
    print(f"batch window {t1 - t0:.2f} s (traced {w:.2f} s), {count} creates; CPU idle {total:.3f} CPU-s = "
          f"{total * per:.2f} ms per create, {total / (ncpu * w) * 100 if w else 0:.1f}% of {ncpu} CPUs")
    print("\n== while a CPU was idle (ms per create)")
    for k, v in sorted(cls.items(), key=lambda x: (x[0].startswith(' '), -x[1])):
        pass
    for k in [k for k in cls if not k.startswith(' ')]:
        print(f"{cls[k] * per:7.2f}  {cls[k] / total * 100:5.1f}%  {k}")
        if k.startswith('another'):
            for k2, v2 in sorted(((k2, v2) for k2, v2 in cls.items() if k2.startswith(' ')), key=lambda x: -x[1]):
                print(f"{v2 * per:7.2f}  {v2 / total * 100:5.1f}%  {k2}")
    print("\n== the oldest waiter: when it had last run (a task that ran within sched_migration_cost,\n"
          "   0.5 ms, is 'cache hot': the balancing of a CPU that just went idle does not take it)")
    for k, v in hot.most_common():
        print(f"{v * per:7.2f}  {k}")
    print("\n== the oldest waiter (by process) and what ran on its CPU meanwhile (ms per create)")
    for k, v in pairs.most_common(10):
        print(f"{v * per:7.2f}  {k}")
    print("\n== idle periods by length (ms per create)")
    for b in ['<50us', '50-200us', '0.2-1ms', '1-5ms', '>=5ms']:
        print(f"{lengths[b] * per:7.2f}  {b}")
    print("\n== 'nothing runnable anywhere': what the sleeping threads waited on (ms per create, split evenly)")
    for k, v in blocked_at_idle.most_common(15):
        print(f"{v * per:7.3f}  {k[0]:7s} {k[1]:2s} {k[2]}")
    print("\n== off-CPU time per create (sleeping, not preempted; not idle-type or IPC waits), by wait stack")
    shown = 0
    for k, v in offcpu.most_common():
        if k[0] == 'other' or k[1][:1] not in 'SD' or IDLEWAIT.search(k[2]) or IPC.search(k[2]):
            continue
        print(f"{v * per:7.2f}  {k[0]:7s} {k[1]:2s} {k[2]}")
        shown += 1
        if shown == int(os.environ.get("OFFCPU_TOP", "25")):
            break


if __name__ == '__main__':
    main()
