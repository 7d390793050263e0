#!/usr/bin/env python3
"""What grows over a burst's batch: CPU per create early vs late, by key.

Usage: perf-growth.py PERF_SCRIPT UP_LOG [comm|sys|leaf] [deciles]

PERF_SCRIPT is `perf script -F comm,tid,time,ip,sym` of a `perf record -a
-g -k realtime` taken over bench/burst.sh (KEEP=1 keeps the data dir, whose
up.log is UP_LOG). The batch is cut at the completion of its first 30% and
last 30% of creates ("sandbox running" lines); each window's samples (CPU
idle left out) are divided by its creates: ms of CPU per create, early and
late, and their difference per key, largest growth first. Keys: comm
(process name), sys (process name and the system call or fault a sample is
in, or "user"), leaf (process name and the sampled function). "deciles"
instead prints, for each tenth of the creates, wall time, busy and idle CPU
per create. Sampling rate: 299 Hz (perf record -F 299).
"""
import collections
import re
import sys

from burstlog import creates

HZ = 299.0


def samples(path):
    """Yields (comm, time, [frame symbols, leaf first])."""
    hdr, frames = None, []
    for line in open(path):
        if not line.strip():
            if hdr:
                yield hdr[0], hdr[1], frames
            hdr, frames = None, []
        elif not line.startswith(('\t', ' ')):
            m = re.match(r'(.*?)\s+\d+\s+([\d.]+):', line)
            hdr = (m.group(1).strip(), float(m.group(2))) if m else None
        else:
            parts = line.strip().split(None, 1)
            frames.append(parts[1] if len(parts) > 1 else '?')
    if hdr:
        yield hdr[0], hdr[1], frames


def key(mode, comm, syms):
    if mode == 'comm':
        return comm
    if mode == 'leaf':
        return comm + ' ' + (syms[0] if syms else '?')
    for s in reversed(syms):
        if s.startswith(('__x64_sys_', '__do_sys_')) or s in ('asm_exc_page_fault', 'ret_from_fork_asm'):
            return comm + ' ' + s
    return comm + ' user'


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    script, log = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else 'comm'
    starts, ends = creates(log)
    w0 = min(starts)
    n = len(ends)
    if mode == 'deciles':
        cuts = [w0] + [ends[(i + 1) * n // 10 - 1] for i in range(10)]
        busy, idle = collections.Counter(), collections.Counter()
        for comm, t, _ in samples(script):
            for i in range(10):
                if cuts[i] <= t < cuts[i + 1]:
                    (idle if comm == 'swapper' else busy)[i] += 1
                    break
        for i in range(10):
            c = (i + 1) * n // 10 - i * n // 10
            print(f"tenth {i}: wall {(cuts[i + 1] - cuts[i]) * 1000 / c:5.1f} ms/create, "
                  f"busy {busy[i] / HZ / c * 1000:5.1f}, idle {idle[i] / HZ / c * 1000:4.1f} ms of CPU per create")
        return
    a1, b0, b1 = ends[n * 3 // 10 - 1], ends[n * 7 // 10 - 1], ends[-1]
    early, late = collections.Counter(), collections.Counter()
    for comm, t, syms in samples(script):
        if comm == 'swapper':
            continue
        if w0 <= t <= a1:
            early[key(mode, comm, syms)] += 1
        elif b0 < t <= b1:
            late[key(mode, comm, syms)] += 1
    ka, kb = 1000 / HZ / (n * 3 // 10), 1000 / HZ / (n - n * 7 // 10)
    print(f"first 30% of the creates: {sum(early.values()) * ka:.2f} ms of CPU per create; last 30%: {sum(late.values()) * kb:.2f}")
    diff = {k: late[k] * kb - early[k] * ka for k in set(early) | set(late)}
    for k, v in sorted(diff.items(), key=lambda x: -x[1])[:30]:
        print(f"{v:+7.3f}  ({early[k] * ka:6.3f} -> {late[k] * kb:6.3f})  {k}")


if __name__ == '__main__':
    main()
