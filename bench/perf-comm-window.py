#!/usr/bin/env python3
"""CPU per create by process name (comm) in a burst's batch window.

Usage: perf-comm-window.py PERF_DATA UP_LOG COUNT [HZ]

PERF_DATA is a `perf record -a -F HZ -k realtime` of bench/burst.sh (KEEP=1
keeps the data dir, whose up.log is UP_LOG). The window runs from the first
create's start (its "sandbox running" time minus its total_ms) to the last
"sandbox running" line; samples in it are counted per comm and divided by
HZ (default 99) and COUNT: ms of CPU per create.
"""
import collections
import subprocess
import sys

from burstlog import creates


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    data, log, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hz = float(sys.argv[4]) if len(sys.argv) > 4 else 99.0
    starts, ends = creates(log)
    w0, w1 = min(starts), max(ends)
    out = subprocess.run(['perf', 'script', '-i', data, '-F', 'comm,time'],
                         capture_output=True, text=True, check=True).stdout
    per = collections.Counter()
    for line in out.splitlines():
        line = line.strip()
        if not line:
            continue
        comm, t = line.rsplit(None, 1)
        if w0 <= float(t.rstrip(':')) <= w1:
            per[comm.strip()] += 1
    print(f"batch window {w1 - w0:.2f} s, {len(ends)} creates; ms of CPU per create at {hz:g} Hz")
    for comm, n in per.most_common(12):
        print(f"{comm:20s} {n:6d} samples  {n / hz / count * 1000:6.2f}")
    total = sum(per.values())
    print(f"{'all':20s} {total:6d} samples  {total / hz / count * 1000:6.2f}")


if __name__ == '__main__':
    main()
