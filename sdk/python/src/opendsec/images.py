"""Images in the shared store: import, list, inspect, tag, remove, compose,
garbage-collect, verify. Reach them as ``client.images``; save a sandbox's
changes as an image with :meth:`opendsec.Sandbox.pack_diff`."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import re
from collections.abc import Callable, Mapping, Sequence

import grpc.aio

from opendsec._conn import Conn
from opendsec._gen.opendsec.v1 import image_pb2 as ipb
from opendsec._gen.opendsec.v1 import image_pb2_grpc as ipbg
from opendsec.errors import ConfigError, UnavailableError, from_grpc_error

__all__ = [
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

    def to_proto(self) -> ipb.ImageConfig:
        return ipb.ImageConfig(
            env=self.env,
            workdir=self.workdir,
            user=self.user,
            entrypoint=self.entrypoint,
            cmd=self.cmd,
            labels=self.labels,
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
            ),
            source=m.source,
        )


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
