"""OpenDsec fork: run Python in a sandbox, then fork it into four and run in each.

. /root/opendsec-ops/demo.env      # OPENDSEC_ENDPOINT, OPENDSEC_TOKEN, OPENDSEC_BACKEND
python sdk/python/examples/fork.py

On the container backend a fork has its source's files, not its memory: each
fork's processes start again (memory_preserved is False). Memory forks need
the VM backends or gvisor (OPENDSEC_BACKEND=gvisor: runsc checkpoints the
source and every fork restores it, memory_preserved is True).
"""

import asyncio
import os

from opendsec import DSecClient, DSecRunArgs


async def main() -> None:
    backend = os.environ.get("OPENDSEC_BACKEND", "container")
    async with DSecClient() as client:
        sb = await client.run_sandbox(DSecRunArgs(backend=backend, image="root/py:3.11"))
        forks = []
        try:
            # The answer goes to a file too: forks copy files (the root
            # filesystem's writable layer; /tmp is a tmpfs and is not copied).
            result = await sb.run_shell("python3 -c 'print(6*7)' | tee ~/answer.txt")
            print(result.stdout, end="")
            forks = await sb.fork(count=4)
            outs = await asyncio.gather(
                *(f.run_shell(f"cd && python3 -c 'print(int(open(\"answer.txt\").read()) + {i})'") for i, f in enumerate(forks))
            )
            for f, out in zip(forks, outs, strict=True):
                print(f"fork {f.id}: {out.stdout.strip()} (memory_preserved={f.memory_preserved})")
        finally:
            await asyncio.gather(*(s.stop() for s in [*forks, sb]))


if __name__ == "__main__":
    asyncio.run(main())
