"""Live tests of pause, resume, metrics and batch pause (see conftest.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from live_helpers import run_args

from opendsec import DSecClient, InvalidArgumentError, NotFoundError, Sandbox, SandboxState

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
    m = await sandbox.metrics()  # metrics do not resume it
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


async def test_calls_resume_a_paused_sandbox(sandbox: Sandbox) -> None:
    """run_shell, a file read and an HTTP request into a port each resume a
    paused sandbox without an explicit resume; its processes carry on."""
    await sandbox.files.write("/tmp/www/index.html", "hello paused\n")
    r = await sandbox.run_shell("httpd -p 0.0.0.0:8000 -h /tmp/www", timeout=10)  # daemonizes
    assert r.exit_code == 0, r
    await sandbox.run_shell(COUNTER, timeout=10)
    before = await _count_at_least(sandbox, 1)

    await sandbox.pause()
    assert (await sandbox.run_shell("echo ok", timeout=10)).stdout == "ok\n"
    assert (await sandbox.refresh()).state is SandboxState.RUNNING
    after = await _count(sandbox)
    assert before <= after < before + 25, f"counter went {before} -> {after}"

    await sandbox.pause()
    assert await sandbox.files.read("/tmp/www/index.html") == b"hello paused\n"
    assert (await sandbox.refresh()).state is SandboxState.RUNNING

    await sandbox.pause()
    resp = await sandbox.http(8000, path="/index.html", timeout=10)
    assert resp.status == 200 and resp.body == b"hello paused\n", resp
    assert (await sandbox.refresh()).state is SandboxState.RUNNING

    # Calls at once share one resume; all are answered.
    await sandbox.pause()
    outs = await asyncio.gather(*(sandbox.run_shell(f"echo {i}", timeout=10) for i in range(10)))
    assert [o.stdout for o in outs] == [f"{i}\n" for i in range(10)]
    await _count_at_least(sandbox, after + 5)


async def test_on_timeout_pause_and_set_timeout_while_paused(client: DSecClient) -> None:
    """on_timeout="pause" pauses at the lifetime's end; set_timeout on the
    paused sandbox sets the lifetime it resumes with; a call resumes it."""
    sb = await client.run_sandbox(run_args(timeout=1, on_timeout="pause"))
    try:
        assert sb.info.spec.on_timeout == "pause" and sb.info.spec.auto_pause
        await sb.files.write("/f", "kept")
        deadline = time.monotonic() + 15
        while (await sb.refresh()).state is not SandboxState.PAUSED:
            assert time.monotonic() < deadline, "not paused 15 s after a 1 s lifetime"
            await asyncio.sleep(0.05)
        info = await sb.set_timeout(120)
        assert info.state is SandboxState.PAUSED
        assert await sb.files.read("/f") == b"kept"
        info = await sb.refresh()
        left = info.expires_at.timestamp() - time.time()
        assert info.state is SandboxState.RUNNING and 100 < left <= 121, (info.state, left)
    finally:
        await sb.stop()


async def test_on_timeout_contradicting_auto_pause_is_refused(client: DSecClient) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        await client.run_sandbox(run_args(on_timeout="stop", auto_pause=True))
    assert e.value.field == "on_timeout"
    with pytest.raises(InvalidArgumentError) as e:
        await client.run_sandbox(run_args(on_timeout="hibernate"))
    assert e.value.field == "on_timeout"


async def test_pause_task_with_reclaim(client: DSecClient) -> None:
    task = "reclaim-" + uuid.uuid4().hex[:8]
    sbs = await asyncio.gather(*(client.run_sandbox(run_args(task_id=task)) for _ in range(3)))
    try:
        for sb in sbs:
            await sb.run_shell(COUNTER, timeout=10)
        before = {sb.id: await _count_at_least(sb, 1) for sb in sbs}
        out = await client.pause_task(task)
        assert out.ok, out.failures
        assert sorted(r.sandbox_id for r in out.reclaimed) == sorted(s.id for s in sbs)
        assert out.bytes_freed == sum(r.bytes_freed for r in out.reclaimed)
        for r in out.reclaimed:
            assert r.bytes_before > 0 and r.bytes_after <= r.bytes_before and r.bytes_freed == r.bytes_before - r.bytes_after
        out = await client.resume_task(task)
        assert out.ok and len(out.sandboxes) == 3
        for sb in sbs:
            assert await _count(sb) >= before[sb.id]  # the same process counts on
        with pytest.raises(NotFoundError, match=task + "-none"):
            await client.pause_task(task + "-none")
    finally:
        await asyncio.gather(*(sb.stop() for sb in sbs), return_exceptions=True)
