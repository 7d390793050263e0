"""Images in the shared store: import, list, inspect, tag, remove, compose,
garbage-collect, verify. Reach them as ``client.images``; save a sandbox's
changes as an image with :meth:`opendsec.Sandbox.pack_diff`."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import re
import tarfile
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import IO

import grpc.aio

from opendsec._conn import Conn
from opendsec._gen.opendsec.v1 import image_pb2 as ipb
from opendsec._gen.opendsec.v1 import image_pb2_grpc as ipbg
from opendsec.errors import ConfigError, InternalError, UnavailableError, from_grpc_error

__all__ = [
    "BuildEvent",
    "GCResult",
    "Image",
    "ImageConfig",
    "ImageLayer",
    "Images",
    "ImportProgress",
    "VerifyResult",
]

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class ImageLayer:
    """One read-only layer: ``digest`` is ``"sha256:<hex>"`` of its content,
    ``size`` the bytes of file content in it."""

    digest: str
    size: int


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """An image's runtime defaults."""

    env: list[str] = dataclasses.field(default_factory=list)
    workdir: str = ""
    user: str = ""
    entrypoint: list[str] = dataclasses.field(default_factory=list)
    cmd: list[str] = dataclasses.field(default_factory=list)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    start_cmd: str = ""
    ready_cmd: str = ""
    exposed_ports: list[str] = dataclasses.field(default_factory=list)

    def to_proto(self) -> ipb.ImageConfig:
        return ipb.ImageConfig(
            env=self.env,
            workdir=self.workdir,
            user=self.user,
            entrypoint=self.entrypoint,
            cmd=self.cmd,
            labels=self.labels,
            start_cmd=self.start_cmd,
            ready_cmd=self.ready_cmd,
            exposed_ports=self.exposed_ports,
        )


@dataclasses.dataclass(frozen=True)
class Image:
    """An image: ordered layers (bottom first) and a config.

    Attributes:
        name: normalized name with a tag, e.g. ``"root/busybox:latest"``.
        id: ``"sha256:<hex>"`` digest of the manifest (layers + config).
        created: when this name was written.
        size: bytes of file content in all layers.
        layers: the layers, bottom first.
        config: env, workdir, user, entrypoint, cmd, labels.
        source: where it came from (registry reference, ``dir:``, ``compose:``, ``sandbox:<id>``).
    """

    name: str
    id: str
    created: _dt.datetime | None
    size: int
    layers: list[ImageLayer]
    config: ImageConfig
    source: str

    @classmethod
    def from_proto(cls, m: ipb.Image) -> Image:
        c = m.config
        return cls(
            name=m.name,
            id=m.id,
            created=m.created.ToDatetime(tzinfo=_dt.UTC) if m.HasField("created") else None,
            size=m.size,
            layers=[ImageLayer(digest=layer.digest, size=layer.size) for layer in m.layers],
            config=ImageConfig(
                env=list(c.env),
                workdir=c.workdir,
                user=c.user,
                entrypoint=list(c.entrypoint),
                cmd=list(c.cmd),
                labels=dict(c.labels),
                start_cmd=c.start_cmd,
                ready_cmd=c.ready_cmd,
                exposed_ports=list(c.exposed_ports),
            ),
            source=m.source,
        )


@dataclasses.dataclass(frozen=True)
class BuildEvent:
    """One message of :meth:`Images.build`: a step's start (``done`` false) or
    end (``cached`` when it came from the build cache), or output of a RUN
    step (``stream`` is ``"stdout"`` or ``"stderr"``, ``data`` its bytes)."""

    step: int
    total: int
    instruction: str = ""
    done: bool = False
    cached: bool = False
    duration_ms: int = 0
    stream: str = ""
    data: bytes = b""


# Size of one UploadBuildContext message.
_CHUNK = 1 << 20


def _context_tar(context_dir: str) -> IO[bytes]:
    """``context_dir`` as a tar in a temporary file (on disk past 8 MiB), rewound."""
    f = tempfile.SpooledTemporaryFile(max_size=8 << 20)  # noqa: SIM115 - returned to the caller
    with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(context_dir, arcname=".", recursive=True, filter=_plain_entry)
    f.seek(0)
    return f


def _plain_entry(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if not (ti.isfile() or ti.isdir() or ti.issym()):
        return None  # devices, fifos: left out
    ti.uname = ti.gname = ""
    if ti.name == ".":
        ti.name = "./"
    elif not ti.name.startswith("./"):
        ti.name = "./" + ti.name
    return ti


@dataclasses.dataclass(frozen=True)
class ImportProgress:
    """An import's advance; totals are 0 when unknown."""

    files: int
    bytes: int
    total_files: int
    total_bytes: int


@dataclasses.dataclass(frozen=True)
class GCResult:
    """What :meth:`Images.gc` removed."""

    removed_layers: list[str]
    removed_bytes: int


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What :meth:`Images.verify` found: ``corrupt`` maps digests to reasons."""

    checked: int
    corrupt: dict[str, str]


class Images:
    """The shared image store (``client.images``)."""

    def __init__(self, conn: Conn) -> None:
        self._conn = conn
        self._stub = ipbg.ImageServiceStub(conn.channel)

    async def import_(
        self,
        ref: str,
        name: str | None = None,
        progress: Callable[[ImportProgress], None] | None = None,
        *,
        merge_layers: bool = False,
        insecure: bool = False,
        timeout: float | None = None,
    ) -> Image:
        """Pull ``ref`` from an OCI or Docker registry into the store.

        Args:
            ref: ``REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]``.
            name: store it under this name (default: the repository and tag of ``ref``).
            progress: called with each :class:`ImportProgress` as layers arrive.
            merge_layers: merge runs of small consecutive layers into one.
            insecure: plain HTTP to a registry that is not on loopback.
            timeout: deadline in seconds for the whole import (default: none).

        Raises:
            ConfigError: ``ref`` is empty (nothing is sent).
            InvalidArgumentError, NotFoundError, UnavailableError: from the server;
                the store is unchanged.
        """
        if not ref or not ref.strip():
            raise ConfigError("ref is empty: give a registry reference like registry.example:5000/team/app:v1")
        req = ipb.ImportImageRequest(ref=ref, name=name or "", merge_layers=merge_layers, insecure=insecure)
        call = self._stub.ImportImage(req, metadata=self._conn.metadata, timeout=timeout)
        image: Image | None = None
        try:
            async for msg in call:
                which = msg.WhichOneof("event")
                if which == "progress" and progress is not None:
                    p = msg.progress
                    progress(ImportProgress(p.files, p.bytes, p.total_files, p.total_bytes))
                elif which == "image":
                    image = Image.from_proto(msg.image)
        except grpc.aio.AioRpcError as e:
            raise from_grpc_error(e) from None
        if image is None:
            raise UnavailableError("import stream ended without the image; try again")
        return image

    async def upload_context(self, context_dir: str, *, timeout: float | None = None) -> str:
        """Upload ``context_dir`` as a build context (a tar streamed in 1 MiB
        pieces, from a temporary file, never all in memory) and return its ID
        for one :meth:`build` within an hour. The node bounds its size
        (``node.build.max_context_mb``)."""
        if not os.path.isdir(context_dir):
            raise ConfigError(f"context_dir {context_dir!r} is not a directory")
        f = _context_tar(context_dir)
        try:
            size = f.seek(0, os.SEEK_END)
            f.seek(0)

            async def pieces() -> AsyncIterator[ipb.UploadBuildContextRequest]:
                first = True
                while True:
                    data = f.read(_CHUNK)
                    if not data and not first:
                        return
                    yield ipb.UploadBuildContextRequest(data=data, size=size if first else 0)
                    first = False
                    if not data:
                        return

            async def only_size() -> AsyncIterator[ipb.UploadBuildContextRequest]:
                yield ipb.UploadBuildContextRequest(size=size)

            try:
                resp = await self._stub.UploadBuildContext(pieces(), metadata=self._conn.metadata, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                err = from_grpc_error(e)
                if not isinstance(err, InternalError):
                    raise err from None
                # grpcio loses the status of a client stream the server
                # ends early (grpc/grpc#36066): ask again with the size
                # alone, which the server refuses the same way.
                try:
                    await self._stub.UploadBuildContext(only_size(), metadata=self._conn.metadata, timeout=timeout)
                except grpc.aio.AioRpcError as e2:
                    raise from_grpc_error(e2) from None
                raise err from None
            return str(resp.context_id)
        finally:
            f.close()

    async def build(
        self,
        name: str,
        context_dir: str | None = None,
        *,
        dockerfile: str | None = None,
        dockerfile_path: str | None = None,
        build_args: Mapping[str, str] | None = None,
        target: str = "",
        no_cache: bool = False,
        timeout: float | None = None,
        start_cmd: str = "",
        ready_cmd: str = "",
        progress: Callable[[BuildEvent], None] | None = None,
    ) -> Image:
        """Build the image ``name`` from a Dockerfile on a node.

        Each RUN step runs in a build sandbox (no network unless the operator
        allows some: ``node.build.rule_sets``); each step's layer is cached
        by content, so a rebuild runs only the steps from the first changed
        one on. A failed build changes no image.

        Args:
            name: the image to make, e.g. ``"team/app:v1"``.
            context_dir: the build context (uploaded first); None is none.
            dockerfile: the Dockerfile's text; default ``dockerfile_path``, or
                ``context_dir/Dockerfile``.
            build_args: values for ARGs.
            target: build this stage (default the last).
            no_cache: run every step even when the cache has it.
            timeout: seconds for the whole build on the node (default the
                node's ``node.build.timeout_sec``).
            start_cmd, ready_cmd: kept in the image's config.
            progress: called with each :class:`BuildEvent`.

        Raises:
            ConfigError: no Dockerfile (nothing is sent).
            InvalidArgumentError: a bad Dockerfile (the message names the line) or a
                failing step (with the end of its output).
            TimeoutError: the build ran past its timeout.
        """
        if not name or not name.strip():
            raise ConfigError("name is empty: name the image to build, e.g. team/app:v1")
        if dockerfile is None:
            path = dockerfile_path or (os.path.join(context_dir, "Dockerfile") if context_dir else None)
            if path is None:
                raise ConfigError("no Dockerfile: pass dockerfile=, dockerfile_path= or a context_dir with a Dockerfile")
            try:
                with open(path, encoding="utf-8") as fh:
                    dockerfile = fh.read()
            except OSError as e:
                raise ConfigError(f"dockerfile {path!r}: {e.strerror}") from None
        context_id = await self.upload_context(context_dir) if context_dir else ""
        req = ipb.BuildImageRequest(
            name=name,
            dockerfile=dockerfile,
            context_id=context_id,
            build_args=dict(build_args or {}),
            target=target,
            no_cache=no_cache,
            timeout_seconds=int(timeout or 0),
            start_cmd=start_cmd,
            ready_cmd=ready_cmd,
        )
        call = self._stub.BuildImage(req, metadata=self._conn.metadata)
        image: Image | None = None
        try:
            async for msg in call:
                which = msg.WhichOneof("event")
                if which == "image":
                    image = Image.from_proto(msg.image)
                elif progress is None:
                    continue
                elif which == "step":
                    st = msg.step
                    progress(BuildEvent(st.index, st.total, st.instruction, st.done, st.cached, st.duration_ms))
                elif which == "log":
                    progress(BuildEvent(msg.log.step, 0, stream=msg.log.stream, data=msg.log.data))
        except grpc.aio.AioRpcError as e:
            raise from_grpc_error(e) from None
        if image is None:
            raise UnavailableError("build stream ended without the image; try again")
        return image

    async def list(self) -> list[Image]:
        """Every image, sorted by name."""
        resp = await self._conn.unary(self._stub.ListImages, ipb.ListImagesRequest(), retry=True)
        return [Image.from_proto(m) for m in resp.images]

    async def get(self, name: str) -> Image:
        """The image called ``name`` (``"root/busybox"`` means ``"root/busybox:latest"``).

        Raises:
            NotFoundError: no such image; the message lists the ones there are.
        """
        resp = await self._conn.unary(self._stub.GetImage, ipb.GetImageRequest(name=name), retry=True)
        return Image.from_proto(resp.image)

    async def tag(self, source: str, target: str) -> Image:
        """Give ``source`` a second name ``target`` (replacing what it named); no layer is copied."""
        resp = await self._conn.unary(self._stub.TagImage, ipb.TagImageRequest(source=source, target=target))
        return Image.from_proto(resp.image)

    async def remove(self, name: str) -> None:
        """Remove a name. Its layers stay until :meth:`gc` and are never removed
        while a sandbox uses them."""
        await self._conn.unary(self._stub.RemoveImage, ipb.RemoveImageRequest(name=name))

    async def compose(
        self,
        base: str,
        layers: Sequence[str] = (),
        name: str = "",
        *,
        images: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        workdir: str = "",
        merge_layers: bool = False,
    ) -> Image:
        """Make image ``name`` from ``base`` plus extra layers, without copying any layer.

        Args:
            base: the image to start from.
            layers: stacked on ``base`` in order: each a layer digest
                (``"sha256:<64 hex>"``) or an image name, which adds that image's
                layers that the stack does not have yet (e.g. the top layer of an
                image :meth:`Sandbox.pack_diff` made from the same base).
            name: the new image's name.
            images: more image names, stacked after ``layers``.
            env: environment entries added to (or replacing those of) the base's.
            workdir: the new image's working directory.
            merge_layers: merge runs of small consecutive layers into one new layer.

        Raises:
            ConfigError: ``layers`` is a single string (nothing is sent).
            NotFoundError: ``base``, a layer or an image is unknown (the error names
                the field, e.g. ``layers[1].digest``); the store is unchanged.
        """
        if isinstance(layers, str) or isinstance(images, str):
            raise ConfigError("layers and images take a list of strings, e.g. layers=['team/ws:v3']")
        req = ipb.ComposeImageRequest(base=base, name=name, merge_layers=merge_layers)
        for item in layers:
            if _DIGEST.match(item):
                req.layers.append(ipb.ComposeLayer(digest=item))
            else:
                req.layers.append(ipb.ComposeLayer(image=item))
        for item in images:
            req.layers.append(ipb.ComposeLayer(image=item))
        if env or workdir:
            req.config.CopyFrom(
                ipb.ImageConfig(env=[f"{k}={v}" for k, v in (env or {}).items()], workdir=workdir)
            )
        resp = await self._conn.unary(self._stub.ComposeImage, req)
        return Image.from_proto(resp.image)

    async def gc(self) -> GCResult:
        """Remove layers no image name refers to and no sandbox (on any node) holds."""
        resp = await self._conn.unary(self._stub.GarbageCollect, ipb.GarbageCollectRequest())
        return GCResult(removed_layers=list(resp.removed_layers), removed_bytes=resp.removed_bytes)

    async def verify(self) -> VerifyResult:
        """Re-hash every layer against its digest; changes nothing."""
        resp = await self._conn.unary(self._stub.VerifyImages, ipb.VerifyImagesRequest(), retry=True)
        return VerifyResult(checked=resp.checked, corrupt={c.digest: c.reason for c in resp.corrupt})

    async def pack_diff(self, sandbox_id: str, name: str, scrub_paths: Sequence[str] | None = None) -> Image:
        """Save sandbox ``sandbox_id``'s changes as image ``name``; see :meth:`Sandbox.pack_diff`."""
        if isinstance(scrub_paths, str):
            raise ConfigError("scrub_paths takes a list of absolute paths, e.g. ['/root/.cache']")
        req = ipb.PackDiffRequest(sandbox_id=sandbox_id, name=name, scrub_paths=list(scrub_paths or ()))
        resp = await self._conn.unary(self._stub.PackDiff, req)
        return Image.from_proto(resp.image)
