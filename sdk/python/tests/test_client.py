"""Unit tests of the SDK against the in-process fake server."""

from __future__ import annotations

import builtins
import datetime as dt
import json
import uuid

import grpc
import pytest
from fake_server import GOOD_TOKEN, FakeServer

import opendsec
import opendsec.sandbox
from opendsec import (
    CHUNK_SIZE,
    AuthenticationError,
    ConfigError,
    DSecClient,
    DSecError,
    DSecRunArgs,
    FailedPreconditionError,
    FileType,
    InvalidArgumentError,
    NotFoundError,
    QuotaExceededError,
    SandboxState,
    UnavailableError,
)
from opendsec import errors as E
from opendsec._conn import parse_endpoint

# ---- configuration ----


def test_missing_endpoint_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENDSEC_ENDPOINT", raising=False)
    monkeypatch.setenv("OPENDSEC_TOKEN", "t")
    with pytest.raises(ConfigError, match="OPENDSEC_ENDPOINT"):
        DSecClient()


def test_missing_token_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENDSEC_ENDPOINT", "127.0.0.1:1")
    monkeypatch.delenv("OPENDSEC_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="OPENDSEC_TOKEN"):
        DSecClient()


@pytest.mark.parametrize(
    ("endpoint", "target", "tls"),
    [
        ("127.0.0.1:7070", "127.0.0.1:7070", False),
        ("http://127.0.0.1:7070", "127.0.0.1:7070", False),
        ("http://127.0.0.1:7070/", "127.0.0.1:7070", False),
        ("https://api.example:8443", "api.example:8443", True),
        ("https://api.example", "api.example:443", True),
        ("http://[::1]:7070", "[::1]:7070", False),
        ("unix:///run/opendsec.sock", "unix:///run/opendsec.sock", False),
    ],
)
def test_parse_endpoint(endpoint: str, target: str, tls: bool) -> None:
    assert parse_endpoint(endpoint) == (target, tls)


@pytest.mark.parametrize("endpoint", ["127.0.0.1", "ftp://h:1", "http://h:1/api", "http://:7070", "h:1/x"])
def test_parse_endpoint_rejects(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="endpoint"):
        parse_endpoint(endpoint)


async def test_endpoint_and_token_from_env(fake: tuple[FakeServer, int], monkeypatch: pytest.MonkeyPatch) -> None:
    server, port = fake
    monkeypatch.setenv("OPENDSEC_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OPENDSEC_TOKEN", GOOD_TOKEN)
    async with DSecClient() as c:
        sb = await c.run_sandbox(DSecRunArgs(image="root/busybox"))
    assert sb.id in server.sandboxes


# ---- metadata ----


async def test_token_sent_on_every_kind_of_call(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))  # unary
    await sb.files.write("/tmp/f", b"x")  # client stream
    await sb.files.read("/tmp/f")  # server stream
    await sb.run_shell("describe")  # bidi stream
    async for _ in client.run_sandboxes(DSecRunArgs(), 1):  # server stream
        pass
    methods = {m for m, _ in server.auth}
    assert methods == {"CreateSandbox", "WriteFile", "ReadFile", "Exec", "BatchCreateSandboxes"}
    assert all(v == f"Bearer {GOOD_TOKEN}" for _, v in server.auth)


async def test_bad_token_is_authentication_error(fake: tuple[FakeServer, int]) -> None:
    _, port = fake
    async with DSecClient(f"127.0.0.1:{port}", "wrong") as c:
        with pytest.raises(AuthenticationError) as ei:
            await c.list_sandboxes()
    assert "token" in str(ei.value)
    assert ei.value.code == "UNAUTHENTICATED"


# ---- error mapping ----


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("INVALID_ARGUMENT", E.InvalidArgumentError),
        ("OUT_OF_RANGE", E.InvalidArgumentError),
        ("NOT_FOUND", E.NotFoundError),
        ("ALREADY_EXISTS", E.AlreadyExistsError),
        ("FAILED_PRECONDITION", E.FailedPreconditionError),
        ("ABORTED", E.FailedPreconditionError),
        ("RESOURCE_EXHAUSTED", E.QuotaExceededError),
        ("UNAVAILABLE", E.UnavailableError),
        ("DEADLINE_EXCEEDED", E.TimeoutError),
        ("UNAUTHENTICATED", E.AuthenticationError),
        ("PERMISSION_DENIED", E.PermissionDeniedError),
        ("UNIMPLEMENTED", E.UnimplementedError),
        ("CANCELLED", E.CancelledError),
        ("INTERNAL", E.InternalError),
        ("UNKNOWN", E.InternalError),
        ("DATA_LOSS", E.InternalError),
    ],
)
async def test_every_status_code_is_mapped(client: DSecClient, code: str, cls: type[DSecError]) -> None:
    with pytest.raises(cls) as ei:
        await client.get_sandbox(f"err-{code}")
    assert type(ei.value) is cls
    assert str(ei.value) == f"server says {code}"
    assert ei.value.code == code


async def test_security_sandbox_died_is_its_own_error(client: DSecClient) -> None:
    # The server marks a call into a dead sandbox with metadata: a
    # FailedPreconditionError subclass carrying the reason.
    with pytest.raises(opendsec.SandboxDiedError) as ei:
        await client.get_sandbox("died-x")
    assert isinstance(ei.value, FailedPreconditionError)
    assert ei.value.reason == "killed by signal 9" and ei.value.code == "FAILED_PRECONDITION"
    assert str(ei.value) == "sandbox died-x died: killed by signal 9; create a new one"
    # Without the metadata a failed precondition stays what it was.
    with pytest.raises(FailedPreconditionError) as ei2:
        await client.get_sandbox("err-FAILED_PRECONDITION")
    assert type(ei2.value) is FailedPreconditionError


def test_timeout_error_is_also_builtin_timeout() -> None:
    assert issubclass(E.TimeoutError, builtins.TimeoutError)
    assert issubclass(E.TimeoutError, DSecError)
    assert opendsec.TimeoutError is E.TimeoutError is opendsec.DSecTimeoutError
    assert "TimeoutError" not in opendsec.__all__


async def test_invalid_argument_names_the_field(client: DSecClient) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        await client.run_sandbox(DSecRunArgs(image="bad"))
    assert ei.value.field == "image"
    assert "not a known image" in str(ei.value)


def test_code_names_from_batch_items() -> None:
    assert isinstance(E.from_code_name("not_found", "m"), E.NotFoundError)
    assert isinstance(E.from_code_name("canceled", "m"), E.CancelledError)
    assert isinstance(E.from_code_name("RESOURCE_EXHAUSTED", "m"), E.QuotaExceededError)
    err = E.from_code_name("made_up", "")
    assert isinstance(err, E.InternalError) and "MADE_UP" in str(err)


# ---- create, retries, request_id ----


async def test_create_maps_spec_and_info(client: DSecClient, server: FakeServer) -> None:
    args = DSecRunArgs(
        backend="container",
        image="root/py:3.11",
        cpu=0.5,
        memory_mb=256,
        timeout=120,
        idle_timeout=30.5,  # type: ignore[arg-type]
        env={"A": "1"},
        user="nobody",
        labels={"exp": "e1"},
        task_id="t1",
        pids_limit=64,
        workdir="/w",
        disk_mb=2048,
    )
    sb = await client.run_sandbox(args)
    spec = server.create_requests[0].spec
    assert (spec.backend, spec.image, spec.cpu, spec.memory_mb) == ("container", "root/py:3.11", 0.5, 256)
    assert (spec.timeout_seconds, spec.idle_timeout_seconds, spec.pids_limit) == (120, 31, 64)
    assert dict(spec.env) == {"A": "1"} and dict(spec.labels) == {"exp": "e1"}
    assert (spec.user, spec.task_id, spec.workdir, spec.disk_mb) == ("nobody", "t1", "/w", 2048)
    assert sb.info.spec.disk_mb == 2048
    assert sb.info.state is SandboxState.RUNNING
    assert sb.info.node_id == "node1"
    assert sb.info.created_at == dt.datetime.fromtimestamp(1_700_000_000, dt.UTC)
    assert sb.info.spec.labels == {"exp": "e1"}
    assert sb.info.last_activity_at is None


async def test_create_retries_unavailable_with_same_request_id(client: DSecClient, server: FakeServer) -> None:
    server.create_failures = [(grpc.StatusCode.UNAVAILABLE, "node restarting")] * 2
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    ids = [r.request_id for r in server.create_requests]
    assert len(ids) == 3
    assert len(set(ids)) == 1
    uuid.UUID(ids[0])  # a real uuid
    assert sb.id in server.sandboxes


async def test_create_gives_up_after_max_retries(fake: tuple[FakeServer, int]) -> None:
    server, port = fake
    server.create_failures = [(grpc.StatusCode.UNAVAILABLE, "no node is healthy")] * 10
    async with DSecClient(f"127.0.0.1:{port}", GOOD_TOKEN, max_retries=2, retry_backoff=0.001) as c:
        with pytest.raises(UnavailableError, match="no node is healthy"):
            await c.run_sandbox(DSecRunArgs(image="root/busybox"))
    assert len(server.create_requests) == 3


async def test_create_does_not_retry_other_errors(client: DSecClient, server: FakeServer) -> None:
    server.create_failures = [(grpc.StatusCode.RESOURCE_EXHAUSTED, "sandboxes: quota of 10 reached")]
    with pytest.raises(QuotaExceededError, match="quota"):
        await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    assert len(server.create_requests) == 1


async def test_each_create_gets_a_new_request_id(client: DSecClient, server: FakeServer) -> None:
    await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    await client.run_sandbox(DSecRunArgs(image="root/busybox"), request_id="mine")
    ids = [r.request_id for r in server.create_requests]
    assert ids[0] != ids[1] and ids[2] == "mine"


async def test_unreachable_server_is_unavailable() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    async with DSecClient(f"127.0.0.1:{port}", "t", timeout=5, max_retries=1, retry_backoff=0.001) as c:
        with pytest.raises(UnavailableError):
            await c.list_sandboxes()


# ---- batch ----


async def test_batch_streams_items_with_typed_errors(client: DSecClient, server: FakeServer) -> None:
    run = client.run_sandboxes(DSecRunArgs(image="root/busybox"), 5, request_id="batch1")
    seen = [item async for item in run]
    assert [i.index for i in seen] == [4, 3, 2, 1, 0]  # as the server finished them
    assert server.batch_requests[0].count == 5 and server.batch_requests[0].request_id == "batch1"
    failed = [i for i in seen if not i.ok]
    assert [i.index for i in failed] == [4, 1]
    assert all(isinstance(i.error, QuotaExceededError) and "capacity" in str(i.error) for i in failed)
    assert all(i.sandbox is not None and i.sandbox.id == f"b{i.index}" for i in seen if i.ok)


async def test_batch_await_collects_sorted_and_retries_before_first_item(
    client: DSecClient, server: FakeServer
) -> None:
    server.batch_failures = [(grpc.StatusCode.UNAVAILABLE, "apiserver starting")]
    items = await client.run_sandboxes(DSecRunArgs(image="root/busybox"), 3)
    assert [i.index for i in items] == [0, 1, 2]
    assert len(server.batch_requests) == 2
    assert server.batch_requests[0].request_id == server.batch_requests[1].request_id


async def test_batch_resumes_after_a_cut_stream_without_duplicates(client: DSecClient, server: FakeServer) -> None:
    server.batch_cut_after = 4
    seen = [item async for item in client.run_sandboxes(DSecRunArgs(image="root/busybox"), 10, request_id="cut1")]
    assert sorted(i.index for i in seen) == list(range(10))  # each index once
    assert len(server.batch_requests) == 2
    assert all(r.request_id == "cut1" for r in server.batch_requests)
    ids = [i.sandbox.id for i in seen if i.ok]
    assert len(ids) == len(set(ids)) == 7 and len(server.batch_made) == 7


# ---- get, list, stop, timeout ----


async def test_get_list_stop(client: DSecClient, server: FakeServer) -> None:
    a = await client.run_sandbox(DSecRunArgs(image="root/busybox", labels={"exp": "1"}, task_id="t"))
    b = await client.run_sandbox(DSecRunArgs(image="root/busybox", labels={"exp": "2"}))
    got = await client.get_sandbox(a.id)
    assert got.id == a.id and got.info.spec.task_id == "t"
    listed = await client.list_sandboxes(labels={"exp": "1"})
    assert [s.id for s in listed] == [a.id]
    assert dict(server.list_requests[-1].labels) == {"exp": "1"}
    assert [s.id for s in await client.list_sandboxes(task_id="t")] == [a.id]
    await b.stop()
    assert b.info.state is SandboxState.STOPPED
    with pytest.raises(NotFoundError):
        await client.get_sandbox(b.id)


async def test_sandbox_context_manager_stops(client: DSecClient, server: FakeServer) -> None:
    async with await client.run_sandbox(DSecRunArgs(image="root/busybox")) as sb:
        assert sb.id in server.sandboxes
    assert server.stopped == [sb.id]


async def test_sandbox_context_manager_stops_on_error(client: DSecClient, server: FakeServer) -> None:
    with pytest.raises(RuntimeError):
        async with await client.run_sandbox(DSecRunArgs(image="root/busybox")) as sb:
            raise RuntimeError("boom")
    assert server.stopped == [sb.id]


async def test_set_timeout(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    info = await sb.set_timeout(600)
    assert server.set_timeouts[0].timeout_seconds == 600
    assert info.expires_at == dt.datetime.fromtimestamp(1_700_000_600, dt.UTC)
    assert sb.info is info


# ---- exec ----


async def test_run_shell_sends_a_shell_command_with_options(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    r = await sb.run_shell("describe", timeout=2.5, env={"K": "V"}, cwd="/tmp", user="nobody")
    desc = json.loads(r.stdout)
    assert desc == {
        "command": ["/bin/sh", "-c", "describe"],
        "env": {"K": "V"},
        "cwd": "/tmp",
        "user": "nobody",
        "timeout": 3,
        "stdin": False,
    }
    assert server.exec_requests[0].start.sandbox_id == sb.id
    assert (r.exit_code, r.stderr, r.pid) == (0, "", 42)


async def test_run_shell_result_fields(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    r = await sb.run_shell("interleave")
    assert (r.stdout, r.stderr, r.exit_code, r.status, r.ok) == ("one\nthree\n", "two\n", 3, "exit status 3", False)
    t = await sb.run_shell("timeout", timeout=1)
    assert t.timed_out and t.exit_code == -1 and t.stdout == "partial"
    u = await sb.run_shell("other")
    assert u.stdout_bytes == b"\xff\xfebad utf8" and u.stdout.endswith("bad utf8")


def _peak_rss() -> int:
    """The process's peak resident memory in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


async def test_security_exec_output_run_shell_keeps_at_most_the_default_limit(
    client: DSecClient, server: FakeServer
) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    mib = 1024 * 1024
    assert opendsec.OUTPUT_LIMIT == 16 * mib
    r = await sb.run_shell("flood 20 2")
    assert r.output_truncated and r.exit_code == 0
    assert (len(r.stdout_bytes), r.stdout_total) == (16 * mib, 20 * mib)
    assert (len(r.stderr_bytes), r.stderr_total) == (2 * mib, 2 * mib)
    assert r.stdout_bytes[:4] == b"y\ny\n"  # the head is kept
    # The server is asked to enforce it too (this fake, like an old server, does not).
    assert server.exec_requests[0].start.output_limit_bytes == 16 * mib


async def test_security_exec_output_limit_is_settable(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    mib = 1024 * 1024
    r = await sb.run_shell("flood 3 3", output_limit=mib + 5)
    assert r.output_truncated
    assert (len(r.stdout_bytes), len(r.stderr_bytes)) == (mib + 5, mib + 5)
    assert (r.stdout_total, r.stderr_total) == (3 * mib, 3 * mib)
    full = await sb.run_shell("flood 3 0", output_limit=None)
    assert not full.output_truncated and len(full.stdout_bytes) == 3 * mib == full.stdout_total
    under = await sb.run_shell("flood 1 0")
    assert not under.output_truncated and len(under.stdout_bytes) == mib


async def test_security_exec_output_counts_come_from_the_server(client: DSecClient, server: FakeServer) -> None:
    # A server that enforces output_limit_bytes sends the head and the totals.
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    r = await sb.run_shell("server-capped")
    assert r.output_truncated and r.stdout_bytes == b"head"
    assert (r.stdout_total, r.stderr_total) == (5000, 7)
    with pytest.raises(ValueError, match="output_limit"):
        sb.exec("flood 1 0", output_limit=-1)


async def test_security_exec_output_memory_stays_bounded(client: DSecClient) -> None:
    # 256 MiB of output: the client keeps 16 MiB of it, and holds nothing
    # while the caller iterates.
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    _reset_peak_rss()
    base = _peak_rss()
    r = await sb.run_shell("flood 256 0")
    assert r.output_truncated and r.stdout_total == 256 * 1024 * 1024
    assert _peak_rss() - base < 100 * 1024 * 1024, f"peak RSS grew by {(_peak_rss() - base) >> 20} MiB"
    del r
    _reset_peak_rss()
    base = _peak_rss()
    n = 0
    async with sb.exec("flood 256 0") as proc:
        async for ev in proc:
            n += len(ev.data)
        streamed = await proc.wait()
    assert n == streamed.stdout_total == 256 * 1024 * 1024
    assert streamed.stdout_bytes == b"" and not streamed.output_truncated
    assert _peak_rss() - base < 100 * 1024 * 1024, f"peak RSS grew by {(_peak_rss() - base) >> 20} MiB"


async def test_run_shell_stdin(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    r = await sb.run_shell("cat", stdin="hello\n")
    assert r.stdout == "hello\n"
    assert server.exec_requests[0].start.stdin is True
    kinds = [req.WhichOneof("msg") for req in server.exec_requests[1:]]
    assert kinds == ["stdin", "close_stdin"]


async def test_exec_streams_events_in_order(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    proc = await sb.exec(["interleave"])
    assert proc.pid == 42
    events = [(e.stream, e.text) async for e in proc]
    assert events == [("stdout", "one\n"), ("stderr", "two\n"), ("stdout", "three\n")]
    r = await proc.wait()
    # The events were the output: iterating keeps none of it, only counts.
    assert r.exit_code == 3 and r.stdout == "" and (r.stdout_total, r.stderr_total) == (10, 4)
    assert not r.output_truncated


async def test_exec_interactive_stdin(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    async with sb.exec("cat", stdin=True) as proc:
        it = proc.__aiter__()
        await proc.send_stdin(b"ping\n")
        ev = await it.__anext__()
        assert (ev.stream, ev.data) == ("stdout", b"ping\n")
        await proc.send_stdin("pong\n")
        assert (await it.__anext__()).text == "pong\n"
        await proc.close_stdin()
        r = await proc.wait()
    assert r.stdout == "" and r.stdout_total == 10 and r.exit_code == 0
    with pytest.raises(FailedPreconditionError, match="exited"):
        await proc.send_stdin("late")


async def test_exec_signal_and_resize(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    proc = await sb.exec("wait-signal", pty=(80, 24))
    assert server.exec_requests[0].start.pty.cols == 80
    await proc.resize(120, 40)
    it = proc.__aiter__()
    ev = await it.__anext__()
    assert (ev.stream, ev.text) == ("pty", "size 120x40\n")
    await proc.signal(15)
    r = await proc.wait()
    assert (r.exit_code, r.status) == (-1, "signal: 15")
    assert r.stdout_total == len("size 120x40\n")  # PTY output counts as stdout


async def test_exec_context_manager_kills_a_running_process(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    async with sb.exec("wait-signal") as proc:
        pass
    assert proc.exited
    assert server.exec_requests[-1].signal == 9


async def test_exec_timeout_is_not_a_grpc_deadline_but_the_sdk_gives_up(
    client: DSecClient, server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process timeout is the server's to enforce (it reports timed_out);
    # a gRPC deadline would reach the server and cut that report off.
    monkeypatch.setattr(opendsec.sandbox, "_DEADLINE_GRACE_SECONDS", 0.3)
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    with pytest.raises(E.TimeoutError, match="did not report its exit"):
        await sb.run_shell("hang", timeout=0.2)
    assert server.exec_requests[0].start.timeout_seconds == 1
    assert server.exec_time_remaining == [None]


async def test_exec_stream_error_is_mapped(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    with pytest.raises(NotFoundError, match="not found"):
        await sb.run_shell("vanish")


async def test_processes(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    procs = await sb.processes()
    assert [(p.pid, p.command) for p in procs] == [(1, ["/opendsec-agent"])]


# ---- files ----


async def test_write_streams_header_then_1mib_chunks(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    data = bytes(range(256)) * (10 * 1024)  # 2.5 MiB
    info = await sb.files.write("/data/blob", data)
    reqs = server.write_requests
    assert reqs[0].WhichOneof("msg") == "header"
    h = reqs[0].header
    assert (h.sandbox_id, h.path, h.size) == (sb.id, "/data/blob", len(data))
    sizes = [len(r.data) for r in reqs[1:]]
    assert sizes == [CHUNK_SIZE, CHUNK_SIZE, len(data) - 2 * CHUNK_SIZE]
    assert all(r.WhichOneof("msg") == "data" for r in reqs[1:])
    assert server.files["/data/blob"] == data
    assert info.size == len(data) and info.type is FileType.FILE


async def test_write_empty_file_sends_only_the_header(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    await sb.files.write("/empty", "")
    assert len(server.write_requests) == 1 and server.write_requests[0].header.size == 0
    assert server.files["/empty"] == b""


async def test_upload_over_the_limit_is_quota_exceeded_naming_the_limit(client: DSecClient, server: FakeServer) -> None:
    # The server refuses from the header while data is in flight: grpcio's
    # asyncio client then often loses the status ("Internal error from
    # Core", grpc/grpc#36066); the SDK must still say why, every time.
    server.upload_limit = 1 << 20
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    for _ in range(10):
        with pytest.raises(E.QuotaExceededError, match="exceeds the upload limit of 1048576 bytes"):
            await sb.files.write("/tmp/big", b"x" * (16 << 20))

    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(16):
            yield b"x" * (1 << 20)

    for _ in range(5):
        with pytest.raises(E.QuotaExceededError, match="upload limit"):
            await sb.files.write_stream("/tmp/big", chunks(), size=16 << 20)
    assert "/tmp/big" not in server.files


async def test_read_joins_chunks(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    server.files["/etc/motd"] = "héllo wörld".encode()
    assert await sb.files.read("/etc/motd") == "héllo wörld".encode()
    assert await sb.files.read_text("/etc/motd") == "héllo wörld"
    with pytest.raises(NotFoundError, match="/nope"):
        await sb.files.read("/nope")


async def test_file_operations(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    await sb.files.write("/d/a", "1")
    await sb.files.write("/d/b", "22")
    assert [(f.name, f.size) for f in await sb.files.list("/d")] == [("a", 1), ("b", 2)]
    st = await sb.files.stat("/d/b")
    assert (st.size, st.mode, st.is_dir) == (2, 0o644, False)
    assert await sb.files.make_dir("/e") is True
    assert await sb.files.make_dir("/e") is False
    moved = await sb.files.move("/d/a", "/d/c")
    assert moved.path == "/d/c" and server.files["/d/c"] == b"1"
    await sb.files.remove("/d/c")
    assert not await sb.files.exists("/d/c")
    assert await sb.files.exists("/d/b")
    with pytest.raises(NotFoundError):
        await sb.files.remove("/d/c")


# ---- ports ----


async def test_http(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    resp = await sb.http(8080, "POST", "/api?x=1", headers={"X-A": "b"}, body="{}", timeout=3)
    req = server.http_requests[0]
    assert (req.port, req.method, req.path, req.body, req.timeout_ms) == (8080, "POST", "/api?x=1", b"{}", 3000)
    assert [(h.name, h.value) for h in req.headers] == [("X-A", "b")]
    assert resp.status == 201
    assert resp.header("content-type") == "application/json"
    assert resp.json() == {"method": "POST", "path": "/api?x=1"}


async def test_sandbox_context_manager_tolerates_an_already_stopped_sandbox(
    client: DSecClient, server: FakeServer
) -> None:
    async with await client.run_sandbox(DSecRunArgs(image="root/busybox")) as sb:
        await client.stop_sandbox(sb.id)
    assert server.stopped == [sb.id]


async def test_write_stream_recuts_chunks_and_sends_the_given_size(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))

    async def gen():  # type: ignore[no-untyped-def]
        yield b"a" * (CHUNK_SIZE + 10)
        yield b""
        yield b"b" * 5

    await sb.files.write_stream("/s", gen(), size=CHUNK_SIZE + 15)
    reqs = server.write_requests
    assert reqs[0].header.size == CHUNK_SIZE + 15
    assert [len(r.data) for r in reqs[1:]] == [CHUNK_SIZE, 10, 5]
    assert server.files["/s"] == b"a" * (CHUNK_SIZE + 10) + b"b" * 5
    server.write_requests.clear()
    await sb.files.write_stream("/t", [b"x", b"yz"])
    assert server.write_requests[0].header.size == 0
    assert server.files["/t"] == b"xyz"


async def test_undecodable_answer_is_retried_then_unavailable() -> None:
    # grpc.aio returns None for an answer it cannot decode; the SDK retries
    # idempotent calls and otherwise raises UnavailableError, never hands
    # None on (which surfaced as AttributeError).
    from opendsec._conn import Conn

    conn = Conn("127.0.0.1:1", "tok", timeout=5, max_retries=2, retry_backoff=0)
    try:
        answers: list[object] = [None, "answer"]
        calls = 0

        async def method(request: object, *, metadata: object, timeout: object) -> object:
            nonlocal calls
            calls += 1
            return answers.pop(0)

        assert await conn.unary(method, "req", retry=True) == "answer"
        assert calls == 2

        async def always_none(request: object, *, metadata: object, timeout: object) -> object:
            return None

        with pytest.raises(E.UnavailableError, match="could not be decoded"):
            await conn.unary(always_none, "req", retry=False)
        with pytest.raises(E.UnavailableError, match="could not be decoded"):
            await conn.unary(always_none, "req", retry=True)
    finally:
        await conn.close()
