"""Live tests of Sandbox.connect_port: a raw TCP stream to a server inside a
real sandbox, through the apiserver, the node and the agent."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from opendsec import DSecError, InvalidArgumentError, PortStream, Sandbox, UnavailableError

pytestmark = pytest.mark.live

SERVER = "exec httpd -f -p 0.0.0.0:8000 -h /tmp/www"


async def _get(sandbox: Sandbox, path: str) -> bytes:
    """GET path from the sandbox's port 8000 over a raw stream (HTTP/1.0, half-close)."""
    async with sandbox.connect_port(8000, timeout=5) as s:
        await s.write(f"GET {path} HTTP/1.0\r\n\r\n")
        await s.close_write()
        return await s.read_all()


async def _serve(sandbox: Sandbox) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if (await _get(sandbox, "/index.html")).endswith(b"hello from the sandbox\n"):
                return
        except DSecError:
            pass
        if time.monotonic() > deadline:
            pytest.fail("the server in the sandbox did not answer on port 8000 within 30s")
        await asyncio.sleep(0.1)


async def test_connect_port_streams_both_ways(sandbox: Sandbox) -> None:
    await sandbox.files.write("/tmp/www/index.html", "hello from the sandbox\n")
    r = await sandbox.run_shell("dd if=/dev/urandom of=/tmp/www/big bs=1024 count=3072 2>/dev/null")
    assert r.exit_code == 0, r.stderr
    proc = await sandbox.exec(SERVER)
    try:
        await _serve(sandbox)
        raw = await _get(sandbox, "/big")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0], head[:200]
        want = await sandbox.files.read("/tmp/www/big")
        assert len(body) == 3 * 1024 * 1024
        assert hashlib.sha256(body).digest() == hashlib.sha256(want).digest()

        # Several streams at once, each its own connection.
        bodies = await asyncio.gather(*(_get(sandbox, "/index.html") for _ in range(8)))
        assert all(b.endswith(b"\r\n\r\nhello from the sandbox\n") for b in bodies)
    finally:
        await proc.close()


async def test_connect_port_errors(sandbox: Sandbox) -> None:
    with pytest.raises(UnavailableError, match="connection refused in sandbox"):
        await sandbox.connect_port(8001)
    for bad in (0, 65536):
        with pytest.raises(InvalidArgumentError, match="port"):
            sandbox.connect_port(bad)
    s = sandbox.connect_port(8001)
    assert isinstance(s, PortStream)
    with pytest.raises(DSecError, match="open the stream first"):
        await s.read()
