"""Acceptance tests of OpenDsec's E2B gateway with the unmodified E2B SDK.

Only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (and E2B_DOMAIN) are set;
scripts/test-e2b.sh starts a throwaway `opendsec up` and sets them.
"""

import os
import uuid

import pytest
from e2b import AsyncSandbox, Sandbox

for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
    if not os.environ.get(var):
        raise RuntimeError(f"{var} is not set; run scripts/test-e2b.sh")


@pytest.fixture
def test_id():
    return uuid.uuid4().hex[:12]


@pytest.fixture
def sandbox(test_id):
    sbx = Sandbox.create(metadata={"sandbox_test_id": test_id}, envs={"SBX_WIDE": "everywhere"})
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
async def async_sandbox(test_id):
    sbx = await AsyncSandbox.create(metadata={"sandbox_test_id": test_id})
    try:
        yield sbx
    finally:
        await sbx.kill()
