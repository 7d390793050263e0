"""An in-process grpc.aio server implementing the generated servicers, for
unit tests of the SDK logic above the transport (metadata, retries, error
mapping, chunking, exec stream parsing). It is not a model of OpenDsec."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
from google.protobuf import timestamp_pb2

from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb
from opendsec._gen.opendsec.v1 import sandbox_pb2_grpc as pbg

GOOD_TOKEN = "good-token"


class FakeServer(
    pbg.SandboxServiceServicer,
    pbg.ProcessServiceServicer,
    pbg.FileServiceServicer,
    pbg.PortServiceServicer,
):
    """Records what it receives and answers from simple in-memory state."""

    def __init__(self) -> None:
        self.auth: list[tuple[str, str | None]] = []
        self.create_requests: list[pb.CreateSandboxRequest] = []
        self.create_failures: list[tuple[grpc.StatusCode, str]] = []
        self.batch_requests: list[pb.BatchCreateSandboxesRequest] = []
        self.batch_failures: list[tuple[grpc.StatusCode, str]] = []
        # Cut the next batch stream with UNAVAILABLE after this many items.
        self.batch_cut_after: int | None = None
        # Sandboxes made per batch item request ID ("<request_id>-<i>").
        self.batch_made: dict[str, str] = {}
        self.list_requests: list[pb.ListSandboxesRequest] = []
        self.sandboxes: dict[str, pb.Sandbox] = {}
        self.stopped: list[str] = []
        self.files: dict[str, bytes] = {}
        self.write_requests: list[pb.WriteFileRequest] = []
        # WriteFile refuses a header declaring more (0: no limit), as the
        # real server does, before reading any data.
        self.upload_limit = 0
        self.read_chunk = 3
        self.exec_requests: list[pb.ExecRequest] = []
        self.exec_time_remaining: list[float | None] = []
        self.http_requests: list[pb.HTTPRequestRequest] = []
        self.set_timeouts: list[pb.SetTimeoutRequest] = []
        self.set_networks: list[pb.SetNetworkRequest] = []
        self.resume_requests: list[pb.ResumeSandboxRequest] = []
        self.fork_requests: list[pb.ForkSandboxRequest] = []
        # The first ForkSandbox calls answer these codes (a lost answer).
        self.fork_failures: list[tuple[grpc.StatusCode, str]] = []
        self.forks_by_request: dict[str, list[str]] = {}
        self.pause_batch_requests: list[pb.PauseSandboxesRequest] = []
        self.pause_requests: list[pb.PauseSandboxRequest] = []
        # Prestarted sandboxes a create may take, unless it sets skip_warm_pool.
        self.warm_pool = 0
        # PrewarmSandboxes: every request, and the most one holds.
        self.prewarm_requests: list[pb.PrewarmSandboxesRequest] = []
        self.pool_room = 64

    async def _auth(self, context: grpc.aio.ServicerContext, method: str) -> None:
        md = dict(context.invocation_metadata() or ())
        value = md.get("authorization")
        self.auth.append((method, value))
        if value != f"Bearer {GOOD_TOKEN}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "token: unknown or expired token; get a new one")

    def _make(self, spec: pb.SandboxSpec, sid: str) -> pb.Sandbox:
        s = pb.Sandbox(id=sid, node_id="node1", spec=spec, state=pb.SANDBOX_STATE_RUNNING)
        s.created_at.CopyFrom(timestamp_pb2.Timestamp(seconds=1_700_000_000))
        s.expires_at.CopyFrom(timestamp_pb2.Timestamp(seconds=1_700_000_300))
        self.sandboxes[sid] = s
        return s

    # ---- sandboxes ----

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context: Any) -> pb.CreateSandboxResponse:
        await self._auth(context, "CreateSandbox")
        self.create_requests.append(request)
        if self.create_failures:
            code, msg = self.create_failures.pop(0)
            await context.abort(code, msg)
        if request.spec.image == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, 'image: "bad" is not a known image; list images')
        sid = "sb" + request.request_id[:8]
        s = self._make(request.spec, sid)
        s.from_warm_pool = self._take_warm(request.skip_warm_pool)
        return pb.CreateSandboxResponse(sandbox=s)

    async def PrewarmSandboxes(
        self, request: pb.PrewarmSandboxesRequest, context: Any
    ) -> pb.PrewarmSandboxesResponse:
        await self._auth(context, "PrewarmSandboxes")
        self.prewarm_requests.append(request)
        if request.count < 1 or request.count > 1024:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"count: {request.count} must be between 1 and 1024 (node.warm_pool.max_sandboxes of node node1)",
            )
        if request.spec.image == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, 'image: "bad" is not a known image; list images')
        held = min(request.count, self.pool_room)
        reason = f"capacity: node node1 has room for {held} more sandboxes" if held < request.count else ""
        self.warm_pool += held
        return pb.PrewarmSandboxesResponse(
            held=held, ready=held, reason=reason, ttl_seconds=request.ttl_seconds or 600
        )

    def _take_warm(self, skip: bool) -> bool:
        if skip or self.warm_pool <= 0:
            return False
        self.warm_pool -= 1
        return True

    async def BatchCreateSandboxes(
        self, request: pb.BatchCreateSandboxesRequest, context: Any
    ) -> AsyncIterator[pb.BatchCreateSandboxesResponse]:
        await self._auth(context, "BatchCreateSandboxes")
        self.batch_requests.append(request)
        if self.batch_failures:
            code, msg = self.batch_failures.pop(0)
            await context.abort(code, msg)
        # Finish out of order; every third item fails.
        cut, self.batch_cut_after = self.batch_cut_after, None
        for n, i in enumerate(reversed(range(request.count))):
            if cut is not None and n == cut:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "apiserver went away")
            if i % 3 == 1:
                yield pb.BatchCreateSandboxesResponse(
                    index=i, error_code="resource_exhausted", error_message="memory_mb: node capacity exhausted"
                )
            else:
                # Idempotent per item, as the node is on "<request_id>-<i>".
                key = f"{request.request_id}-{i}"
                sid = self.batch_made.setdefault(key, f"b{i}")
                s = self._make(request.spec, sid)
                s.from_warm_pool = self._take_warm(request.skip_warm_pool)
                yield pb.BatchCreateSandboxesResponse(index=i, sandbox=s)

    async def GetSandbox(self, request: pb.GetSandboxRequest, context: Any) -> pb.GetSandboxResponse:
        await self._auth(context, "GetSandbox")
        if request.id.startswith("err-"):
            name = request.id.removeprefix("err-")
            await context.abort(grpc.StatusCode[name], f"server says {name}")
        if request.id.startswith("died-"):
            # As the apiserver answers a call into a sandbox that died.
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"sandbox {request.id} died: killed by signal 9; create a new one",
                trailing_metadata=(("opendsec-sandbox-died", "killed by signal 9"),),
            )
        s = self.sandboxes.get(request.id)
        if s is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {request.id!r} not found")
        return pb.GetSandboxResponse(sandbox=s)

    async def ListSandboxes(self, request: pb.ListSandboxesRequest, context: Any) -> pb.ListSandboxesResponse:
        await self._auth(context, "ListSandboxes")
        self.list_requests.append(request)
        out = [
            s
            for s in self.sandboxes.values()
            if all(s.spec.labels.get(k) == v for k, v in request.labels.items())
            and (not request.task_id or s.spec.task_id == request.task_id)
        ]
        return pb.ListSandboxesResponse(sandboxes=out)

    async def StopSandbox(self, request: pb.StopSandboxRequest, context: Any) -> pb.StopSandboxResponse:
        await self._auth(context, "StopSandbox")
        if self.sandboxes.pop(request.id, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {request.id!r} not found")
        self.stopped.append(request.id)
        return pb.StopSandboxResponse()

    async def _set_state(self, sid: str, state: int, context: Any) -> pb.Sandbox:
        s = self.sandboxes.get(sid)
        if s is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {sid!r} not found")
        s.state = state  # type: ignore[assignment]
        return s

    async def PauseSandbox(self, request: pb.PauseSandboxRequest, context: Any) -> pb.PauseSandboxResponse:
        await self._auth(context, "PauseSandbox")
        self.pause_requests.append(request)
        sb = await self._set_state(request.id, pb.SANDBOX_STATE_PAUSED, context)
        sb.paused_filesystem = sb.paused_filesystem or request.filesystem_only
        return pb.PauseSandboxResponse(sandbox=sb, bytes_freed=(20 << 20) if request.reclaim else 0)

    async def ResumeSandbox(self, request: pb.ResumeSandboxRequest, context: Any) -> pb.ResumeSandboxResponse:
        await self._auth(context, "ResumeSandbox")
        self.resume_requests.append(request)
        sb = await self._set_state(request.id, pb.SANDBOX_STATE_RUNNING, context)
        sb.paused_filesystem = False
        return pb.ResumeSandboxResponse(sandbox=sb)

    async def ForkSandbox(self, request: pb.ForkSandboxRequest, context: Any) -> pb.ForkSandboxResponse:
        await self._auth(context, "ForkSandbox")
        self.fork_requests.append(request)
        src = self.sandboxes.get(request.sandbox_id)
        if src is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox_id: sandbox {request.sandbox_id} not found")
        if not 1 <= request.count <= 64:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"count: is {request.count}; give 1..64 forks")
        ids = self.forks_by_request.get(request.request_id)
        if ids is None:
            ids = []
            for i in range(request.count):
                s = self._make(src.spec, f"fk{request.request_id[:6]}{i:02d}")
                s.parent_id = src.id
                ids.append(s.id)
            self.forks_by_request[request.request_id] = ids
        if self.fork_failures:  # made, but the answer is lost
            code, msg = self.fork_failures.pop(0)
            await context.abort(code, msg)
        return pb.ForkSandboxResponse(
            forks=[pb.ForkResult(sandbox=self.sandboxes[i], memory_preserved=False) for i in ids],
            source_frozen_us=1500,
        )

    async def GetSandboxMetrics(
        self, request: pb.GetSandboxMetricsRequest, context: Any
    ) -> pb.GetSandboxMetricsResponse:
        await self._auth(context, "GetSandboxMetrics")
        s = self.sandboxes.get(request.id)
        if s is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {request.id!r} not found")
        m = pb.SandboxMetrics(
            cpu_count=1, cpu_used_pct=12.5, cpu_usage_ns=3_000_000, mem_used_bytes=1 << 20,
            mem_total_bytes=512 << 20, pids=2, pids_limit=1024, state=s.state,
        )
        m.timestamp.CopyFrom(timestamp_pb2.Timestamp(seconds=1_700_000_100))
        return pb.GetSandboxMetricsResponse(metrics=m)

    def _select(self, sel: pb.SandboxSelector) -> list[pb.Sandbox]:
        return [
            s
            for s in self.sandboxes.values()
            if all(s.spec.labels.get(k) == v for k, v in sel.labels.items())
            and (not sel.task_id or s.spec.task_id == sel.task_id)
            and (not sel.ids or s.id in sel.ids)
        ]

    async def PauseSandboxes(self, request: pb.PauseSandboxesRequest, context: Any) -> pb.PauseSandboxesResponse:
        await self._auth(context, "PauseSandboxes")
        self.pause_batch_requests.append(request)
        out = self._select(request.selector)
        if not out and not request.selector.ids and request.selector.task_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running or paused sandboxes of task {request.selector.task_id} (selector.task_id)")
        for s in out:
            s.state = pb.SANDBOX_STATE_PAUSED
        fails = [pb.BatchFailure(sandbox_id=i, error_code="not_found", error_message=f"sandbox {i} not found")
                 for i in request.selector.ids if i not in self.sandboxes]
        reclaimed = []
        if request.reclaim:
            reclaimed = [pb.SandboxReclaim(sandbox_id=s.id, bytes_before=21 << 20, bytes_after=1 << 20, bytes_freed=20 << 20) for s in out]
        return pb.PauseSandboxesResponse(sandboxes=out, failures=fails, reclaimed=reclaimed,
                                         bytes_freed=sum(r.bytes_freed for r in reclaimed))

    async def ResumeSandboxes(self, request: pb.ResumeSandboxesRequest, context: Any) -> pb.ResumeSandboxesResponse:
        await self._auth(context, "ResumeSandboxes")
        out = self._select(request.selector)
        for s in out:
            s.state = pb.SANDBOX_STATE_RUNNING
        return pb.ResumeSandboxesResponse(sandboxes=out)

    async def SetTimeout(self, request: pb.SetTimeoutRequest, context: Any) -> pb.SetTimeoutResponse:
        await self._auth(context, "SetTimeout")
        self.set_timeouts.append(request)
        s = self.sandboxes[request.id]
        s.expires_at.CopyFrom(timestamp_pb2.Timestamp(seconds=1_700_000_000 + request.timeout_seconds))
        return pb.SetTimeoutResponse(sandbox=s)

    async def SetNetwork(self, request: pb.SetNetworkRequest, context: Any) -> pb.SetNetworkResponse:
        await self._auth(context, "SetNetwork")
        self.set_networks.append(request)
        for i, r in enumerate(request.network.allow):
            if r.cidr == "bad":
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f'network.allow[{i}].cidr: "bad" is not an IPv4 prefix'
                )
        s = self.sandboxes.get(request.id)
        if s is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {request.id!r} not found")
        s.spec.network.CopyFrom(request.network)
        return pb.SetNetworkResponse(sandbox=s)

    # ---- processes ----

    async def Exec(self, request_iterator: Any, context: Any) -> AsyncIterator[pb.ExecResponse]:
        await self._auth(context, "Exec")
        self.exec_time_remaining.append(context.time_remaining())
        it = request_iterator.__aiter__()
        first = await it.__anext__()
        self.exec_requests.append(first)
        start = first.start
        cmd = start.command[-1] if start.command else ""
        yield pb.ExecResponse(started=pb.ExecStarted(pid=42))
        if cmd == "interleave":
            yield pb.ExecResponse(stdout=b"one\n")
            yield pb.ExecResponse(stderr=b"two\n")
            yield pb.ExecResponse(stdout=b"three\n")
            yield pb.ExecResponse(exit=pb.ExecExit(exit_code=3, status="exit status 3"))
        elif cmd == "describe":
            desc = {
                "command": list(start.command),
                "env": dict(start.env),
                "cwd": start.cwd,
                "user": start.user,
                "timeout": start.timeout_seconds,
                "stdin": start.stdin,
            }
            yield pb.ExecResponse(stdout=json.dumps(desc).encode())
            yield pb.ExecResponse(exit=pb.ExecExit(exit_code=0, status="exit status 0"))
        elif cmd == "cat":
            async for req in it:
                self.exec_requests.append(req)
                kind = req.WhichOneof("msg")
                if kind == "stdin":
                    yield pb.ExecResponse(stdout=req.stdin)
                elif kind == "close_stdin":
                    break
            yield pb.ExecResponse(exit=pb.ExecExit(exit_code=0, status="exit status 0"))
        elif cmd == "wait-signal":
            async for req in it:
                self.exec_requests.append(req)
                kind = req.WhichOneof("msg")
                if kind == "resize":
                    yield pb.ExecResponse(pty=f"size {req.resize.cols}x{req.resize.rows}\n".encode())
                elif kind == "signal":
                    yield pb.ExecResponse(exit=pb.ExecExit(exit_code=-1, status=f"signal: {req.signal}"))
                    break
        elif cmd.startswith("flood "):
            # "flood OUT_MIB ERR_MIB": that much output in 1 MiB chunks.
            out_mib, err_mib = (int(x) for x in cmd.split()[1:3])
            chunk = b"y\n" * (512 * 1024)
            for i in range(max(out_mib, err_mib)):
                if i < out_mib:
                    yield pb.ExecResponse(stdout=chunk)
                if i < err_mib:
                    yield pb.ExecResponse(stderr=chunk)
            yield pb.ExecResponse(exit=pb.ExecExit(exit_code=0, status="exit status 0"))
        elif cmd == "server-capped":
            yield pb.ExecResponse(stdout=b"head")
            yield pb.ExecResponse(
                exit=pb.ExecExit(
                    exit_code=0,
                    status="exit status 0",
                    output_truncated=True,
                    stdout_total_bytes=5000,
                    stderr_total_bytes=7,
                )
            )
        elif cmd == "hang":
            await asyncio.Event().wait()
        elif cmd == "vanish":
            await context.abort(grpc.StatusCode.NOT_FOUND, "sandbox 'x' not found")
        elif cmd == "timeout":
            yield pb.ExecResponse(stdout=b"partial")
            yield pb.ExecResponse(exit=pb.ExecExit(exit_code=-1, status="signal: killed", timed_out=True))
        else:
            yield pb.ExecResponse(stdout=b"\xff\xfebad utf8")
            yield pb.ExecResponse(exit=pb.ExecExit(exit_code=0, status="exit status 0"))

    async def ListProcesses(self, request: pb.ListProcessesRequest, context: Any) -> pb.ListProcessesResponse:
        await self._auth(context, "ListProcesses")
        return pb.ListProcessesResponse(processes=[pb.ProcessInfo(pid=1, command=["/opendsec-agent"], tag="", cwd="/")])

    # ---- files ----

    async def ReadFile(self, request: pb.ReadFileRequest, context: Any) -> AsyncIterator[pb.ReadFileResponse]:
        await self._auth(context, "ReadFile")
        data = self.files.get(request.path)
        if data is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"path: {request.path} does not exist")
        assert data is not None
        for off in range(0, len(data), self.read_chunk):
            yield pb.ReadFileResponse(data=data[off : off + self.read_chunk])

    async def WriteFile(self, request_iterator: Any, context: Any) -> pb.WriteFileResponse:
        await self._auth(context, "WriteFile")
        header: pb.WriteFileHeader | None = None
        buf = bytearray()
        async for req in request_iterator:
            self.write_requests.append(req)
            if req.WhichOneof("msg") == "header":
                header = req.header
                if self.upload_limit and header.size > self.upload_limit:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"size: {header.size} bytes exceeds the upload limit of {self.upload_limit} bytes",
                    )
            else:
                buf.extend(req.data)
        assert header is not None
        self.files[header.path] = bytes(buf)
        return pb.WriteFileResponse(
            file=pb.FileInfo(
                name=header.path.rsplit("/", 1)[-1], path=header.path, type=pb.FILE_TYPE_FILE, size=len(buf)
            )
        )

    async def Stat(self, request: pb.StatRequest, context: Any) -> pb.StatResponse:
        await self._auth(context, "Stat")
        if request.path not in self.files:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"path: {request.path} does not exist")
        return pb.StatResponse(
            file=pb.FileInfo(path=request.path, type=pb.FILE_TYPE_FILE, size=len(self.files[request.path]), mode=0o644)
        )

    async def ListDir(self, request: pb.ListDirRequest, context: Any) -> pb.ListDirResponse:
        await self._auth(context, "ListDir")
        prefix = request.path.rstrip("/") + "/"
        return pb.ListDirResponse(
            entries=[
                pb.FileInfo(name=p[len(prefix) :], path=p, type=pb.FILE_TYPE_FILE, size=len(d))
                for p, d in sorted(self.files.items())
                if p.startswith(prefix)
            ]
        )

    async def Remove(self, request: pb.RemoveRequest, context: Any) -> pb.RemoveResponse:
        await self._auth(context, "Remove")
        if self.files.pop(request.path, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"path: {request.path} does not exist")
        return pb.RemoveResponse()

    async def MakeDir(self, request: pb.MakeDirRequest, context: Any) -> pb.MakeDirResponse:
        await self._auth(context, "MakeDir")
        existed = request.path in self.files
        self.files.setdefault(request.path, b"")
        return pb.MakeDirResponse(file=pb.FileInfo(path=request.path, type=pb.FILE_TYPE_DIRECTORY), created=not existed)

    async def Move(self, request: pb.MoveRequest, context: Any) -> pb.MoveResponse:
        await self._auth(context, "Move")
        self.files[request.destination] = self.files.pop(request.source)
        return pb.MoveResponse(file=pb.FileInfo(path=request.destination, type=pb.FILE_TYPE_FILE))

    # ---- ports ----

    async def HTTPRequest(self, request: pb.HTTPRequestRequest, context: Any) -> pb.HTTPRequestResponse:
        await self._auth(context, "HTTPRequest")
        self.http_requests.append(request)
        return pb.HTTPRequestResponse(
            status=201,
            headers=[pb.Header(name="Content-Type", value="application/json")],
            body=json.dumps({"method": request.method, "path": request.path}).encode(),
        )


async def start(fake: FakeServer) -> tuple[grpc.aio.Server, int]:
    """Serve ``fake`` on a free loopback port; return the server and the port."""
    server = grpc.aio.server()
    pbg.add_SandboxServiceServicer_to_server(fake, server)
    pbg.add_ProcessServiceServicer_to_server(fake, server)
    pbg.add_FileServiceServicer_to_server(fake, server)
    pbg.add_PortServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


__all__ = ["GOOD_TOKEN", "FakeServer", "asyncio", "start"]
