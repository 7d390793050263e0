"""Unit tests of Sandbox.connect_port / PortStream against an in-process
server whose ConnectPort behaves like an echo server: the SDK's framing,
chunking, half-close, cancel and error mapping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from fake_server import GOOD_TOKEN, FakeServer, start

from opendsec import DSecClient, InvalidArgumentError, PortStream, Sandbox, UnavailableError
from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb
from opendsec.ports import PORT_CHUNK_SIZE


class EchoPorts(FakeServer):
    """ConnectPort echoes data back and ends after the caller half-closes.
    Port 1 refuses like a port nobody listens on."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[pb.ConnectPortStart] = []
        self.chunks: list[int] = []
        self.ended = asyncio.Event()

    async def ConnectPort(self, request_iterator: Any, context: Any) -> AsyncIterator[pb.ConnectPortResponse]:
        await self._auth(context, "ConnectPort")
        try:
            it = request_iterator.__aiter__()
            first = await it.__anext__()
            self.starts.append(first.start)
            if first.start.port == 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused in sandbox: port 1 is not open")
            yield pb.ConnectPortResponse(connected=pb.ConnectPortConnected())
            async for m in it:
                if m.WhichOneof("msg") == "close_write":
                    break
                self.chunks.append(len(m.data))
                yield pb.ConnectPortResponse(data=m.data)
            yield pb.ConnectPortResponse(data=b"|eof")
        finally:
            self.ended.set()


@pytest.fixture
async def echo() -> AsyncIterator[tuple[EchoPorts, Sandbox]]:
    f = EchoPorts()
    server, port = await start(f)
    try:
        async with DSecClient(f"127.0.0.1:{port}", GOOD_TOKEN, timeout=10, retry_backoff=0.001) as c:
            sb = await c.get_sandbox(f._make(pb.SandboxSpec(image="root/busybox"), "sb1").id)
            yield f, sb
    finally:
        await server.stop(None)


async def test_connect_port_round_trip(echo: tuple[EchoPorts, Sandbox]) -> None:
    f, sb = echo
    payload = bytes(range(256)) * 1024  # 256 KiB: several messages
    async with sb.connect_port(8000, timeout=3) as s:
        assert isinstance(s, PortStream)
        await s.write(payload)
        await s.write("ok")
        await s.close_write()
        got = await s.read_all()
        assert s.at_eof
    assert got == payload + b"ok|eof"
    assert f.starts[0].sandbox_id == "sb1" and f.starts[0].port == 8000 and f.starts[0].timeout_ms == 3000
    assert max(f.chunks) == PORT_CHUNK_SIZE


async def test_connect_port_read_sizes(echo: tuple[EchoPorts, Sandbox]) -> None:
    _, sb = echo
    s = await sb.connect_port(8000)
    try:
        await s.write(b"hello world")
        assert await s.read_exactly(5) == b"hello"
        assert await s.read(3) == b" wo"
        await s.close_write()
        assert await s.read_all() == b"rld|eof"
        assert await s.read() == b""
    finally:
        await s.close()


async def test_close_ends_the_server_side(echo: tuple[EchoPorts, Sandbox]) -> None:
    f, sb = echo
    s = await sb.connect_port(8000)
    await s.write(b"x")
    assert await s.read() == b"x"
    await s.close()
    await asyncio.wait_for(f.ended.wait(), 10)
    with pytest.raises(Exception, match="closed"):
        await s.read()


async def test_connect_port_errors(echo: tuple[EchoPorts, Sandbox]) -> None:
    f, sb = echo
    for bad in (0, 65536, -1):
        with pytest.raises(InvalidArgumentError, match="port"):
            sb.connect_port(bad)
    with pytest.raises(UnavailableError, match="connection refused in sandbox"):
        await sb.connect_port(1)
    assert [s.port for s in f.starts] == [1]


class HalfClosingPorts(FakeServer):
    """ConnectPort's port sends b"hello" and half-closes (eof), then reads
    what the caller sends until close_write."""

    def __init__(self) -> None:
        super().__init__()
        self.got = b""
        self.ended = asyncio.Event()

    async def ConnectPort(self, request_iterator: Any, context: Any) -> AsyncIterator[pb.ConnectPortResponse]:
        await self._auth(context, "ConnectPort")
        try:
            it = request_iterator.__aiter__()
            await it.__anext__()
            yield pb.ConnectPortResponse(connected=pb.ConnectPortConnected())
            yield pb.ConnectPortResponse(data=b"hello")
            yield pb.ConnectPortResponse(eof=True)
            async for m in it:
                if m.WhichOneof("msg") == "close_write":
                    break
                self.got += m.data
        finally:
            self.ended.set()


async def test_connect_port_server_half_close() -> None:
    f = HalfClosingPorts()
    server, port = await start(f)
    try:
        async with DSecClient(f"127.0.0.1:{port}", GOOD_TOKEN, timeout=10, retry_backoff=0.001) as c:
            sb = await c.get_sandbox(f._make(pb.SandboxSpec(image="root/busybox"), "sb1").id)
            async with sb.connect_port(8000) as s:
                # read_all returns at the server's half-close, not at the stream's end.
                assert await asyncio.wait_for(s.read_all(), 10) == b"hello"
                assert s.at_eof
                assert await s.read() == b""
                await s.write(b"still ")
                await s.write(b"writing")
                await s.close_write()
                await asyncio.wait_for(f.ended.wait(), 10)
            assert f.got == b"still writing"
    finally:
        await server.stop(None)
