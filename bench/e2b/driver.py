"""Side-by-side benchmark: Sandbox.create + commands.run("echo hi") + kill
through the E2B JS SDK (via OpenDsec's E2B gateway) against the same
through OpenDsec's own Python SDK, interleaved in one run.

Run by bench/e2b.sh, which starts the system and sets the environment:
OPENDSEC_ENDPOINT, OPENDSEC_TOKEN (OpenDsec SDK), E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY, E2B_NPM_DIR (E2B JS SDK).
"""

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

from opendsec import DSecClient, DSecRunArgs

IMAGE = "root/base"  # what the gateway's "base" template maps to


async def opendsec_once(client):
    t0 = time.perf_counter()
    sbx = await client.run_sandbox(DSecRunArgs(image=IMAGE, labels={"bench": "e2b-opendsec"}))
    t1 = time.perf_counter()
    try:
        r = await sbx.run_shell("echo hi")
        if r.stdout != "hi\n":
            raise RuntimeError(f"echo hi printed {r.stdout!r}")
    finally:
        t2 = time.perf_counter()
        await sbx.stop()
    t3 = time.perf_counter()
    ms = lambda a, b: (b - a) * 1000  # noqa: E731
    return {"create": ms(t0, t1), "run": ms(t1, t2), "kill": ms(t2, t3), "total": ms(t0, t3)}


class JSWorker:
    def __init__(self, path):
        self.p = subprocess.Popen(["node", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def once(self):
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("the JS worker exited")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError("JS worker: " + out["error"])
        return out

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=30)


def pct(xs, p):
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def row(name, xs):
    return f"| {name} | {pct(xs, 50):.1f} | {pct(xs, 95):.1f} | {min(xs):.1f} | {statistics.mean(xs):.1f} | {max(xs):.1f} |"


def machine():
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(open("/proc/meminfo").readline().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    return f"{cpu}, {os.cpu_count()} CPUs, {mem} RAM, Linux {platform.release()}, Python {platform.python_version()}, Node {node}"


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30, help="timed iterations of each (>= 30 for the report)")
    ap.add_argument("-warmup", type=int, default=3)
    ap.add_argument("-out", default="", help="markdown report path")
    ap.add_argument("-command", default="bash bench/e2b.sh")
    ap.add_argument("-versions", default="")
    a = ap.parse_args()
    js = JSWorker(os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.mjs"))
    res = {"e2b-js": [], "opendsec-py": []}
    try:
        async with DSecClient() as client:
            for i in range(a.warmup + a.n):
                # Alternate which goes first so drift and caches hit both.
                order = ["e2b-js", "opendsec-py"] if i % 2 == 0 else ["opendsec-py", "e2b-js"]
                for who in order:
                    r = js.once() if who == "e2b-js" else await opendsec_once(client)
                    if i >= a.warmup:
                        res[who].append(r)
                print(f"\r{i + 1}/{a.warmup + a.n}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        js.close()

    lines = [
        "# E2B JS SDK through OpenDsec's gateway vs OpenDsec's Python SDK",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- Machine: {machine()}",
        f"- Command: `{a.command}`",
        f"- SDKs: {a.versions}",
        f"- Iterations: {a.n} timed of each, after {a.warmup} untimed warm-ups, interleaved (E2B then OpenDsec on even"
        " iterations, the other way round on odd ones); sequential, one sandbox at a time.",
        f"- Workload: create a sandbox of `{IMAGE}` (E2B: `Sandbox.create()`, template `base`; OpenDsec:"
        " `client.run_sandbox(DSecRunArgs(image=...))`), run `echo hi` and check its output (E2B:"
        " `sbx.commands.run`; OpenDsec: `sandbox.run_shell`), kill it (E2B: `sbx.kill()`; OpenDsec: `sandbox.stop()`).",
        "  Both talk to the same throwaway `opendsec up` on loopback (container backend); the E2B path adds the"
        " gateway (REST → OpenDsec API; envd traffic → node → agent).",
        "",
        "Milliseconds, client wall clock. p50/p95 nearest rank.",
        "",
    ]
    for phase in ("total", "create", "run", "kill"):
        lines += [f"### {phase}", "", "| client | p50 | p95 | min | mean | max |", "|---|---|---|---|---|---|"]
        for who in ("e2b-js", "opendsec-py"):
            lines.append(row(who, [r[phase] for r in res[who]]))
        lines.append("")
    e, o = [r["total"] for r in res["e2b-js"]], [r["total"] for r in res["opendsec-py"]]
    lines.append(f"Total p50 ratio E2B JS / OpenDsec Python: {pct(e, 50) / pct(o, 50):.2f}x; p95: {pct(e, 95) / pct(o, 95):.2f}x.")
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    asyncio.run(main())
