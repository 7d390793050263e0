"""Typed exceptions raised by the OpenDsec SDK.

Every gRPC error from the server is turned into a subclass of
:class:`DSecError` whose message is the server's own message; the original
status code is kept in :attr:`DSecError.code`.
"""

from __future__ import annotations

import builtins
from typing import Any

import grpc

__all__ = [
    "AlreadyExistsError",
    "AuthenticationError",
    "CancelledError",
    "ConfigError",
    "DSecError",
    "DSecTimeoutError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "SandboxDiedError",
    "TimeoutError",
    "UnavailableError",
    "UnimplementedError",
    "from_code_name",
    "from_grpc_error",
]


class DSecError(Exception):
    """Base class of every error raised by the SDK.

    Attributes:
        message: the server's message (or the SDK's, for client-side errors).
        code: the gRPC status code name, e.g. ``"NOT_FOUND"``; empty for
            errors raised by the SDK itself.
    """

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return self.message


class ConfigError(DSecError, ValueError):
    """The client is missing configuration (endpoint, token) or got a malformed value."""


class InvalidArgumentError(DSecError, ValueError):
    """The server rejected a request field (gRPC ``INVALID_ARGUMENT``).

    Attributes:
        field: the offending field when the server named it (the server's
            messages read ``"<field>: <what is wrong and how to fix it>"``),
            else ``""``.
    """

    def __init__(self, message: str, *, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message, code=code)
        head, sep, _ = message.partition(": ")
        self.field = head if sep and head and " " not in head else ""


class NotFoundError(DSecError):
    """The sandbox, image, file or process does not exist (``NOT_FOUND``)."""


class AlreadyExistsError(DSecError):
    """The object already exists (``ALREADY_EXISTS``)."""


class FailedPreconditionError(DSecError):
    """The request is valid but the system is not in a state to run it (``FAILED_PRECONDITION``)."""


class SandboxDiedError(FailedPreconditionError):
    """The sandbox died: its init ended without a stop (a crash, a kill from
    outside, the OOM killer). It is gone; create a new one. A
    :class:`FailedPreconditionError` (``FAILED_PRECONDITION``).

    Attributes:
        reason: why, as the node saw it, e.g. ``"killed by signal 9"``.
    """

    def __init__(self, message: str, *, code: str = "FAILED_PRECONDITION", reason: str = "") -> None:
        super().__init__(message, code=code)
        self.reason = reason


class QuotaExceededError(DSecError):
    """A quota or a node's capacity is exhausted (``RESOURCE_EXHAUSTED``)."""


class UnavailableError(DSecError, ConnectionError):
    """The server or a node cannot be reached right now (``UNAVAILABLE``); retry later."""


class TimeoutError(DSecError, builtins.TimeoutError):
    """A deadline passed (``DEADLINE_EXCEEDED``). Also a :class:`builtins.TimeoutError`."""


DSecTimeoutError = TimeoutError
"""Alias of :class:`opendsec.errors.TimeoutError` that does not shadow the builtin name."""


class AuthenticationError(DSecError):
    """The token is missing, unknown, expired or revoked (``UNAUTHENTICATED``)."""


class PermissionDeniedError(DSecError, PermissionError):
    """The token is valid but not allowed to do this (``PERMISSION_DENIED``)."""


class UnimplementedError(DSecError, NotImplementedError):
    """The server does not implement this call or option (``UNIMPLEMENTED``)."""


class CancelledError(DSecError):
    """The call was cancelled (``CANCELLED``)."""


class InternalError(DSecError):
    """The server failed (``INTERNAL``, ``UNKNOWN``, ``DATA_LOSS`` and other codes)."""


_BY_CODE: dict[grpc.StatusCode, type[DSecError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TimeoutError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.CANCELLED: CancelledError,
}

# Connect code names ("not_found"), as carried in BatchCreateSandboxesResponse.error_code.
_BY_NAME: dict[str, grpc.StatusCode] = {c.name: c for c in grpc.StatusCode}
_BY_NAME["CANCELED"] = grpc.StatusCode.CANCELLED


def _make(code: grpc.StatusCode | None, name: str, message: str) -> DSecError:
    cls = _BY_CODE.get(code, InternalError) if code is not None else InternalError
    if not message:
        message = f"server returned {name or 'an error'} without a message"
    return cls(message, code=name)


# The answer metadata that marks a call into a sandbox that died; its value
# is the reason (the server's errdefs.DiedMetadataKey).
DIED_METADATA_KEY = "opendsec-sandbox-died"


def _metadata_value(err: Any, key: str) -> str:
    for getter in ("trailing_metadata", "initial_metadata"):
        md = getattr(err, getter, None)
        if md is None:
            continue
        try:
            items = md()
        except Exception:
            continue
        for k, v in items or ():
            if k.lower() == key:
                return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
    return ""


def from_grpc_error(err: grpc.RpcError | Any) -> DSecError:
    """Map a ``grpc.aio.AioRpcError`` (or any ``grpc.RpcError`` with ``code()``
    and ``details()``) to the matching :class:`DSecError` subclass, keeping the
    server's message. A call into a sandbox that died (the server marks it
    with the ``opendsec-sandbox-died`` metadata) is a :class:`SandboxDiedError`."""
    code: grpc.StatusCode | None = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else None
    name = code.name if code is not None else "UNKNOWN"
    reason = _metadata_value(err, DIED_METADATA_KEY)
    if reason:
        return SandboxDiedError(details or f"sandbox died: {reason}", code=name, reason=reason)
    return _make(code, name, details or "")


def from_code_name(name: str, message: str) -> DSecError:
    """Map a Connect or gRPC code name (``"not_found"``, ``"NOT_FOUND"``,
    ``"resource_exhausted"``) and a message to a :class:`DSecError`."""
    key = name.strip().upper()
    code = _BY_NAME.get(key)
    return _make(code, code.name if code is not None else key or "UNKNOWN", message)
