"""Connection internals shared by the client, sandboxes, processes and files."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
import grpc.aio

from opendsec._gen.opendsec.v1 import sandbox_pb2_grpc as pbg
from opendsec.errors import ConfigError, DSecError, UnavailableError, from_grpc_error

T = TypeVar("T")

ENV_ENDPOINT = "OPENDSEC_ENDPOINT"
ENV_TOKEN = "OPENDSEC_TOKEN"
ENV_CA_FILE = "OPENDSEC_CA_FILE"

# Largest message we accept or send; file chunks are 1 MiB, so this is slack.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def parse_endpoint(endpoint: str) -> tuple[str, bool]:
    """Turn an endpoint into a gRPC target and whether it uses TLS.

    Accepts ``host:port``, ``http://host[:port]`` (plaintext), ``https://host[:port]``
    (TLS) and ``unix:///path`` / ``unix:path``.
    """
    ep = endpoint.strip()
    if not ep:
        raise ConfigError(f"endpoint is empty: pass endpoint= or set {ENV_ENDPOINT}, e.g. 127.0.0.1:7070")
    if ep.startswith("unix:"):
        return ep, False
    if "://" not in ep:
        if "/" in ep:
            raise ConfigError(f"endpoint {endpoint!r}: use host:port or http(s)://host:port, e.g. 127.0.0.1:7070")
        if ":" not in ep.rsplit("]", 1)[-1]:
            raise ConfigError(f"endpoint {endpoint!r} has no port: use host:port, e.g. 127.0.0.1:7070")
        return ep, False
    u = urlsplit(ep)
    if u.scheme not in ("http", "https"):
        raise ConfigError(f"endpoint {endpoint!r}: scheme must be http or https, got {u.scheme!r}")
    if not u.hostname:
        raise ConfigError(f"endpoint {endpoint!r} has no host, e.g. http://127.0.0.1:7070")
    if u.path not in ("", "/") or u.query:
        raise ConfigError(f"endpoint {endpoint!r}: remove the path; use {u.scheme}://{u.netloc}")
    tls = u.scheme == "https"
    try:
        port = u.port or (443 if tls else 80)
    except ValueError as e:
        raise ConfigError(f"endpoint {endpoint!r}: bad port: {e}") from None
    host = u.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}", tls


class Conn:
    """A channel, its stubs, the auth metadata and the call policy."""

    def __init__(
        self,
        endpoint: str | None,
        token: str | None,
        *,
        timeout: float,
        max_retries: int,
        retry_backoff: float,
    ) -> None:
        endpoint = endpoint if endpoint is not None else os.environ.get(ENV_ENDPOINT, "")
        token = token if token is not None else os.environ.get(ENV_TOKEN, "")
        if not endpoint:
            raise ConfigError(
                f"no endpoint: pass DSecClient(endpoint=...) or set {ENV_ENDPOINT} "
                "(e.g. 127.0.0.1:7070 or http://127.0.0.1:7070)"
            )
        if not token:
            raise ConfigError(
                f"no token: pass DSecClient(token=...) or set {ENV_TOKEN} "
                "(opendsec up prints the bootstrap token; quickstart writes it to demo.env)"
            )
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        if max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0, got {max_retries}")
        self.target, tls = parse_endpoint(endpoint)
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),)
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        if tls:
            ca = os.environ.get(ENV_CA_FILE)
            roots = None
            if ca:
                with open(ca, "rb") as f:
                    roots = f.read()
            self.channel = grpc.aio.secure_channel(self.target, grpc.ssl_channel_credentials(roots), options=options)
        else:
            self.channel = grpc.aio.insecure_channel(self.target, options=options)
        self.sandboxes = pbg.SandboxServiceStub(self.channel)
        self.processes = pbg.ProcessServiceStub(self.channel)
        self.files = pbg.FileServiceStub(self.channel)
        self.ports = pbg.PortServiceStub(self.channel)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self.channel.close()

    async def unary(
        self,
        method: Callable[..., Any],
        request: Any,
        *,
        timeout: float | None = None,
        retry: bool = False,
    ) -> Any:
        """Call a unary method with the auth metadata and deadline, mapping errors.

        With ``retry``, UNAVAILABLE is retried (same request) up to ``max_retries``
        times with exponential backoff and jitter.
        """


        async def call() -> Any:
            resp = await method(request, metadata=self.metadata, timeout=timeout or self.timeout)
            if resp is None:
                # grpc.aio logs "Exception deserializing message!" and returns
                # None for an answer it could not decode (an intermittent
                # client-side fault seen under many concurrent calls).
                raise UnavailableError(
                    "the server's answer could not be decoded by the gRPC client; "
                    "retry (the SDK does so itself for idempotent calls)"
                )
            return resp

        return await self.retrying(call, retry=retry)

    async def retrying(self, fn: Callable[[], Awaitable[T]], *, retry: bool) -> T:
        """Await ``fn()``, mapping gRPC errors; retry UNAVAILABLE when ``retry``."""
        attempt = 0
        while True:
            try:
                return await fn()
            except (grpc.aio.AioRpcError, UnavailableError) as e:
                err = from_grpc_error(e) if isinstance(e, grpc.aio.AioRpcError) else e
                if not (retry and isinstance(err, UnavailableError) and attempt < self.max_retries):
                    raise err from None
            delay = self.retry_backoff * (2**attempt)
            attempt += 1
            if delay > 0:
                await asyncio.sleep(delay * (0.5 + random.random() / 2))


def map_error(e: BaseException) -> BaseException:
    """Return the SDK error for a gRPC error, or ``e`` unchanged."""
    if isinstance(e, grpc.aio.AioRpcError):
        return from_grpc_error(e)
    return e


__all__ = ["Conn", "DSecError", "map_error", "parse_endpoint"]
