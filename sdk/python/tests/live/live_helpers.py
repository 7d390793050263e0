"""Settings and helpers shared by the live tests (see conftest.py)."""

from __future__ import annotations

import os

from opendsec import DSecRunArgs

IMAGE = os.environ.get("OPENDSEC_TEST_IMAGE", "root/busybox")
BACKEND = os.environ.get("OPENDSEC_BACKEND", "")
# The system's nodes keep a warm pool (the default); OPENDSEC_TEST_WARM_POOL=0
# says they do not (node.warm_pool.size 0).
WARM_POOL = os.environ.get("OPENDSEC_TEST_WARM_POOL", "1") not in ("0", "false")


def live_required() -> bool:
    """OPENDSEC_LIVE=1: the live tests must run and must not be skipped."""
    return os.environ.get("OPENDSEC_LIVE", "") not in ("", "0", "false")


def live_configured() -> bool:
    """Both the endpoint and the token are set."""
    return bool(os.environ.get("OPENDSEC_ENDPOINT")) and bool(os.environ.get("OPENDSEC_TOKEN"))


def run_args(**kw: object) -> DSecRunArgs:
    """Run arguments for the test image and backend, with overrides."""
    base: dict[str, object] = {"backend": BACKEND, "image": IMAGE, "timeout": 300}
    base.update(kw)
    return DSecRunArgs(**base)  # type: ignore[arg-type]
