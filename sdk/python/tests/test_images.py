"""Unit tests of client.images and Sandbox.pack_diff: request building, the
import progress stream and error mapping, against a small in-process image
service (the sandbox calls go to the shared fake server)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from fake_server import GOOD_TOKEN, FakeServer

from opendsec import (
    ConfigError,
    DSecClient,
    DSecRunArgs,
    Image,
    ImportProgress,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from opendsec._gen.opendsec.v1 import image_pb2 as ipb
from opendsec._gen.opendsec.v1 import image_pb2_grpc as ipbg
from opendsec._gen.opendsec.v1 import sandbox_pb2_grpc as pbg

DIGEST = "sha256:" + "ab" * 32


def _image(name: str, *digests: str) -> ipb.Image:
    m = ipb.Image(name=name, id="sha256:" + "11" * 32, size=7, source="compose:x")
    m.created.FromSeconds(1_700_000_000)
    m.config.env.append("PATH=/bin")
    for d in digests:
        m.layers.append(ipb.ImageLayer(digest=d, size=3))
    return m


class FakeImages(ipbg.ImageServiceServicer):
    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.end_import_early = False

    async def _check(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        self.requests.append(request)
        if dict(context.invocation_metadata() or ()).get("authorization") != f"Bearer {GOOD_TOKEN}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "token: unknown")

    async def ImportImage(
        self, request: ipb.ImportImageRequest, context: Any
    ) -> AsyncIterator[ipb.ImportImageResponse]:
        await self._check(request, context)
        if request.ref.startswith("127.0.0.1:1/"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"registry {request.ref}: connection refused")
        for n in (1, 2):
            yield ipb.ImportImageResponse(progress=ipb.ImportProgress(files=n, bytes=n * 10, total_bytes=20))
        if not self.end_import_early:
            yield ipb.ImportImageResponse(image=_image(request.name or "team/app:v1", DIGEST))

    async def GetImage(self, request: ipb.GetImageRequest, context: Any) -> ipb.GetImageResponse:
        await self._check(request, context)
        if request.name != "root/busybox":
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f'image "{request.name}" not found (available: root/busybox)'
            )
        return ipb.GetImageResponse(image=_image("root/busybox:latest", DIGEST))

    async def ListImages(self, request: ipb.ListImagesRequest, context: Any) -> ipb.ListImagesResponse:
        await self._check(request, context)
        return ipb.ListImagesResponse(images=[_image("a:latest", DIGEST), _image("b:latest")])

    async def TagImage(self, request: ipb.TagImageRequest, context: Any) -> ipb.TagImageResponse:
        await self._check(request, context)
        return ipb.TagImageResponse(image=_image(request.target, DIGEST))

    async def RemoveImage(self, request: ipb.RemoveImageRequest, context: Any) -> ipb.RemoveImageResponse:
        await self._check(request, context)
        return ipb.RemoveImageResponse()

    async def ComposeImage(self, request: ipb.ComposeImageRequest, context: Any) -> ipb.ComposeImageResponse:
        await self._check(request, context)
        if any(layer.digest == "sha256:" + "00" * 32 for layer in request.layers):
            await context.abort(grpc.StatusCode.NOT_FOUND, "layers[0].digest: layer sha256:00.. is not in the store")
        return ipb.ComposeImageResponse(image=_image(request.name, DIGEST, DIGEST))

    async def GarbageCollect(self, request: ipb.GarbageCollectRequest, context: Any) -> ipb.GarbageCollectResponse:
        await self._check(request, context)
        return ipb.GarbageCollectResponse(removed_layers=[DIGEST], removed_bytes=42)

    async def VerifyImages(self, request: ipb.VerifyImagesRequest, context: Any) -> ipb.VerifyImagesResponse:
        await self._check(request, context)
        return ipb.VerifyImagesResponse(checked=3, corrupt=[ipb.CorruptLayer(digest=DIGEST, reason="hashes to x")])

    async def PackDiff(self, request: ipb.PackDiffRequest, context: Any) -> ipb.PackDiffResponse:
        await self._check(request, context)
        if request.name == "Bad Name":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, 'name: name "Bad Name" is not valid')
        return ipb.PackDiffResponse(image=_image(request.name, DIGEST, DIGEST))


@pytest.fixture
async def images_env() -> AsyncIterator[tuple[DSecClient, FakeImages, FakeServer]]:
    """The shared fake's sandbox service and FakeImages on one loopback server."""
    fake, images = FakeServer(), FakeImages()
    server = grpc.aio.server()
    pbg.add_SandboxServiceServicer_to_server(fake, server)
    ipbg.add_ImageServiceServicer_to_server(images, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with DSecClient(f"127.0.0.1:{port}", GOOD_TOKEN, timeout=10, retry_backoff=0.001) as c:
            yield c, images, fake
    finally:
        await server.stop(None)


async def test_import_reports_progress_and_returns_the_image(images_env: Any) -> None:
    client, images, _ = images_env
    seen: list[ImportProgress] = []
    img = await client.images.import_("reg:5000/team/app:v1", "team/app:v2", seen.append, merge_layers=True)
    assert isinstance(img, Image) and img.name == "team/app:v2"
    assert img.layers[0].digest == DIGEST and img.config.env == ["PATH=/bin"] and img.created is not None
    assert [(p.files, p.bytes, p.total_bytes) for p in seen] == [(1, 10, 20), (2, 20, 20)]
    req = images.requests[-1]
    assert (req.ref, req.name, req.merge_layers, req.insecure) == ("reg:5000/team/app:v1", "team/app:v2", True, False)


async def test_import_errors(images_env: Any) -> None:
    client, images, _ = images_env
    with pytest.raises(ConfigError):
        await client.images.import_("  ")
    assert images.requests == []
    with pytest.raises(UnavailableError, match=r"127\.0\.0\.1:1"):
        await client.images.import_("127.0.0.1:1/x:v1")
    images.end_import_early = True
    with pytest.raises(UnavailableError, match="without the image"):
        await client.images.import_("reg/x:v1")


async def test_list_get_tag_remove_gc_verify(images_env: Any) -> None:
    client, images, _ = images_env
    assert [i.name for i in await client.images.list()] == ["a:latest", "b:latest"]
    assert (await client.images.get("root/busybox")).name == "root/busybox:latest"
    with pytest.raises(NotFoundError, match="available: root/busybox"):
        await client.images.get("nope")
    assert (await client.images.tag("a", "a:stable")).name == "a:stable"
    assert (images.requests[-1].source, images.requests[-1].target) == ("a", "a:stable")
    await client.images.remove("a:stable")
    assert images.requests[-1].name == "a:stable"
    gc = await client.images.gc()
    assert gc.removed_layers == [DIGEST] and gc.removed_bytes == 42
    v = await client.images.verify()
    assert v.checked == 3 and v.corrupt == {DIGEST: "hashes to x"}


async def test_compose_sorts_digests_from_images(images_env: Any) -> None:
    client, images, _ = images_env
    img = await client.images.compose(
        "root/py:3.11", [DIGEST, "team/ws:v3"], "team/env:v1", images=["team/tk"], env={"A": "1"}, workdir="/w"
    )
    assert img.name == "team/env:v1" and len(img.layers) == 2
    req = images.requests[-1]
    assert [layer.WhichOneof("source") for layer in req.layers] == ["digest", "image", "image"]
    assert [layer.digest or layer.image for layer in req.layers] == [DIGEST, "team/ws:v3", "team/tk"]
    assert list(req.config.env) == ["A=1"] and req.config.workdir == "/w"
    with pytest.raises(ConfigError):
        await client.images.compose("root/py:3.11", "team/ws:v3", "x")  # type: ignore[arg-type]
    with pytest.raises(NotFoundError) as ei:
        await client.images.compose("root/py:3.11", ["sha256:" + "00" * 32], "x")
    assert "layers[0].digest" in str(ei.value)


async def test_sandbox_pack_diff(images_env: Any) -> None:
    client, images, _ = images_env
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    img = await sb.pack_diff("team/env:packed", scrub_paths=["/root/.cache", "/tmp"])
    assert img.name == "team/env:packed"
    req = images.requests[-1]
    assert (req.sandbox_id, req.name, list(req.scrub_paths)) == (sb.id, "team/env:packed", ["/root/.cache", "/tmp"])
    with pytest.raises(InvalidArgumentError) as ei:
        await sb.pack_diff("Bad Name")
    assert ei.value.field == "name"
    with pytest.raises(ConfigError):
        await sb.pack_diff("x", scrub_paths="/tmp")  # type: ignore[arg-type]


class FakeBuilds(FakeImages):
    """FakeImages plus a build service that records the context it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.context = b""
        self.sizes: list[int] = []

    async def UploadBuildContext(self, request_iterator: Any, context: Any) -> ipb.UploadBuildContextResponse:
        async for m in request_iterator:
            self.sizes.append(m.size)
            self.context += m.data
        if self.sizes and self.sizes[0] > 1 << 20:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "build context: too big (node.build.max_context_mb)")
        return ipb.UploadBuildContextResponse(context_id="n001" + "c" * 16, size=len(self.context))

    async def BuildImage(self, request: ipb.BuildImageRequest, context: Any) -> AsyncIterator[ipb.BuildImageResponse]:
        await self._check(request, context)
        if "FROBNICATE" in request.dockerfile:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "dockerfile: line 2: unknown instruction: FROBNICATE")
        yield ipb.BuildImageResponse(step=ipb.BuildStep(index=1, total=2, instruction="FROM root/busybox", done=True))
        yield ipb.BuildImageResponse(step=ipb.BuildStep(index=2, total=2, instruction="RUN make"))
        yield ipb.BuildImageResponse(log=ipb.BuildLog(step=2, stream="stdout", data=b"built\n"))
        yield ipb.BuildImageResponse(step=ipb.BuildStep(index=2, total=2, instruction="RUN make", done=True, duration_ms=5))
        img = _image(request.name, DIGEST)
        img.config.start_cmd = request.start_cmd
        yield ipb.BuildImageResponse(image=img)


@pytest.fixture
async def builds_env() -> AsyncIterator[tuple[DSecClient, FakeBuilds]]:
    builds = FakeBuilds()
    server = grpc.aio.server()
    ipbg.add_ImageServiceServicer_to_server(builds, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with DSecClient(f"127.0.0.1:{port}", GOOD_TOKEN, timeout=10, retry_backoff=0.001) as c:
            yield c, builds
    finally:
        await server.stop(None)


async def test_build_uploads_context_and_streams_steps(builds_env: Any, tmp_path: Any) -> None:
    import io
    import tarfile

    from opendsec import BuildEvent

    client, builds = builds_env
    (tmp_path / "Dockerfile").write_text("FROM root/busybox\nRUN make\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.sh").write_text("echo hi\n")
    events: list[BuildEvent] = []
    img = await client.images.build(
        "team/app:v1", str(tmp_path), build_args={"V": "2"}, start_cmd="serve", progress=events.append
    )
    assert img.name == "team/app:v1" and img.config.start_cmd == "serve"
    req = builds.requests[-1]
    assert req.dockerfile.startswith("FROM root/busybox") and req.context_id.startswith("n001")
    assert dict(req.build_args) == {"V": "2"}
    assert builds.sizes[0] == len(builds.context) > 0
    names = tarfile.open(fileobj=io.BytesIO(builds.context)).getnames()
    assert "./src/main.sh" in names and "./Dockerfile" in names
    assert [(e.step, e.done) for e in events if not e.stream] == [(1, True), (2, False), (2, True)]
    assert [e.data for e in events if e.stream] == [b"built\n"]


async def test_build_errors(builds_env: Any, tmp_path: Any) -> None:
    client, builds = builds_env
    with pytest.raises(ConfigError):
        await client.images.build("team/app:v1")
    with pytest.raises(InvalidArgumentError, match="line 2"):
        await client.images.build("team/app:v1", dockerfile="FROM x\nFROBNICATE\n")
    (tmp_path / "big").write_bytes(b"\0" * (2 << 20))
    from opendsec import QuotaExceededError

    with pytest.raises(QuotaExceededError, match="max_context_mb"):
        await client.images.build("team/app:v1", str(tmp_path), dockerfile="FROM x\n")
