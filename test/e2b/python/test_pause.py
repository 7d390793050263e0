"""Pause, resume (connect), auto-pause and metrics with the unmodified E2B SDK."""

import os
import time

import httpx
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState


def _wait(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.1)


def test_pause_then_connect_resumes_with_memory(sandbox, test_id):
    sandbox.files.write("/tmp/kept.txt", "still here")
    bg = sandbox.commands.run("sleep 3600", background=True)
    sandbox.commands.run("echo started")

    assert sandbox.pause() is True
    assert sandbox.is_running() is False  # envd /health through the gateway: 502
    assert Sandbox.pause(sandbox.sandbox_id) is False  # already paused: 409
    paused = Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": test_id}, state=[SandboxState.PAUSED])).next_items()
    assert [s.sandbox_id for s in paused] == [sandbox.sandbox_id]
    assert paused[0].state == SandboxState.PAUSED
    running = Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": test_id}, state=[SandboxState.RUNNING])).next_items()
    assert running == []
    assert sandbox.get_info().state == SandboxState.PAUSED

    same = Sandbox.connect(sandbox.sandbox_id)
    assert same.sandbox_id == sandbox.sandbox_id
    assert same.is_running()
    assert same.files.read("/tmp/kept.txt") == "still here"
    # Memory kept: the background process is the same one, and the
    # sandbox-wide env is still there.
    assert same.commands.run(f"kill -0 {bg.pid} && echo alive").stdout == "alive\n"
    assert same.commands.run("echo $SBX_WIDE").stdout == "everywhere\n"


def test_traffic_resumes_a_paused_sandbox(sandbox):
    """A command, a file read and a request into a user port each resume a
    paused sandbox without connect; is_running() (/health) does not."""
    sandbox.files.write("/tmp/www/index.html", "hello paused\n")
    sandbox.commands.run("python3 -m http.server 8000 --directory /tmp/www", background=True)
    bg = sandbox.commands.run("sleep 3600", background=True)
    base, host = os.environ["E2B_SANDBOX_URL"], {"Host": sandbox.get_host(8000)}
    _wait(lambda: httpx.get(base + "/index.html", headers=host, timeout=10).status_code == 200, "http.server up")

    assert sandbox.pause() is True
    assert sandbox.is_running() is False  # the probe leaves it paused
    assert sandbox.get_info().state == SandboxState.PAUSED
    assert sandbox.commands.run(f"kill -0 {bg.pid} && echo alive").stdout == "alive\n"
    assert sandbox.get_info().state == SandboxState.RUNNING

    assert sandbox.pause() is True
    assert sandbox.files.read("/tmp/www/index.html") == "hello paused\n"
    assert sandbox.is_running() is True

    assert sandbox.pause() is True
    r = httpx.get(base + "/index.html", headers=host, timeout=30)
    assert r.status_code == 200 and r.text == "hello paused\n", (r.status_code, r.text)
    assert sandbox.get_info().state == SandboxState.RUNNING


def test_get_metrics(sandbox):
    sandbox.commands.run("echo warm")
    metrics = []

    def have():
        metrics[:] = sandbox.get_metrics()
        return len(metrics) > 0

    _wait(have, "a metric")
    m = metrics[-1]
    assert m.cpu_count >= 1
    assert 0 <= m.cpu_used_pct <= 100
    assert 0 < m.mem_used <= m.mem_total
    assert m.disk_total > 0
    assert abs(m.timestamp.timestamp() - time.time()) < 60


def test_auto_pause_on_timeout(test_id):
    sbx = Sandbox.create(timeout=2, metadata={"sandbox_test_id": test_id}, lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/tmp/a.txt", "a")
        _wait(lambda: sbx.get_info().state == SandboxState.PAUSED, "auto-paused after its 2 s timeout")
        again = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert again.files.read("/tmp/a.txt") == "a"
    finally:
        sbx.kill()


async def test_async_pause_and_connect(async_sandbox):
    assert await async_sandbox.pause() is True
    assert await async_sandbox.is_running() is False
    same = await AsyncSandbox.connect(async_sandbox.sandbox_id)
    assert (await same.commands.run("echo back")).stdout == "back\n"
    metrics = await same.get_metrics()
    assert metrics and metrics[0].mem_total > 0
