"""Live test of a sandbox that dies (issue 11, finding 5): after a kill -9
of its init from the host, the node reports it failed with a reason and
the SDK raises SandboxDiedError on the next call into it. Needs root on the
sandbox's host (the live tests run there)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from opendsec import DSecClient, SandboxDiedError, SandboxState

from live_helpers import run_args


def _init_pid(sandbox_id: str) -> int:
    """The host pid of the sandbox's init: in its cgroup, pid 1 of its namespace."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cg = (d / "cgroup").read_text()
            status = (d / "status").read_text()
        except OSError:
            continue
        if sandbox_id not in cg:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and line.split()[-1] == "1" and len(line.split()) > 2:
                return int(d.name)
    raise AssertionError(f"no init process of sandbox {sandbox_id} on this host")


async def test_security_sandbox_death_raises_sandbox_died(client: DSecClient) -> None:
    if os.geteuid() != 0:
        pytest.fail("this live test kills a sandbox's init from the host: run it as root")
    sb = await client.run_sandbox(run_args(labels={"opendsec-sdk-test": "1"}))
    try:
        assert (await sb.run_shell("echo ok")).stdout == "ok\n"
        os.kill(_init_pid(sb.id), 9)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while (info := await sb.refresh()).state != SandboxState.FAILED:
            assert loop.time() < deadline, f"sandbox still {info.state} 30 s after its init was killed"
            await asyncio.sleep(0.1)  # polling the state, bounded by the deadline
        assert info.reason.startswith("died: "), info.reason
        with pytest.raises(SandboxDiedError) as ei:
            await sb.run_shell("echo again")
        assert ei.value.reason and ei.value.reason == info.reason.removeprefix("died: ")
        assert sb.id in str(ei.value) and "died" in str(ei.value)
    finally:
        try:
            await sb.stop()
        except Exception:
            pass  # it is gone already
