"""TCP streams into sandbox ports (:class:`PortStream`), opened with
:meth:`opendsec.Sandbox.connect_port`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator
from types import TracebackType
from typing import Any, Self

import grpc
import grpc.aio

from opendsec._conn import Conn
from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb
from opendsec.errors import (
    DSecTimeoutError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    from_grpc_error,
)

__all__ = ["PORT_CHUNK_SIZE", "PortStream"]

#: Most bytes one message of the stream carries; :meth:`PortStream.write` splits larger writes.
PORT_CHUNK_SIZE = 32 * 1024


def _check_port(port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int):
        raise InvalidArgumentError(f"port: must be an int between 1 and 65535, got {port!r}")
    if not 1 <= port <= 65535:
        raise InvalidArgumentError(f"port: {port} must be between 1 and 65535")
    return port


class PortStream:
    """A TCP connection to a port inside a sandbox, relayed by the node.

    Open it with ``await`` (``s = await sandbox.connect_port(8000)``) or
    ``async with sandbox.connect_port(8000) as s:`` (closed on exit). Then::

        await s.write(b"GET / HTTP/1.0\\r\\n\\r\\n")
        await s.close_write()            # the server reads EOF
        data = await s.read_all()        # until the server closes

    :meth:`read` returns ``b""`` once the server in the sandbox closed its
    side; that is a half-close, so :meth:`write` keeps working until
    :meth:`close_write` or :meth:`close`. Nothing listening on the port raises
    :class:`UnavailableError` ("connection refused in sandbox").
    """

    def __init__(self, conn: Conn, sandbox_id: str, port: int, timeout: float | None) -> None:
        self._conn = conn
        self._start_msg = pb.ConnectPortStart(
            sandbox_id=sandbox_id,
            port=_check_port(port),
            timeout_ms=int(timeout * 1000) if timeout else 0,
        )
        self._timeout = timeout
        self._call: Any = None
        self._buf = b""
        self._eof = False
        self._write_closed = False
        self._closed = False
        self._read_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._open_lock = asyncio.Lock()

    @property
    def port(self) -> int:
        """The port inside the sandbox."""
        return self._start_msg.port

    @property
    def at_eof(self) -> bool:
        """True once the server in the sandbox closed its side and all data was read."""
        return self._eof and not self._buf

    def __await__(self) -> Generator[Any, None, Self]:
        return self.open().__await__()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> Self:
        """Connect and wait until the server in the sandbox accepted. Idempotent."""
        async with self._open_lock:
            if self._call is not None:
                return self
            if self._closed:
                raise FailedPreconditionError(f"port {self.port}: the stream is closed")
            self._call = self._conn.ports.ConnectPort(metadata=self._conn.metadata)
            wait = (self._timeout or 10.0) + self._conn.timeout
            try:
                await self._call.write(pb.ConnectPortRequest(start=self._start_msg))
                msg = await asyncio.wait_for(self._call.read(), wait)
            except BaseException as e:
                self._call.cancel()
                self._closed = True
                if isinstance(e, grpc.aio.AioRpcError):
                    raise from_grpc_error(e) from None
                if isinstance(e, TimeoutError):
                    raise DSecTimeoutError(f"connect to port {self.port}: no answer within {wait:g}s") from None
                raise
            if msg is grpc.aio.EOF or msg.WhichOneof("event") != "connected":
                self._call.cancel()
                self._closed = True
                raise InternalError(f"connect to port {self.port}: the server did not confirm the connection")
            return self

    def _need_open(self, what: str) -> None:
        if self._call is None:
            raise FailedPreconditionError(f"{what}: open the stream first (await it or use async with)")
        if self._closed:
            raise FailedPreconditionError(f"{what}: the stream to port {self.port} is closed")

    async def _fill(self) -> None:
        """Read the next data message into the buffer, or mark EOF."""
        while not self._buf and not self._eof:
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as e:
                self._eof = True
                raise from_grpc_error(e) from None
            if msg is grpc.aio.EOF:
                self._eof = True
                return
            kind = msg.WhichOneof("event")
            if kind == "data":
                self._buf = bytes(msg.data)
            elif kind == "eof":
                # The server half-closed; the stream stays open for writing.
                self._eof = True
                return

    async def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes (``-1``: whatever arrives next). ``b""`` means EOF."""
        self._need_open("read")
        if n == 0:
            return b""
        async with self._read_lock:
            await self._fill()
            if n < 0:
                n = len(self._buf)
            out, self._buf = self._buf[:n], self._buf[n:]
            return out

    async def read_exactly(self, n: int) -> bytes:
        """Read exactly ``n`` bytes; :class:`asyncio.IncompleteReadError` if EOF comes first."""
        out = bytearray()
        while len(out) < n:
            chunk = await self.read(n - len(out))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(out), n)
            out.extend(chunk)
        return bytes(out)

    async def read_all(self) -> bytes:
        """Read until the server in the sandbox closes (or half-closes) its side."""
        out = bytearray()
        while chunk := await self.read():
            out.extend(chunk)
        return bytes(out)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read():
            yield chunk

    async def write(self, data: bytes | bytearray | memoryview | str) -> None:
        """Send ``data`` to the server in the sandbox."""
        self._need_open("write")
        if isinstance(data, str):
            data = data.encode("utf-8")
        view = memoryview(data)
        async with self._write_lock:
            if self._write_closed:
                raise FailedPreconditionError(f"write: the stream to port {self.port} was closed for writing")
            try:
                for off in range(0, len(view), PORT_CHUNK_SIZE):
                    await self._call.write(pb.ConnectPortRequest(data=bytes(view[off : off + PORT_CHUNK_SIZE])))
            except grpc.aio.AioRpcError as e:
                raise from_grpc_error(e) from None
            except asyncio.InvalidStateError:
                raise FailedPreconditionError(f"write: the stream to port {self.port} has ended") from None

    async def close_write(self) -> None:
        """Half-close: the server reads EOF; reading goes on. Idempotent."""
        self._need_open("close_write")
        async with self._write_lock:
            if self._write_closed:
                return
            self._write_closed = True
            try:
                await self._call.done_writing()
            except grpc.aio.AioRpcError as e:
                raise from_grpc_error(e) from None
            except asyncio.InvalidStateError:
                pass

    async def close(self) -> None:
        """Close both directions; the connection inside the sandbox closes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._call is not None:
            self._call.cancel()
