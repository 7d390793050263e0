"""`yes` for 60 s through the Python SDK (issue 11, finding 1): the client's
peak RSS must stay under 100 MiB, whether the caller collects the result
(kept output capped at OUTPUT_LIMIT per stream) or iterates the events (none
kept).

Against the system in OPENDSEC_ENDPOINT / OPENDSEC_TOKEN (bench/security.sh
starts one); image OPENDSEC_TEST_IMAGE (default root/busybox), seconds
YES_SECONDS (default 60). Prints a Markdown table; exit status 2 when a peak
reaches the bound.
"""

from __future__ import annotations

import asyncio
import os
import json
import resource
import subprocess
import sys
import time

from opendsec import DSecClient, DSecRunArgs

MIB = 1024 * 1024
BOUND = 100 * MIB
SECONDS = int(os.environ.get("YES_SECONDS", "60"))
IMAGE = os.environ.get("OPENDSEC_TEST_IMAGE", "root/busybox")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


async def one(mode: str) -> None:
    """Run one caller's way in this (fresh) process and print its figures."""
    async with DSecClient(timeout=60, max_retries=1) as c:
        sb = await c.run_sandbox(DSecRunArgs(image=IMAGE, timeout=SECONDS + 120))
        try:
            base = peak_rss()
            t0 = time.monotonic()
            cmd = f"timeout {SECONDS} yes"
            if mode == "collect":
                r = await sb.run_shell(cmd, timeout=SECONDS + 60)
                got = len(r.stdout_bytes)
            else:
                got = 0
                async with sb.exec(cmd, timeout=SECONDS + 60) as proc:
                    async for ev in proc:
                        got += len(ev.data)
                    r = await proc.wait()
            took = time.monotonic() - t0
        finally:
            await sb.stop()
    print(json.dumps({"total": r.stdout_total, "got": got, "took": took, "base": base, "peak": peak_rss(), "status": r.status}))


def main() -> int:
    rows = []
    for mode, name in (("collect", "collect (`run_shell`)"), ("stream", "stream (`async for`)")):
        out = subprocess.run([sys.executable, __file__, mode], check=True, capture_output=True, text=True).stdout
        rows.append((name, json.loads(out.strip().splitlines()[-1])))
    print(f"`timeout {SECONDS} yes` in a {IMAGE} sandbox, each caller in a fresh Python process; "
          f"peak RSS from getrusage (ru_maxrss of the whole process); bound {BOUND // MIB} MiB.\n")
    print("| caller | stdout produced | delivered / kept | time | RSS before | client peak RSS |")
    print("|---|---:|---:|---:|---:|---:|")
    ok = True
    for name, x in rows:
        print(f"| {name} | {x['total'] / MIB:.0f} MiB | {x['got'] / MIB:.0f} MiB | {x['took']:.1f} s "
              f"| {x['base'] / MIB:.0f} MiB | {x['peak'] / MIB:.0f} MiB |")
        ok = ok and x["peak"] < BOUND
    if not ok:
        print(f"\nFAIL: the client's peak RSS reached {BOUND // MIB} MiB", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(one(sys.argv[1]))
        sys.exit(0)
    sys.exit(main())
