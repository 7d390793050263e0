"""Fixtures for the unit tests: an in-process fake server and a client for it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_server import GOOD_TOKEN, FakeServer, start

from opendsec import DSecClient


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeServer, int]]:
    """A running fake server and its port."""
    f = FakeServer()
    server, port = await start(f)
    try:
        yield f, port
    finally:
        await server.stop(None)


@pytest.fixture
async def client(fake: tuple[FakeServer, int]) -> AsyncIterator[DSecClient]:
    """A client for the fake server with the right token and fast retries."""
    _, port = fake
    async with DSecClient(f"127.0.0.1:{port}", GOOD_TOKEN, timeout=10, retry_backoff=0.001) as c:
        yield c


@pytest.fixture
def server(fake: tuple[FakeServer, int]) -> FakeServer:
    """The fake server's recorded state."""
    return fake[0]
