"""OpenDsec quickstart: run Python in a sandbox and print 6*7.

. /root/opendsec-ops/demo.env      # OPENDSEC_ENDPOINT, OPENDSEC_TOKEN, OPENDSEC_BACKEND
python sdk/python/examples/quickstart.py
"""

import asyncio
import os

from opendsec import DSecClient, DSecRunArgs


async def main() -> None:
    backend = os.environ.get("OPENDSEC_BACKEND", "container")
    async with DSecClient() as client:
        sandbox = await client.run_sandbox(DSecRunArgs(backend=backend, image="root/py:3.11"))
        try:
            result = await sandbox.run_shell("python3 -c 'print(6*7)'")
            print(result.stdout, end="")
        finally:
            await sandbox.stop()


if __name__ == "__main__":
    asyncio.run(main())
