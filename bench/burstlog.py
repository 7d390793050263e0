"""The batch's creates in a burst's up.log, for the bench/ perf scripts."""
import datetime
import re
import sys


def creates(log):
    """Returns (starts, ends) of every create in log, as Unix seconds, ends
    sorted: each "sandbox running" line's time, less its total_ms for the
    start. Exits when there is none."""
    starts, ends = [], []
    for line in open(log):
        if 'msg="sandbox running"' not in line:
            continue
        t = datetime.datetime.fromisoformat(re.search(r'time=(\S+)', line).group(1).replace('Z', '+00:00')).timestamp()
        ends.append(t)
        starts.append(t - float(re.search(r'total_ms=([\d.]+)', line).group(1)) / 1000)
    if not ends:
        sys.exit(f'{log}: no "sandbox running" lines')
    ends.sort()
    return starts, ends
