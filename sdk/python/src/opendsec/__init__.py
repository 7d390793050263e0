"""OpenDsec Python SDK: async client for self-hosted sandboxes.

Quick start::

    import asyncio
    from opendsec import DSecClient, DSecRunArgs

    async def main() -> None:
        async with DSecClient() as client:  # OPENDSEC_ENDPOINT, OPENDSEC_TOKEN
            async with await client.run_sandbox(DSecRunArgs(image="root/py:3.11")) as sandbox:
                result = await sandbox.run_shell("python3 -c 'print(6*7)'")
                print(result.stdout, end="")

    asyncio.run(main())
"""

from opendsec import errors
from opendsec.client import (
    BatchFailure,
    BatchItem,
    BatchOutcome,
    BatchRun,
    DSecClient,
    ReplayDifference,
    ReplayReport,
    SandboxReclaim,
)
from opendsec.errors import (
    AlreadyExistsError,
    AuthenticationError,
    CancelledError,
    ConfigError,
    DSecError,
    DSecTimeoutError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    SandboxDiedError,
    UnavailableError,
    UnimplementedError,
)
from opendsec.errors import (
    TimeoutError as TimeoutError,
)
from opendsec.images import BuildEvent, GCResult, Image, ImageConfig, ImageLayer, Images, ImportProgress, VerifyResult
from opendsec.ports import PortStream
from opendsec.sandbox import CHUNK_SIZE, OUTPUT_LIMIT, ExecProcess, Files, Sandbox
from opendsec.snapshots import Snapshot
from opendsec.types import (
    DSecRunArgs,
    ExecEvent,
    ExecResult,
    FileInfo,
    FileType,
    HTTPResponse,
    NetworkPolicy,
    NetworkRule,
    NetworkSpec,
    ProcessInfo,
    SandboxInfo,
    SandboxMetrics,
    SandboxState,
)

__version__ = "0.1.0"

# TimeoutError is importable (opendsec.TimeoutError) but left out of __all__ so
# that "from opendsec import *" does not shadow the builtin; use DSecTimeoutError.
__all__ = [
    "CHUNK_SIZE",
    "OUTPUT_LIMIT",
    "AlreadyExistsError",
    "AuthenticationError",
    "BatchFailure",
    "BatchItem",
    "BatchOutcome",
    "BatchRun",
    "CancelledError",
    "ConfigError",
    "DSecClient",
    "DSecError",
    "DSecRunArgs",
    "DSecTimeoutError",
    "ExecEvent",
    "ExecProcess",
    "ExecResult",
    "FailedPreconditionError",
    "FileInfo",
    "FileType",
    "Files",
    "BuildEvent",
    "GCResult",
    "HTTPResponse",
    "Image",
    "ImageConfig",
    "ImageLayer",
    "Images",
    "ImportProgress",
    "InternalError",
    "InvalidArgumentError",
    "NetworkPolicy",
    "NetworkRule",
    "NetworkSpec",
    "NotFoundError",
    "PermissionDeniedError",
    "PortStream",
    "ProcessInfo",
    "QuotaExceededError",
    "ReplayDifference",
    "ReplayReport",
    "Sandbox",
    "SandboxDiedError",
    "SandboxInfo",
    "SandboxMetrics",
    "SandboxReclaim",
    "SandboxState",
    "Snapshot",
    "UnavailableError",
    "UnimplementedError",
    "VerifyResult",
    "__version__",
    "errors",
]
