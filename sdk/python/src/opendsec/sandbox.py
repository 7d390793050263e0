"""Sandbox handles: processes (:class:`ExecProcess`), files (:class:`Files`),
ports and lifecycle (:class:`Sandbox`)."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import math
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import grpc
import grpc.aio
from google.protobuf import json_format

from opendsec._conn import Conn
from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb
from opendsec.errors import (
    ConfigError,
    DSecError,
    DSecTimeoutError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    from_grpc_error,
)
from opendsec.images import Image, Images
from opendsec.ports import PortStream
from opendsec.snapshots import Snapshot, _Snapshots
from opendsec.types import (
    ExecEvent,
    ExecResult,
    FileInfo,
    HTTPResponse,
    NetworkPolicy,
    NetworkSpec,
    ProcessInfo,
    SandboxInfo,
    SandboxMetrics,
    SandboxState,
    _headers,
)

__all__ = ["CHUNK_SIZE", "OUTPUT_LIMIT", "SHELL", "ExecProcess", "Files", "Sandbox"]

#: The most sandboxes one :meth:`Sandbox.fork` makes.
MAX_FORK_COUNT = 64

#: Size of the data chunks :meth:`Files.write` streams.
CHUNK_SIZE = 1024 * 1024

# What grpcio's asyncio client reports when it lost the status of a call
# the server ended while the client was still sending (grpc/grpc#36066).
_LOST_STATUS = "Internal error from Core"

#: How many bytes of each output stream (stdout, stderr) :meth:`Sandbox.run_shell`
#: and :meth:`ExecProcess.wait` keep by default. Past it the output is counted,
#: not kept, and the result has ``output_truncated=True``. Change it per call
#: with ``output_limit=`` (``None`` keeps everything).
OUTPUT_LIMIT = 16 * 1024 * 1024

#: The shell :meth:`Sandbox.run_shell` and string commands run under.
SHELL = ("/bin/sh", "-c")

# How long to wait for the server to finish a stream after the exit event or a
# kill before cancelling it.
_DRAIN_SECONDS = 5.0
# How long past a process timeout the SDK waits for the exit event before it
# gives up. This is a local timer, deliberately not a gRPC deadline: a deadline
# would travel to the server and could end the stream before the server's own
# kill-and-report of the timed-out process.
_DEADLINE_GRACE_SECONDS = 30.0


def _to_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"data must be bytes or str, got {type(data).__name__}")


class _Trajectory:
    """The state of a ``with client.trajectory(rollout_id):`` block."""

    def __init__(self, rollout_id: str) -> None:
        self.rollout_id = rollout_id
        self.counts: dict[str, int] = {}


_trajectory: contextvars.ContextVar[_Trajectory | None] = contextvars.ContextVar("opendsec_trajectory", default=None)


def _call_id(sandbox_id: str, call_id: str | None) -> str:
    """The call ID of a call: the caller's, or the next of the active trajectory block's."""
    if call_id is not None:
        if len(call_id.encode()) > MAX_CALL_ID_BYTES:
            raise ValueError(f"call_id is {len(call_id.encode())} bytes; at most {MAX_CALL_ID_BYTES} are allowed")
        return call_id
    tr = _trajectory.get()
    if tr is None:
        return ""
    n = tr.counts.get(sandbox_id, 0)
    tr.counts[sandbox_id] = n + 1
    return f"{tr.rollout_id}/{n}"


#: The longest call ID the server accepts, in bytes.
MAX_CALL_ID_BYTES = 256


class ExecProcess:
    """A process started with :meth:`Sandbox.exec`, streaming its output.

    Start it with ``await`` (``proc = await sandbox.exec(...)``) or
    ``async with sandbox.exec(...) as proc:`` (which kills it on exit if it is
    still running). Then::

        async for event in proc:          # ExecEvent(stream, data)
            print(event.stream, event.text)
        result = await proc.wait()        # ExecResult

    Unless the caller iterates, the output is collected for :meth:`wait`, up to
    ``output_limit`` bytes per stream (default :data:`OUTPUT_LIMIT`, 16 MiB);
    past that it is counted but not kept and the result has
    ``output_truncated=True``. The process keeps running to its end: the SDK
    keeps reading (and dropping) its output. Once the caller iterates, nothing
    is kept: the events are the output, and :meth:`wait` then returns empty
    ``stdout``/``stderr`` with the byte counts in ``stdout_total`` /
    ``stderr_total``.
    """

    def __init__(
        self,
        conn: Conn,
        start: pb.ExecStart,
        give_up_after: float | None,
        output_limit: int | None = OUTPUT_LIMIT,
    ) -> None:
        if output_limit is not None and output_limit < 0:
            raise ValueError("output_limit must be >= 0 bytes, or None to keep all output")
        self._conn = conn
        self._start_msg = start
        self._give_up_after = give_up_after
        self._give_up_at: float | None = None
        self._call: Any = None
        self._started = False
        self._replayed = False
        self._joined = False
        self._seq = 0
        self._pid = 0
        self._exit: pb.ExecExit | None = None
        self._pending: list[ExecEvent] = []
        self._stdout = bytearray()
        self._result: ExecResult | None = None
        self._stderr = bytearray()
        self._limit = output_limit
        # Bytes produced per stream, kept or not.
        self._stdout_total = 0
        self._stderr_total = 0
        self._truncated = False
        # Set once the caller iterates: from then on nothing is kept.
        self._streaming = False
        self._read_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()
        self._finished = False

    @property
    def pid(self) -> int:
        """Process ID inside the sandbox (0 before the process started)."""
        return self._pid

    @property
    def command(self) -> list[str]:
        """The program and its arguments."""
        return list(self._start_msg.command)

    @property
    def exited(self) -> bool:
        """True once the exit event arrived."""
        return self._exit is not None

    def __await__(self) -> Generator[Any, None, Self]:
        return self.start().__await__()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> Self:
        """Send the start request and wait until the process runs. Idempotent."""
        async with self._start_lock:
            if self._call is not None:
                return self
            if self._give_up_after is not None:
                self._give_up_at = asyncio.get_running_loop().time() + self._give_up_after
            self._call = self._conn.processes.Exec(metadata=self._conn.metadata)
            try:
                await self._call.write(pb.ExecRequest(start=self._start_msg))
                async with self._read_lock:
                    while not self._started and self._exit is None:
                        ev = await asyncio.wait_for(self._read_one(), self._conn.timeout)
                        if ev is not None:
                            self._pending.append(ev)
            except BaseException as e:
                self._call.cancel()
                self._finished = True
                if isinstance(e, grpc.aio.AioRpcError):
                    raise from_grpc_error(e) from None
                if isinstance(e, TimeoutError) and not isinstance(e, DSecError):
                    raise DSecTimeoutError(
                        f"exec start: the process did not start within {self._conn.timeout:g}s"
                    ) from None
                raise
            return self

    async def _read_one(self) -> ExecEvent | None:
        """Read one message; return an output event or None (started/exit)."""
        try:
            if self._give_up_at is None:
                msg = await self._call.read()
            else:
                left = self._give_up_at - asyncio.get_running_loop().time()
                msg = await asyncio.wait_for(self._call.read(), max(left, 0))
        except grpc.aio.AioRpcError as e:
            self._finished = True
            raise from_grpc_error(e) from None
        except TimeoutError:
            self._finished = True
            self._call.cancel()
            raise DSecTimeoutError(
                f"exec: process {self._pid} did not report its exit within {self._give_up_after:g}s "
                f"(its timeout plus {_DEADLINE_GRACE_SECONDS:g}s)"
            ) from None
        if msg is grpc.aio.EOF:
            self._finished = True
            raise InternalError("exec: the server ended the stream without an exit event")
        kind = msg.WhichOneof("event")
        if kind == "started":
            self._started = True
            self._pid = msg.started.pid
            self._replayed = msg.started.replayed
            self._joined = msg.started.joined
            self._seq = msg.started.seq
            return None
        if kind == "exit":
            self._exit = msg.exit
            return None
        if kind in ("stdout", "stderr", "pty"):
            data: bytes = getattr(msg, kind)
            self._keep(kind == "stderr", data)
            return ExecEvent(stream=kind, data=data)
        return None  # an event this SDK does not know yet

    def _keep(self, is_stderr: bool, data: bytes) -> None:
        """Count data and keep what fits under the limit (nothing while streaming)."""
        if is_stderr:
            self._stderr_total += len(data)
            buf = self._stderr
        else:
            self._stdout_total += len(data)
            buf = self._stdout
        if self._streaming:
            return
        room = len(data) if self._limit is None else self._limit - len(buf)
        if room < len(data):
            self._truncated = True
        if room > 0:
            buf.extend(data[:room] if room < len(data) else data)

    async def _next_event(self) -> ExecEvent | None:
        """The next output event, or None once the process exited."""
        if self._pending:
            return self._pending.pop(0)
        async with self._read_lock:
            while self._exit is None:
                ev = await self._read_one()
                if ev is not None:
                    return ev
        return None

    async def __aiter__(self) -> AsyncIterator[ExecEvent]:
        await self.start()
        # The caller gets the output as events: keep none of it, so a long
        # or endless output costs no memory here.
        self._streaming = True
        self._stdout = bytearray()
        self._stderr = bytearray()
        while True:
            ev = await self._next_event()
            if ev is None:
                return
            yield ev

    async def wait(self) -> ExecResult:
        """Wait for the process to exit and return its result with the kept output.

        Output past ``output_limit`` per stream, or any output once the caller
        iterated, is counted in ``stdout_total``/``stderr_total`` but not kept."""
        await self.start()
        while await self._next_event() is not None:
            pass
        await self._finish()
        assert self._exit is not None
        if self._result is not None:
            return self._result
        # Copy, then free the buffers before decoding: a capped 16 MiB
        # stream is held twice at the peak, not three times.
        out, err = bytes(self._stdout), bytes(self._stderr)
        self._stdout, self._stderr = bytearray(), bytearray()
        self._result = ExecResult(
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            exit_code=self._exit.exit_code,
            status=self._exit.status,
            timed_out=self._exit.timed_out,
            output_truncated=self._exit.output_truncated or self._truncated,
            pid=self._pid,
            stdout_bytes=out,
            stderr_bytes=err,
            stdout_total=max(self._stdout_total, self._exit.stdout_total_bytes),
            stderr_total=max(self._stderr_total, self._exit.stderr_total_bytes),
            replayed=self._replayed or self._exit.replayed,
            joined=self._joined,
            seq=self._seq,
            call_id=self._start_msg.call_id,
        )
        return self._result

    async def _finish(self) -> None:
        """Half-close the stream and let the server end it; cancel if it does not."""
        if self._finished or self._call is None:
            return
        self._finished = True
        try:
            async with self._write_lock:
                await self._call.done_writing()

            async def drain() -> None:
                while await self._call.read() is not grpc.aio.EOF:
                    pass

            await asyncio.wait_for(drain(), _DRAIN_SECONDS)
        except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError):
            self._call.cancel()

    async def _write(self, req: pb.ExecRequest, what: str) -> None:
        await self.start()
        if self._exit is not None or self._finished:
            raise FailedPreconditionError(f"{what}: process {self._pid} has already exited")
        try:
            async with self._write_lock:
                await self._call.write(req)
        except grpc.aio.AioRpcError as e:
            raise from_grpc_error(e) from None
        except asyncio.InvalidStateError:
            raise FailedPreconditionError(f"{what}: the exec stream of process {self._pid} is closed") from None

    async def send_stdin(self, data: bytes | bytearray | memoryview | str) -> None:
        """Write ``data`` to the process's stdin (or its PTY). Needs ``stdin=True``
        or ``pty=`` at :meth:`Sandbox.exec`."""
        await self._write(pb.ExecRequest(stdin=_to_bytes(data)), "send stdin")

    async def close_stdin(self) -> None:
        """Close the process's stdin (it reads EOF)."""
        await self._write(pb.ExecRequest(close_stdin=True), "close stdin")

    async def signal(self, signal: int) -> None:
        """Send a signal number to the process, e.g. 15 (SIGTERM) or 9 (SIGKILL)."""
        await self._write(pb.ExecRequest(signal=int(signal)), "signal")

    async def kill(self) -> None:
        """Send SIGKILL."""
        await self.signal(9)

    async def resize(self, cols: int, rows: int) -> None:
        """Resize the process's PTY (started with ``pty=``)."""
        await self._write(pb.ExecRequest(resize=pb.PtySize(cols=cols, rows=rows)), "resize")

    async def close(self) -> None:
        """Kill the process if it still runs and release the stream."""
        if self._call is None or self._finished:
            return
        if self._exit is None:
            try:
                await self.kill()

                async def until_exit() -> None:
                    while await self._next_event() is not None:
                        pass

                await asyncio.wait_for(until_exit(), _DRAIN_SECONDS)
            except (DSecError, TimeoutError):
                pass
        if self._exit is None:
            self._finished = True
            self._call.cancel()
            return
        await self._finish()


def _cut(chunk: bytes | bytearray | memoryview) -> Generator[pb.WriteFileRequest, None, None]:
    view = memoryview(_to_bytes(chunk))
    for off in range(0, len(view), CHUNK_SIZE):
        yield pb.WriteFileRequest(data=bytes(view[off : off + CHUNK_SIZE]))


class Files:
    """File operations inside one sandbox (``sandbox.files``).

    Paths are absolute or relative to the sandbox user's home; ``user`` picks
    whose permissions apply (default: the sandbox's user).
    """

    def __init__(self, conn: Conn, sandbox_id: str) -> None:
        self._conn = conn
        self._id = sandbox_id

    async def read(self, path: str, *, user: str = "", timeout: float | None = None) -> bytes:
        """Return the file's contents."""
        req = pb.ReadFileRequest(sandbox_id=self._id, path=path, user=user)

        async def run() -> bytes:
            buf = bytearray()
            call = self._conn.files.ReadFile(req, metadata=self._conn.metadata, timeout=timeout or self._conn.timeout)
            async for msg in call:
                buf.extend(msg.data)
            return bytes(buf)

        return await self._conn.retrying(run, retry=False)

    async def read_text(
        self, path: str, *, encoding: str = "utf-8", user: str = "", timeout: float | None = None
    ) -> str:
        """Return the file's contents decoded (strictly) with ``encoding``."""
        return (await self.read(path, user=user, timeout=timeout)).decode(encoding)

    async def write(
        self,
        path: str,
        data: bytes | bytearray | memoryview | str,
        *,
        user: str = "",
        timeout: float | None = None,
    ) -> FileInfo:
        """Create or replace the file at ``path`` with ``data`` (str is UTF-8 encoded).

        Streams a header carrying the total size, then 1 MiB chunks. Parent
        directories are created by the server.
        """
        buf = memoryview(_to_bytes(data))
        header = pb.WriteFileHeader(sandbox_id=self._id, path=path, user=user, size=len(buf))
        sent = [0]

        async def requests() -> AsyncIterator[pb.WriteFileRequest]:
            yield pb.WriteFileRequest(header=header)
            for off in range(0, len(buf), CHUNK_SIZE):
                piece = bytes(buf[off : off + CHUNK_SIZE])
                sent[0] += len(piece)
                yield pb.WriteFileRequest(data=piece)

        return await self._write_file(header, requests, sent, timeout)

    async def write_stream(
        self,
        path: str,
        chunks: Iterable[bytes] | AsyncIterable[bytes],
        *,
        size: int = 0,
        user: str = "",
        timeout: float | None = None,
    ) -> FileInfo:
        """Create or replace the file at ``path`` from an (async) iterable of byte
        chunks, without holding the whole file in memory.

        ``size`` is the total size if known (0 = unknown): the node refuses an
        upload above its limit before any data is sent. Chunks of any size are
        re-cut to at most 1 MiB.
        """
        header = pb.WriteFileHeader(sandbox_id=self._id, path=path, user=user, size=size)
        sent = [0]

        async def requests() -> AsyncIterator[pb.WriteFileRequest]:
            yield pb.WriteFileRequest(header=header)
            if isinstance(chunks, AsyncIterable):
                async for chunk in chunks:
                    for piece in _cut(chunk):
                        sent[0] += len(piece.data)
                        yield piece
            else:
                for chunk in chunks:
                    for piece in _cut(chunk):
                        sent[0] += len(piece.data)
                        yield piece

        return await self._write_file(header, requests, sent, timeout)

    async def _write_file(
        self,
        header: pb.WriteFileHeader,
        requests: Callable[[], AsyncIterator[pb.WriteFileRequest]],
        sent: list[int],
        timeout: float | None,
    ) -> FileInfo:
        try:
            resp = await self._conn.retrying(
                lambda: self._conn.files.WriteFile(
                    requests(), metadata=self._conn.metadata, timeout=timeout or self._conn.timeout
                ),
                retry=False,
            )
        except InternalError as e:
            if e.message != _LOST_STATUS:
                raise
            raise await self._refusal(header, sent[0], timeout) from None
        return FileInfo.from_proto(resp.file)

    async def _refusal(self, header: pb.WriteFileHeader, sent: int, timeout: float | None) -> DSecError:
        """Why the server ended an upload while data was still being sent.

        grpcio's asyncio client loses the status of a client-streaming call
        that the server ends early, for example an upload over the server's
        limit, and reports ``INTERNAL: Internal error from Core`` instead
        (grpc/grpc#36066). The header alone, with the size sent so far, is
        asked again: the server decides refusals of the size, path, user and
        sandbox from it before anything is written, and a header it accepts
        fails only on the missing data, leaving the file untouched."""
        size = max(header.size, sent)
        lost = InternalError(
            f"write {header.path}: the server ended the upload after {sent} bytes were sent and grpcio "
            "lost its reason (grpc/grpc#36066); retry, or check the server's upload limit (node.max_upload_mb)",
            code="INTERNAL",
        )
        if size == 0:
            return lost
        probe = pb.WriteFileHeader(sandbox_id=header.sandbox_id, path=header.path, user=header.user, size=size)

        async def only_header() -> AsyncIterator[pb.WriteFileRequest]:
            yield pb.WriteFileRequest(header=probe)

        try:
            await self._conn.retrying(
                lambda: self._conn.files.WriteFile(
                    only_header(), metadata=self._conn.metadata, timeout=timeout or self._conn.timeout
                ),
                retry=False,
            )
        except DSecError as e:
            if e.message != _LOST_STATUS and not e.message.startswith("size: header says"):
                return e
        return lost

    async def list(self, path: str, depth: int = 1, *, user: str = "") -> list[FileInfo]:
        """List the directory ``path``, descending ``depth`` levels (1 = its entries)."""
        resp = await self._conn.unary(
            self._conn.files.ListDir, pb.ListDirRequest(sandbox_id=self._id, path=path, depth=depth, user=user)
        )
        return [FileInfo.from_proto(e) for e in resp.entries]

    async def stat(self, path: str, *, user: str = "") -> FileInfo:
        """Return information about ``path`` (NotFoundError if it does not exist)."""
        resp = await self._conn.unary(self._conn.files.Stat, pb.StatRequest(sandbox_id=self._id, path=path, user=user))
        return FileInfo.from_proto(resp.file)

    async def exists(self, path: str, *, user: str = "") -> bool:
        """True if ``path`` exists."""
        try:
            await self.stat(path, user=user)
        except NotFoundError:
            return False
        return True

    async def remove(self, path: str, *, user: str = "") -> None:
        """Remove a file or a directory with its contents."""
        await self._conn.unary(self._conn.files.Remove, pb.RemoveRequest(sandbox_id=self._id, path=path, user=user))

    async def make_dir(self, path: str, *, user: str = "") -> bool:
        """Create a directory and its parents; return False if it already existed."""
        resp = await self._conn.unary(
            self._conn.files.MakeDir, pb.MakeDirRequest(sandbox_id=self._id, path=path, user=user)
        )
        return bool(resp.created)

    async def move(self, source: str, destination: str, *, user: str = "") -> FileInfo:
        """Rename ``source`` to ``destination``; return the moved entry."""
        resp = await self._conn.unary(
            self._conn.files.Move,
            pb.MoveRequest(sandbox_id=self._id, source=source, destination=destination, user=user),
        )
        return FileInfo.from_proto(resp.file)


class Sandbox:
    """A running sandbox. Get one from :meth:`DSecClient.run_sandbox`,
    :meth:`DSecClient.get_sandbox` or :meth:`DSecClient.list_sandboxes`.

    ``async with sandbox:`` stops it when the block ends.
    """

    def __init__(self, conn: Conn, info: SandboxInfo, *, memory_preserved: bool = False) -> None:
        self._conn = conn
        self._info = info
        self._memory_preserved = memory_preserved
        self._reclaimed_bytes = 0
        self.files: Files = Files(conn, info.id)
        """File operations inside this sandbox."""

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self._info.state.value!r}, node_id={self._info.node_id!r})"

    @property
    def id(self) -> str:
        """The sandbox ID."""
        return self._info.id

    @property
    def from_warm_pool(self) -> bool:
        """True when the create took a prestarted sandbox from its node's warm
        pool (it started faster) instead of making one from scratch; always
        False with ``DSecRunArgs(skip_warm_pool=True)``. As the server said at
        the last call, like :attr:`info`."""
        return self._info.from_warm_pool

    @property
    def memory_preserved(self) -> bool:
        """For a sandbox :meth:`fork` returned: True when it resumed its
        source's memory and processes (VM backends), False when it has the
        source's files and its processes started again (containers). False
        for a sandbox not made by a fork."""
        return self._memory_preserved

    @property
    def parent_id(self) -> str:
        """The sandbox this one was forked from; ``""`` for one made from an image."""
        return self._info.parent_id

    @property
    def info(self) -> SandboxInfo:
        """What the server said about the sandbox at the last call (see :meth:`refresh`)."""
        return self._info

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.stop()
        except NotFoundError:
            pass
        except DSecError:
            # Leaving because of another exception: keep that one visible.
            if exc is None:
                raise

    async def refresh(self) -> SandboxInfo:
        """Fetch the sandbox's current state from the server."""
        resp = await self._conn.unary(self._conn.sandboxes.GetSandbox, pb.GetSandboxRequest(id=self.id), retry=True)
        self._info = SandboxInfo.from_proto(resp.sandbox)
        return self._info

    async def set_timeout(self, seconds: float) -> SandboxInfo:
        """Make the sandbox's lifetime end ``seconds`` from now (fractions round up).

        On a paused sandbox it sets the lifetime it gets back when it resumes
        (explicitly, or by the next call into it): ``seconds`` from the resume.
        It does not resume it, and does not extend how long it may stay paused
        (the node's ``max_paused``).
        """
        secs = math.ceil(seconds) if seconds > 0 else int(seconds)
        resp = await self._conn.unary(
            self._conn.sandboxes.SetTimeout, pb.SetTimeoutRequest(id=self.id, timeout_seconds=secs)
        )
        self._info = SandboxInfo.from_proto(resp.sandbox)
        return self._info

    async def set_network(self, network: NetworkSpec | None) -> SandboxInfo:
        """Replace the sandbox's network policy atomically while it runs.

        ``network`` takes the same forms as :attr:`DSecRunArgs.network`, e.g.
        ``{"pypi": True, "npm": False}`` or ``[{"cidr": "10.0.0.0/8", "ports": "443"}]``;
        ``None`` or an empty policy denies everything. Connections the new
        policy does not allow stop working.

        Raises:
            ConfigError: ``network`` has the wrong shape (nothing is sent).
            InvalidArgumentError: the server refused a rule; ``err.field`` names
                it (e.g. ``"network.allow[0].cidr"``) and nothing changed.
        """
        policy = NetworkPolicy() if network is None else NetworkPolicy.parse(network)
        resp = await self._conn.unary(
            self._conn.sandboxes.SetNetwork, pb.SetNetworkRequest(id=self.id, network=policy.to_proto())
        )
        self._info = SandboxInfo.from_proto(resp.sandbox)
        return self._info

    async def pause(self, *, reclaim: bool = False, filesystem_only: bool = False) -> SandboxInfo:
        """Freeze every process of the sandbox (the cgroup freezer for containers).

        A paused sandbox keeps its memory and files, is never stopped by its
        timeouts (its lifetime clock stops) and persists until it is resumed or
        stopped (or paused longer than the node's ``max_paused``). Any call into
        it — exec, files, processes, ports — resumes it first, transparently,
        as :meth:`resume` without a timeout would. Pausing a paused sandbox
        succeeds.

        With ``reclaim=True``, after the freeze its memory is pushed out of
        RAM (to swap where the node has it; page cache is dropped either
        way), as :meth:`DSecClient.pause_task` does for a whole task; the
        bytes it freed are in :attr:`reclaimed_bytes` afterwards. A backend
        that cannot reclaim refuses (``FailedPreconditionError``) and the
        sandbox stays as it was.

        With ``filesystem_only=True`` only its files are kept (E2B's pause
        with ``memory: false``): its processes end and its memory and its
        CPU and memory reservation on the node are given back; its writable
        layer, network rules, env, labels and ID stay
        (:attr:`SandboxInfo.paused_filesystem`). A resume — :meth:`resume`
        or any call into it — starts it again on the same files with a fresh
        init, once its node has room for it (else ``ResourceExhaustedError``
        and it stays paused). Container backend only (others:
        ``UnimplementedError``); not with ``reclaim``.
        """
        if not isinstance(reclaim, bool):
            raise ConfigError(f"reclaim: must be True or False, got {reclaim!r}")
        if not isinstance(filesystem_only, bool):
            raise ConfigError(f"filesystem_only: must be True or False, got {filesystem_only!r}")
        if reclaim and filesystem_only:
            raise ConfigError("reclaim: a filesystem-only pause frees all of the sandbox's memory already; drop reclaim")
        resp = await self._conn.unary(
            self._conn.sandboxes.PauseSandbox,
            pb.PauseSandboxRequest(id=self.id, reclaim=reclaim, filesystem_only=filesystem_only),
        )
        self._info = SandboxInfo.from_proto(resp.sandbox)
        self._reclaimed_bytes = resp.bytes_freed
        return self._info

    @property
    def reclaimed_bytes(self) -> int:
        """Bytes of memory the last :meth:`pause` with ``reclaim=True`` on this
        object freed (0 before one, or after a pause without reclaim)."""
        return self._reclaimed_bytes

    async def resume(self, timeout: float | None = None) -> SandboxInfo:
        """Thaw a paused sandbox; its processes continue where they stopped.

        Its lifetime continues with what was left at the pause (a sandbox
        auto-paused because its lifetime ran out gets its full timeout from
        create again), or ends ``timeout`` seconds from now when given. Resuming a running sandbox
        succeeds.
        """
        secs = 0 if timeout is None else (math.ceil(timeout) if timeout > 0 else int(timeout))
        resp = await self._conn.unary(
            self._conn.sandboxes.ResumeSandbox, pb.ResumeSandboxRequest(id=self.id, timeout_seconds=secs)
        )
        self._info = SandboxInfo.from_proto(resp.sandbox)
        return self._info

    async def fork(
        self,
        count: int = 1,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> list[Sandbox]:
        """Make ``count`` (1..64) new running sandboxes from this one's state now.

        Each fork has this sandbox's files at this instant, its image, limits,
        env, network policy, labels and task, its own ID and hostname, and
        :attr:`parent_id` = this sandbox's ID; all run on this sandbox's node.
        This sandbox (running or paused) is frozen only while its writable
        layer is copied, and keeps its state. Containers fork their files,
        not their memory: the forks' processes start again
        (:attr:`memory_preserved` False); memory forks need the VM backends.
        Either all ``count`` forks are made or none is.

        ``timeout`` is the forks' lifetime in seconds (default: this
        sandbox's). A fresh ``request_id`` (uuid4) is generated unless given;
        UNAVAILABLE is retried with the same one, so a lost answer never makes
        more forks.

        Raises:
            InvalidArgumentError: ``count`` is not 1..64 (nothing is sent).
            NotFoundError: the sandbox is gone (or not yours).
            FailedPreconditionError: the sandbox is not running or paused.
            QuotaExceededError: its node has no room for all ``count`` forks.
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK_COUNT:
            raise InvalidArgumentError(
                f"count: is {count!r}; give 1..{MAX_FORK_COUNT} forks"
            )
        secs = 0 if timeout is None else math.ceil(timeout)
        if secs < 0:
            raise InvalidArgumentError(
                f"timeout: is {timeout!r}; give seconds > 0, or None for this sandbox's lifetime"
            )
        req = pb.ForkSandboxRequest(
            sandbox_id=self.id, count=count, request_id=request_id or uuid.uuid4().hex, timeout_seconds=secs
        )
        resp = await self._conn.unary(self._conn.sandboxes.ForkSandbox, req, retry=True)
        return [
            Sandbox(self._conn, SandboxInfo.from_proto(f.sandbox), memory_preserved=f.memory_preserved)
            for f in resp.forks
        ]

    async def metrics(self) -> SandboxMetrics:
        """Return the sandbox's current CPU, memory, process and disk use."""
        resp = await self._conn.unary(
            self._conn.sandboxes.GetSandboxMetrics, pb.GetSandboxMetricsRequest(id=self.id), retry=True
        )
        return SandboxMetrics.from_proto(resp.metrics)

    async def stop(self) -> None:
        """Stop and delete the sandbox: processes, mounts, files."""
        await self._conn.unary(self._conn.sandboxes.StopSandbox, pb.StopSandboxRequest(id=self.id))
        self._info = _with_state(self._info, SandboxState.STOPPED)

    def exec(
        self,
        command: list[str] | tuple[str, ...] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bool = False,
        timeout: float | None = None,
        pty: tuple[int, int] | None = None,
        tag: str = "",
        output_limit: int | None = OUTPUT_LIMIT,
        call_id: str | None = None,
    ) -> ExecProcess:
        """Start a process and stream its output.

        Args:
            command: program and arguments (run as-is), or a string run with ``/bin/sh -c``.
            env: extra environment variables.
            cwd: working directory (default: the sandbox's).
            user: user to run as (default: the sandbox's).
            stdin: keep a stdin pipe open for :meth:`ExecProcess.send_stdin`.
            timeout: process lifetime in seconds; the agent kills it after that
                and the result has ``timed_out=True``. ``None`` = no limit
                beyond the sandbox's.
            pty: run on a pseudo-terminal of ``(cols, rows)``.
            tag: a tag to find the process later in :meth:`processes`.
            output_limit: bytes of each stream :meth:`ExecProcess.wait` keeps
                (default :data:`OUTPUT_LIMIT`, 16 MiB; ``None`` = all). Past it
                output is counted, not kept, and ``output_truncated`` is True;
                the process still runs to its end. Iterating keeps nothing.
            call_id: makes the call exactly-once through the sandbox's
                trajectory log (at most 256 bytes): a call whose ID is in the
                log returns the recorded result (``replayed=True``) without
                running, one still running is joined (``joined=True``), and one
                with a different request raises :class:`FailedPreconditionError`
                naming both. Inside ``with client.trajectory(rollout_id):`` an
                ID ``<rollout_id>/<n>`` is made for each call (n counts this
                sandbox's calls in the block). See docs/concepts.md.

        Returns:
            An :class:`ExecProcess`; ``await`` it or use ``async with`` to start it.
        """
        argv = [*SHELL, command] if isinstance(command, str) else list(command)
        start = pb.ExecStart(
            sandbox_id=self.id,
            command=argv,
            env=dict(env or {}),
            cwd=cwd or "",
            user=user or "",
            stdin=stdin,
            timeout_seconds=math.ceil(timeout) if timeout and timeout > 0 else int(timeout or 0),
            tag=tag,
            call_id=_call_id(self.id, call_id),
        )
        if pty is not None:
            start.pty.CopyFrom(pb.PtySize(cols=pty[0], rows=pty[1]))
        give_up = timeout + _DEADLINE_GRACE_SECONDS if timeout and timeout > 0 else None
        return ExecProcess(self._conn, start, give_up, output_limit)

    async def run_shell(
        self,
        cmd: str,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | str | None = None,
        output_limit: int | None = OUTPUT_LIMIT,
        call_id: str | None = None,
    ) -> ExecResult:
        """Run ``cmd`` with ``/bin/sh -c`` and return its output and exit code.

        A non-zero exit code is not an error: check ``result.exit_code``. When
        ``timeout`` passes the process is killed and ``result.timed_out`` is True.
        ``stdin`` (bytes or str) is written to the process and then closed.
        At most ``output_limit`` bytes of each stream are kept (default
        :data:`OUTPUT_LIMIT`, 16 MiB; ``None`` keeps all); past it the result
        has ``output_truncated=True`` and ``stdout_total``/``stderr_total``
        count all the bytes produced. The command still runs to its end.
        ``call_id`` makes it exactly-once (see :meth:`exec`); a replayed
        result has ``replayed=True`` and ran nothing.
        """
        proc = self.exec(
            cmd,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin is not None,
            timeout=timeout,
            output_limit=output_limit,
            call_id=call_id,
        )
        # The server enforces the limit too, so the dropped output never
        # crosses the network (exec cannot: the caller may stream all of it).
        proc._start_msg.output_limit_bytes = output_limit or 0
        await proc.start()
        try:
            if stdin is not None:
                await proc.send_stdin(stdin)
                await proc.close_stdin()
            return await proc.wait()
        except BaseException:
            await asyncio.shield(proc.close())
            raise

    async def run_shell_argv(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        call_id: str | None = None,
    ) -> ExecResult:
        """Run ``argv`` as is (no shell) and wait for it, like :meth:`run_shell`."""
        proc = self.exec(argv, env=env, cwd=cwd, user=user, call_id=call_id)
        proc._start_msg.output_limit_bytes = OUTPUT_LIMIT
        async with proc:
            return await proc.wait()

    async def trajectory(self, *, output: bool = True) -> AsyncIterator[dict[str, Any]]:
        """Stream the sandbox's trajectory log, oldest call first.

        Each item is one call as a JSON-ready dict (``json.dumps(item)`` is
        one JSON line): ``seq``, ``call_id``, ``kind``, ``state``,
        ``command``/``env``/``cwd``/``user`` for an ``exec``;
        ``path``/``sha256``/``size`` (or ``files``) and ``http_status`` for
        a ``file_write`` (a file upload; its answer is in ``stdout``),
        ``code``/``language``/``context_id``/``env``, ``http_status`` and
        ``code_error`` for a ``code`` call (a code-interpreter execution,
        e.g. E2B's ``run_code``; its result lines, JSON, are in ``stdout``),
        ``started``/``ended``, ``exit_code``, ``stdout``/``stderr`` (base64,
        up to the log's cap; ``output=False`` leaves them out),
        ``output_truncated``, ``output_compacted``, and ``origin`` for calls
        inherited from a fork's parent or a snapshot's source. The first
        item also has ``sandbox_id`` and, for a fork or a sandbox started
        from a snapshot, ``parent_id``. A stopped sandbox's
        log stays readable for its node's ``node.trajectory.retention_sec``.
        """
        req = pb.GetTrajectoryRequest(sandbox_id=self.id, without_output=not output)
        call = self._conn.processes.GetTrajectory(req, metadata=self._conn.metadata, timeout=self._conn.timeout)
        try:
            async for msg in call:
                yield json_format.MessageToDict(msg, preserving_proto_field_name=True)
        except grpc.aio.AioRpcError as e:
            raise from_grpc_error(e) from None

    async def processes(self) -> list[ProcessInfo]:
        """List the processes started through the agent that are still running."""
        resp = await self._conn.unary(
            self._conn.processes.ListProcesses, pb.ListProcessesRequest(sandbox_id=self.id), retry=True
        )
        return [ProcessInfo.from_proto(p) for p in resp.processes]

    async def signal_process(self, pid: int, signal: int = 15) -> None:
        """Send ``signal`` (default 15, SIGTERM) to process ``pid``."""
        await self._conn.unary(
            self._conn.processes.SignalProcess, pb.SignalProcessRequest(sandbox_id=self.id, pid=pid, signal=signal)
        )

    async def send_input(self, pid: int, data: bytes | str, *, pty: bool = False) -> None:
        """Write ``data`` to the stdin (or, with ``pty``, the PTY) of process ``pid``."""
        await self._conn.unary(
            self._conn.processes.SendInput,
            pb.SendInputRequest(sandbox_id=self.id, pid=pid, data=_to_bytes(data), pty=pty),
        )

    async def resize_pty(self, pid: int, cols: int, rows: int) -> None:
        """Resize the PTY of process ``pid``."""
        await self._conn.unary(
            self._conn.processes.ResizePty,
            pb.ResizePtyRequest(sandbox_id=self.id, pid=pid, size=pb.PtySize(cols=cols, rows=rows)),
        )

    def connect_port(self, port: int, *, timeout: float | None = None) -> PortStream:
        """Open a TCP stream to ``port`` inside the sandbox.

        ``await`` the result or use ``async with`` (which closes it)::

            async with sandbox.connect_port(6379) as s:
                await s.write(b"PING\\r\\n")
                print(await s.read())

        ``timeout`` bounds connecting (default 10 s on the server). A port
        outside 1..65535 raises :class:`InvalidArgumentError`; nothing
        listening raises :class:`UnavailableError` ("connection refused in
        sandbox").
        """
        return PortStream(self._conn, self.id, port, timeout)

    async def http(
        self,
        port: int,
        method: str = "GET",
        path: str = "/",
        headers: Mapping[str, str] | list[tuple[str, str]] | None = None,
        body: bytes | str | None = None,
        *,
        timeout: float | None = None,
    ) -> HTTPResponse:
        """Send one HTTP request to ``port`` inside the sandbox (path may carry a query)."""
        t = timeout or self._conn.timeout
        req = pb.HTTPRequestRequest(
            sandbox_id=self.id,
            port=port,
            method=method,
            path=path,
            headers=_headers(headers),
            body=_to_bytes(body) if body is not None else b"",
            timeout_ms=int(t * 1000),
        )
        resp = await self._conn.unary(self._conn.ports.HTTPRequest, req, timeout=t + 5)
        return HTTPResponse(
            status=resp.status, headers=[(h.name, h.value) for h in resp.headers], body=bytes(resp.body)
        )

    async def pack_diff(self, name: str, scrub_paths: Sequence[str] | None = None) -> Image:
        """Save this sandbox's changes (its writable layer) as a new layer on top
        of its image: a new image ``name`` that new sandboxes start from. The
        sandbox keeps running and the original image is unchanged.

        Args:
            name: the new image's name, e.g. ``"team/env:with-deps"``.
            scrub_paths: absolute paths left out of the new layer (the image's own
                version, if any, shows through), e.g. ``["/root/.cache"]``.

        Raises:
            InvalidArgumentError: a bad name or scrub path (``err.field`` names it).
            NotFoundError: the sandbox is gone.
        """
        return await Images(self._conn).pack_diff(self.id, name, scrub_paths)

    async def snapshot(self, name: str | None = None) -> Snapshot:
        """Save this sandbox as a snapshot you own, named ``name`` (default: the
        sandbox ID and the time). The sandbox keeps running; it is frozen only
        while its changes are copied. Start sandboxes from it with
        ``DSecRunArgs(snapshot=snap.id)``.

        On the container backend a snapshot holds the filesystem
        (:attr:`Snapshot.memory` is ``False``): sandboxes started from it have
        its files and start their processes again. Memory snapshots come with
        the VM backends.

        Raises:
            InvalidArgumentError: a bad name (``err.field == "name"``: 1-128 of
                ``[A-Za-z0-9._-]``).
            AlreadyExistsError: you already have a snapshot of that name.
            FailedPreconditionError: the sandbox is not running or paused.
            NotFoundError: the sandbox is gone (or not yours).
        """
        return await _Snapshots(self._conn).create(self.id, name)


def _with_state(info: SandboxInfo, state: SandboxState) -> SandboxInfo:
    return dataclasses.replace(info, state=state)
