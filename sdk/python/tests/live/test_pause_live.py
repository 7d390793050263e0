"""Live tests of pause, resume, metrics and batch pause (see conftest.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from live_helpers import run_args

from opendsec import DSecClient, FailedPreconditionError, Sandbox, SandboxState

COUNTER = "(i=0; while :; do i=$((i+1)); echo $i > /c.tmp && mv /c.tmp /c; sleep 0.02; done) >/dev/null 2>&1 &"


async def _count(sb: Sandbox) -> int:
    r = await sb.run_shell("cat /c", timeout=10)
    assert r.exit_code == 0, r
    return int(r.stdout)


async def _count_at_least(sb: Sandbox, n: int) -> int:
    deadline = time.monotonic() + 10
    while True:
        r = await sb.run_shell("cat /c 2>/dev/null || echo 0", timeout=10)
        if int(r.stdout or 0) >= n:
            return int(r.stdout)
        assert time.monotonic() < deadline, f"counter stuck below {n}: {r.stdout!r}"
        await asyncio.sleep(0.02)


async def test_pause_freezes_and_resume_continues(sandbox: Sandbox) -> None:
    await sandbox.run_shell(COUNTER, timeout=10)
    before = await _count_at_least(sandbox, 1)
    info = await sandbox.pause()
    assert info.state is SandboxState.PAUSED
    assert (await sandbox.pause()).state is SandboxState.PAUSED  # idempotent
    with pytest.raises(FailedPreconditionError, match="paused"):
        await sandbox.run_shell("true", timeout=10)
    m = await sandbox.metrics()
    assert m.state is SandboxState.PAUSED and m.mem_used > 0 and m.pids >= 2
    await asyncio.sleep(1)  # a running counter would advance by ~50 meanwhile
    assert (await sandbox.refresh()).state is SandboxState.PAUSED
    await sandbox.resume()
    after = await _count(sandbox)
    assert after - before < 25, f"counter went {before} -> {after} across a 1 s pause"
    await _count_at_least(sandbox, after + 5)
    m = await sandbox.metrics()
    assert m.state is SandboxState.RUNNING and m.mem_total > 0 and m.cpu_usage_ns > 0


async def test_batch_pause_by_task_id(client: DSecClient) -> None:
    task = "pause-" + uuid.uuid4().hex[:8]
    sbs = await asyncio.gather(*(client.run_sandbox(run_args(task_id=task)) for _ in range(3)))
    try:
        out = await client.pause_sandboxes(task_id=task)
        assert out.ok, out.failures
        assert sorted(s.id for s in out.sandboxes) == sorted(s.id for s in sbs)
        for sb in sbs:
            assert (await sb.refresh()).state is SandboxState.PAUSED
        out = await client.resume_sandboxes(task_id=task)
        assert out.ok and len(out.sandboxes) == 3
        for sb in sbs:
            assert (await sb.run_shell("echo ok", timeout=10)).stdout == "ok\n"
    finally:
        await asyncio.gather(*(sb.stop() for sb in sbs), return_exceptions=True)


async def test_stop_a_paused_sandbox(client: DSecClient) -> None:
    sb = await client.run_sandbox(run_args())
    await sb.pause()
    await sb.stop()
    assert [s.id for s in await client.list_sandboxes(task_id="") if s.id == sb.id] == []
