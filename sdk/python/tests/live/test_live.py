"""Live tests of the SDK against a real OpenDsec system (see conftest.py).

Written to the opendsec.v1 contract; each asserts behaviour a user relies on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import time
import uuid

import pytest
from live_helpers import BACKEND, IMAGE, WARM_POOL, run_args

from opendsec import (
    AuthenticationError,
    DSecClient,
    DSecError,
    FileType,
    InvalidArgumentError,
    NotFoundError,
    QuotaExceededError,
    Sandbox,
    SandboxState,
)

pytestmark = pytest.mark.live

HAS_PYTHON = "py" in IMAGE


async def eventually(check, timeout: float = 30.0, interval: float = 0.2):  # type: ignore[no-untyped-def]
    """Poll the async ``check`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    pytest.fail(f"condition not met within {timeout}s (last value {last!r})")


# ---- create and run ----


async def test_run_shell_prints_42(sandbox: Sandbox) -> None:
    cmd = "python3 -c 'print(6*7)'" if HAS_PYTHON else "echo $((6*7))"
    r = await sandbox.run_shell(cmd, timeout=60)
    assert (r.stdout, r.exit_code) == ("42\n", 0), r
    info = sandbox.info
    assert re.fullmatch(r"[a-z0-9]+", sandbox.id)
    assert info.state is SandboxState.RUNNING
    assert info.node_id
    assert info.expires_at is not None and info.expires_at > dt.datetime.now(dt.UTC)
    assert info.spec.image == IMAGE


async def test_warm_pool_flags(client: DSecClient) -> None:
    # Holds whether or not the node keeps a warm pool: a create reports where
    # its sandbox came from, and skip_warm_pool always gives a cold one.
    default = await client.run_sandbox(run_args(labels={"opendsec-sdk-test": "1"}))
    try:
        assert isinstance(default.from_warm_pool, bool)
        assert (await default.run_shell("echo ok")).stdout == "ok\n"
    finally:
        await default.stop()
    cold = await client.run_sandbox(run_args(labels={"opendsec-sdk-test": "1"}, skip_warm_pool=True))
    try:
        assert cold.from_warm_pool is False
        assert (await cold.run_shell("echo ok")).stdout == "ok\n"
    finally:
        await cold.stop()


@pytest.mark.skipif(not WARM_POOL, reason="OPENDSEC_TEST_WARM_POOL=0: the nodes keep no warm pool")
@pytest.mark.skipif(BACKEND not in ("", "container"), reason="only container sandboxes are prestarted")
async def test_repeated_shape_comes_from_the_warm_pool(client: DSecClient) -> None:
    # The shape of most live tests: after two creates of it the node keeps
    # prestarted sandboxes, so a create soon takes one. Its caller's env and
    # labels apply, and it runs commands like any other.
    tag = uuid.uuid4().hex[:10]

    async def create_warm() -> Sandbox | None:
        sb = await client.run_sandbox(run_args(labels={"opendsec-sdk-test": "1", "warm": tag}, env={"WARM": tag}))
        if sb.from_warm_pool:
            return sb
        await sb.stop()
        return None

    sb = await eventually(create_warm, timeout=60, interval=0.5)
    try:
        assert re.fullmatch(r"[a-z0-9]+", sb.id)
        assert sb.info.spec.labels["warm"] == tag
        assert (await sb.run_shell("echo $WARM")).stdout == f"{tag}\n"
        got = await client.get_sandbox(sb.id)
        assert got.from_warm_pool is True
        assert [s.id for s in await client.list_sandboxes(labels={"warm": tag})] == [sb.id]
    finally:
        await sb.stop()


async def test_env_cwd_user(client: DSecClient) -> None:
    async with await client.run_sandbox(run_args(env={"SPEC_VAR": "from-spec"})) as sb:
        r = await sb.run_shell('echo "$SPEC_VAR $FOO"; pwd; id -u', env={"FOO": "bar"}, cwd="/tmp", user="root")
        assert r.stdout == "from-spec bar\n/tmp\n0\n", r
        r = await sb.run_shell("id -u; id -un", user="user")
        assert r.stdout == "1000\nuser\n", r


async def test_nonzero_exit_and_stderr(sandbox: Sandbox) -> None:
    r = await sandbox.run_shell("echo out; echo err >&2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("out\n", "err\n", 7, False)


async def test_stdin(sandbox: Sandbox) -> None:
    r = await sandbox.run_shell("cat", stdin="hello\nworld\n")
    assert r.stdout == "hello\nworld\n"
    data = bytes(range(256)) * 1000
    r = await sandbox.run_shell("wc -c", stdin=data)
    assert r.stdout.strip() == str(len(data))


async def test_streaming_exec(sandbox: Sandbox) -> None:
    # Both directions stream: each line comes back before stdin is closed.
    async with sandbox.exec("cat", stdin=True) as proc:
        assert proc.pid > 0
        it = proc.__aiter__()
        for line in ("a\n", "b\n", "c\n"):
            await proc.send_stdin(line)
            ev = await asyncio.wait_for(it.__anext__(), 15)
            assert (ev.stream, ev.text) == ("stdout", line)
        await proc.close_stdin()
        r = await asyncio.wait_for(proc.wait(), 15)
    # What the caller iterated is not kept again, only counted.
    assert (r.exit_code, r.stdout, r.stdout_total) == (0, "", 6)

    proc = await sandbox.exec("for i in 1 2 3 4 5; do echo $i; echo e$i >&2; done")
    out = [e.text async for e in proc if e.stream == "stdout"]
    r = await proc.wait()
    assert "".join(out) == "1\n2\n3\n4\n5\n"
    assert (r.stdout, r.stdout_total, r.stderr, r.stderr_total) == ("", 10, "", 15)

    # Without iterating, wait() keeps the output (up to the limit).
    proc = await sandbox.exec("for i in 1 2 3; do echo $i; echo e$i >&2; done")
    r = await proc.wait()
    assert (r.stdout, r.stderr) == ("1\n2\n3\n", "e1\ne2\ne3\n")


async def test_signal(sandbox: Sandbox) -> None:
    proc = await sandbox.exec(["sleep", "300"], tag="sleeper")
    procs = await sandbox.processes()
    assert any(p.pid == proc.pid and p.tag == "sleeper" for p in procs), procs
    await proc.signal(15)
    r = await asyncio.wait_for(proc.wait(), 15)
    assert r.exit_code != 0 and "signal" in r.status, r


async def test_process_timeout(sandbox: Sandbox) -> None:
    start = time.monotonic()
    r = await sandbox.run_shell("sleep 300", timeout=1)
    took = time.monotonic() - start
    assert r.timed_out and r.exit_code != 0, r
    assert took < 10, f"a 1 s process timeout took {took:.1f}s to end the process"


async def test_pty(sandbox: Sandbox) -> None:
    async with sandbox.exec(["sh", "-c", "stty size"], pty=(100, 30)) as proc:
        r = await asyncio.wait_for(proc.wait(), 15)
    assert "30 100" in r.stdout, r


# ---- files ----


async def test_files_round_trip(sandbox: Sandbox) -> None:
    f = sandbox.files
    base = f"/tmp/sdk-{uuid.uuid4().hex[:8]}"
    assert await f.make_dir(base) is True
    assert await f.make_dir(base) is False
    info = await f.write(f"{base}/hello.txt", "héllo\n")
    assert info.size == len("héllo\n".encode())
    assert await f.read_text(f"{base}/hello.txt") == "héllo\n"
    r = await sandbox.run_shell(f"cat {base}/hello.txt")
    assert r.stdout == "héllo\n"

    st = await f.stat(f"{base}/hello.txt")
    assert (st.type, st.size, st.name) == (FileType.FILE, 7, "hello.txt")
    assert (await f.stat(base)).is_dir

    await f.make_dir(f"{base}/sub")
    names = sorted(e.name for e in await f.list(base))
    assert names == ["hello.txt", "sub"]

    moved = await f.move(f"{base}/hello.txt", f"{base}/sub/moved.txt")
    assert moved.path == f"{base}/sub/moved.txt"
    assert not await f.exists(f"{base}/hello.txt")
    assert await f.read_text(f"{base}/sub/moved.txt") == "héllo\n"
    deep = {e.path for e in await f.list(base, depth=2)}
    assert f"{base}/sub/moved.txt" in deep

    await f.remove(f"{base}/sub/moved.txt")
    with pytest.raises(NotFoundError):
        await f.stat(f"{base}/sub/moved.txt")
    await f.remove(base)
    assert not await f.exists(base)


async def test_files_5mib_binary(sandbox: Sandbox) -> None:
    data = os.urandom(5 * 1024 * 1024 + 123)
    path = "/tmp/blob.bin"
    info = await sandbox.files.write(path, data)
    assert info.size == len(data)
    assert await sandbox.files.read(path) == data
    assert (await sandbox.files.stat(path)).size == len(data)
    r = await sandbox.run_shell(f"wc -c < {path}")
    assert r.stdout.strip() == str(len(data))


async def test_upload_above_the_limit_is_refused_up_front(sandbox: Sandbox) -> None:
    with pytest.raises(QuotaExceededError) as ei:
        await sandbox.files.write_stream("/tmp/huge.bin", [], size=2 << 30)
    assert "size:" in str(ei.value) and "upload limit" in str(ei.value) and "node.max_upload_mb" in str(ei.value)
    assert not await sandbox.files.exists("/tmp/huge.bin")


async def test_write_stream(sandbox: Sandbox) -> None:
    async def chunks():  # type: ignore[no-untyped-def]
        for i in range(3):
            yield bytes([i]) * (1024 * 1024 + 7)

    info = await sandbox.files.write_stream("/tmp/streamed.bin", chunks(), size=3 * (1024 * 1024 + 7))
    assert info.size == 3 * (1024 * 1024 + 7)
    data = await sandbox.files.read("/tmp/streamed.bin")
    assert data == b"".join(bytes([i]) * (1024 * 1024 + 7) for i in range(3))


async def test_missing_path_is_not_found(sandbox: Sandbox) -> None:
    with pytest.raises(NotFoundError):
        await sandbox.files.read("/definitely/not/here")
    with pytest.raises(NotFoundError):
        await sandbox.files.stat("/definitely/not/here")
    with pytest.raises(NotFoundError):
        await sandbox.files.list("/definitely/not/here")


# ---- errors ----


async def test_unknown_image(client: DSecClient) -> None:
    with pytest.raises((InvalidArgumentError, NotFoundError)) as ei:
        await client.run_sandbox(run_args(image=f"root/no-such-image-{uuid.uuid4().hex[:6]}"))
    assert "image" in str(ei.value)


async def test_bad_resources(client: DSecClient) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        await client.run_sandbox(run_args(memory_mb=-1))
    assert "memory" in str(ei.value)
    with pytest.raises(InvalidArgumentError) as ei0:
        await client.run_sandbox(run_args(memory_mb=0))
    assert "memory_mb" in str(ei0.value)
    with pytest.raises((InvalidArgumentError, QuotaExceededError)) as ei2:
        await client.run_sandbox(run_args(memory_mb=1 << 40))
    assert "memory" in str(ei2.value)
    with pytest.raises(InvalidArgumentError) as ei3:
        await client.run_sandbox(run_args(timeout=-5))
    assert "timeout" in str(ei3.value)


async def test_empty_command(sandbox: Sandbox) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        await sandbox.exec([])
    assert "command" in str(ei.value)


async def test_bad_token(client: DSecClient) -> None:
    async with DSecClient(client.endpoint, "not-a-real-token") as bad:
        with pytest.raises(AuthenticationError):
            await bad.list_sandboxes()
        with pytest.raises(AuthenticationError):
            await bad.run_sandbox(run_args())


async def test_unknown_sandbox(client: DSecClient) -> None:
    with pytest.raises((NotFoundError, InvalidArgumentError)):
        await client.get_sandbox("nosuchsandbox0000")


# ---- lifecycle ----


async def test_list_by_labels_and_task(client: DSecClient) -> None:
    tag = uuid.uuid4().hex[:10]
    a = await client.run_sandbox(run_args(labels={"sdk-run": tag, "role": "a"}, task_id=f"task-{tag}"))
    b = await client.run_sandbox(run_args(labels={"sdk-run": tag, "role": "b"}))
    try:
        both = {s.id for s in await client.list_sandboxes(labels={"sdk-run": tag})}
        assert both == {a.id, b.id}
        only_a = [s.id for s in await client.list_sandboxes(labels={"sdk-run": tag, "role": "a"})]
        assert only_a == [a.id]
        by_task = [s.id for s in await client.list_sandboxes(task_id=f"task-{tag}")]
        assert by_task == [a.id]
    finally:
        await a.stop()
        await b.stop()


async def test_batch_create(client: DSecClient) -> None:
    tag = uuid.uuid4().hex[:10]
    items = await client.run_sandboxes(run_args(labels={"sdk-batch": tag}), 3)
    try:
        assert [i.index for i in items] == [0, 1, 2]
        assert all(i.ok for i in items), [i.error for i in items]
        ids = {i.sandbox.id for i in items if i.sandbox}
        assert len(ids) == 3
        for i in items:
            assert i.sandbox is not None
            r = await i.sandbox.run_shell("echo ok")
            assert r.stdout == "ok\n"
    finally:
        for i in items:
            if i.sandbox is not None:
                await i.sandbox.stop()


async def test_concurrent_creates_and_execs(client: DSecClient) -> None:
    # Small sandboxes, so this checks concurrency rather than node capacity.
    tag = uuid.uuid4().hex[:10]
    args = run_args(cpu=0.1, memory_mb=64, labels={"sdk-conc": tag})
    results = await asyncio.gather(*(client.run_sandbox(args) for _ in range(20)), return_exceptions=True)
    sandboxes = [r for r in results if isinstance(r, Sandbox)]
    try:
        errors = [r for r in results if not isinstance(r, Sandbox)]
        assert not errors, errors
        assert len({s.id for s in sandboxes}) == 20
        outs = await asyncio.gather(*(s.run_shell(f"echo {s.id}") for s in sandboxes))
        assert [o.stdout for o in outs] == [f"{s.id}\n" for s in sandboxes]
    finally:
        await asyncio.gather(*(s.stop() for s in sandboxes), return_exceptions=True)


async def test_create_is_idempotent(client: DSecClient) -> None:
    rid = uuid.uuid4().hex
    a = await client.run_sandbox(run_args(), request_id=rid)
    try:
        b = await client.run_sandbox(run_args(), request_id=rid)
        assert a.id == b.id
    finally:
        await a.stop()


async def test_set_timeout(sandbox: Sandbox) -> None:
    info = await sandbox.set_timeout(1200)
    assert info.expires_at is not None
    left = (info.expires_at - dt.datetime.now(dt.UTC)).total_seconds()
    assert 1100 < left <= 1260, left


async def test_lifetime_timeout_stops_the_sandbox(client: DSecClient) -> None:
    sb = await client.run_sandbox(run_args(timeout=2))

    async def gone() -> bool:
        try:
            info = await sb.refresh()
        except NotFoundError:
            return True
        return info.state in (SandboxState.STOPPED, SandboxState.FAILED)

    await eventually(gone, timeout=60)


async def test_idle_timeout_stops_the_sandbox(client: DSecClient) -> None:
    sb = await client.run_sandbox(run_args(idle_timeout=2, timeout=600))
    r = await sb.run_shell("echo busy")
    assert r.stdout == "busy\n"

    async def gone() -> bool:
        try:
            info = await sb.refresh()  # not exec/file/port traffic: does not count as activity
        except NotFoundError:
            return True
        return info.state in (SandboxState.STOPPED, SandboxState.FAILED)

    await eventually(gone, timeout=60)


async def test_stop_then_get(client: DSecClient) -> None:
    sb = await client.run_sandbox(run_args())
    await sb.stop()
    try:
        got = await client.get_sandbox(sb.id)
        assert got.info.state in (SandboxState.STOPPED, SandboxState.STOPPING), got.info
    except NotFoundError:
        pass
    with pytest.raises(DSecError):
        await sb.run_shell("echo still here")


async def test_http_into_a_port(sandbox: Sandbox) -> None:
    await sandbox.files.write("/tmp/www/index.html", "hello from the sandbox\n")
    if HAS_PYTHON:
        server = "cd /tmp/www && exec python3 -m http.server 8080 --bind 127.0.0.1"
    else:
        server = "exec httpd -f -p 127.0.0.1:8080 -h /tmp/www"
    proc = await sandbox.exec(server)
    try:

        async def up() -> object:
            try:
                resp = await sandbox.http(8080, path="/index.html", timeout=5)
            except DSecError:
                return None
            return resp if resp.status == 200 else None

        resp = await eventually(up, timeout=30)
        assert resp.text == "hello from the sandbox\n"
    finally:
        await proc.close()


# ---- network policy ----


async def test_network_bad_rule_is_refused_with_the_field(client: DSecClient) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        await client.run_sandbox(
            run_args(labels={"opendsec-sdk-test": "1"}, network=[{"cidr": "10.0.0.300/8", "ports": "443"}])
        )
    assert ei.value.field.startswith("network"), ei.value


async def test_set_network_on_a_running_sandbox(sandbox: Sandbox) -> None:
    info = await sandbox.set_network([{"cidr": "192.0.2.0/24", "protocol": "tcp", "ports": "443"}])
    assert info.state is SandboxState.RUNNING
    r = await sandbox.run_shell("echo still-here", timeout=30)
    assert r.stdout == "still-here\n", r
    with pytest.raises(InvalidArgumentError) as ei:
        await sandbox.set_network([{"domain": "pypi.org", "ports": "99999"}])
    assert ei.value.field.startswith("network"), ei.value
    await sandbox.set_network(None)
