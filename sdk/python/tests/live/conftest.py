"""Fixtures for the live tests, which talk to a real OpenDsec system.

They run when OPENDSEC_LIVE=1 (and then fail, never skip, if the system is
unreachable or not configured) or when OPENDSEC_ENDPOINT and OPENDSEC_TOKEN
are both set. With OPENDSEC_LIVE unset and no endpoint, they are skipped with
the reason.

Environment: OPENDSEC_ENDPOINT, OPENDSEC_TOKEN, OPENDSEC_TEST_IMAGE (default
"root/busybox"), OPENDSEC_BACKEND (default: the node's).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from opendsec import DSecClient, NotFoundError, Sandbox, UnavailableError

sys.path.insert(0, str(Path(__file__).parent))
from live_helpers import live_configured, live_required, run_args

LIVE_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the live tests, with the reason, only when OPENDSEC_LIVE is unset
    and no system is configured."""
    if live_required() or live_configured():
        return
    skip = pytest.mark.skip(
        reason="live tests need a running OpenDsec: set OPENDSEC_ENDPOINT and OPENDSEC_TOKEN "
        "(OPENDSEC_LIVE=1 makes a missing or unreachable system a failure)"
    )
    for item in items:
        if LIVE_DIR in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture
async def client() -> AsyncIterator[DSecClient]:
    """A client for the live system; fails with a clear message if it is unreachable."""
    if not live_configured():
        pytest.fail("OPENDSEC_LIVE=1 but OPENDSEC_ENDPOINT and/or OPENDSEC_TOKEN are not set")
    async with DSecClient(timeout=60, max_retries=1) as c:
        try:
            await c.list_sandboxes(labels={"opendsec-sdk-test": "ping"})
        except UnavailableError as e:
            pytest.fail(f"OpenDsec at {c.endpoint} is unreachable: {e}")
        yield c


@pytest.fixture
async def sandbox(client: DSecClient) -> AsyncIterator[Sandbox]:
    """A fresh sandbox of the test image, stopped after the test."""
    sb = await client.run_sandbox(run_args(labels={"opendsec-sdk-test": "1"}))
    try:
        yield sb
    finally:
        try:
            await sb.stop()
        except NotFoundError:
            pass
