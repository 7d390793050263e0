"""Unit tests of the snapshot types (no server)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_server import GOOD_TOKEN, FakeServer

from opendsec import DSecClient, DSecRunArgs, InvalidArgumentError, NotFoundError, Snapshot
from opendsec._gen.opendsec.v1 import sandbox_pb2_grpc as pbg
from opendsec._gen.opendsec.v1 import snapshot_pb2 as spb
from opendsec._gen.opendsec.v1 import snapshot_pb2_grpc as spbg


def test_run_args_carry_snapshot() -> None:
    spec = DSecRunArgs(snapshot="n001abcdefghijklmnop", cpu=0.5).to_proto()
    assert spec.snapshot == "n001abcdefghijklmnop" and spec.image == ""
    assert DSecRunArgs.from_proto(spec).snapshot == "n001abcdefghijklmnop"


def test_snapshot_from_proto() -> None:
    m = spb.Snapshot(id="n001abcdefghijklmnop", name="s", source_sandbox_id="n001x", memory=False, size_bytes=7)
    m.spec.image = "root/busybox"
    m.created_at.FromSeconds(1700000000)
    s = Snapshot.from_proto(m)
    got = (s.id, s.name, s.spec.image, s.size_bytes, s.memory)
    assert got == ("n001abcdefghijklmnop", "s", "root/busybox", 7, False)
    assert s.created_at is not None and s.created_at.year == 2023


class FakeSnapshots(spbg.SnapshotServiceServicer):
    """An in-memory SnapshotService next to the fake sandbox service."""

    def __init__(self) -> None:
        self.snaps: dict[str, spb.Snapshot] = {}
        self.auth: list[str | None] = []

    async def CreateSnapshot(self, request: spb.CreateSnapshotRequest, context: Any) -> spb.CreateSnapshotResponse:
        self.auth.append(dict(context.invocation_metadata() or ()).get("authorization"))
        if "/" in request.name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f'name: "{request.name}" is not a snapshot name')
        sid = f"n001snap{len(self.snaps):012d}"
        s = spb.Snapshot(id=sid, name=request.name or f"{request.sandbox_id}-t", source_sandbox_id=request.sandbox_id)
        self.snaps[sid] = s
        return spb.CreateSnapshotResponse(snapshot=s)

    async def GetSnapshot(self, request: spb.GetSnapshotRequest, context: Any) -> spb.GetSnapshotResponse:
        if request.id not in self.snaps:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"id: snapshot {request.id} not found")
        return spb.GetSnapshotResponse(snapshot=self.snaps[request.id])

    async def ListSnapshots(self, request: spb.ListSnapshotsRequest, context: Any) -> spb.ListSnapshotsResponse:
        return spb.ListSnapshotsResponse(snapshots=list(self.snaps.values()))

    async def DeleteSnapshot(self, request: spb.DeleteSnapshotRequest, context: Any) -> spb.DeleteSnapshotResponse:
        if self.snaps.pop(request.id, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"id: snapshot {request.id} not found")
        return spb.DeleteSnapshotResponse()


async def test_snapshot_calls() -> None:
    fake, snaps = FakeServer(), FakeSnapshots()
    server = grpc.aio.server()
    pbg.add_SandboxServiceServicer_to_server(fake, server)
    spbg.add_SnapshotServiceServicer_to_server(snaps, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with DSecClient(f"127.0.0.1:{port}", GOOD_TOKEN, timeout=10, retry_backoff=0.001) as c:
            sb = await c.run_sandbox(DSecRunArgs(image="root/busybox"))
            snap = await sb.snapshot(name="s1")
            assert (snap.name, snap.source_sandbox_id) == ("s1", sb.id)
            assert snaps.auth == [f"Bearer {GOOD_TOKEN}"]
            assert (await sb.snapshot()).name == f"{sb.id}-t"
            with pytest.raises(InvalidArgumentError) as bad:
                await sb.snapshot(name="a/b")
            assert bad.value.field == "name"
            assert [s.id for s in await c.list_snapshots()] == [snap.id, "n001snap000000000001"]
            assert (await c.get_snapshot(snap.id)).name == "s1"
            await c.delete_snapshot(snap.id)
            with pytest.raises(NotFoundError):
                await c.get_snapshot(snap.id)
            await c.run_sandbox(DSecRunArgs(snapshot="n001snap000000000001", cpu=0.5))
            assert fake.create_requests[-1].spec.snapshot == "n001snap000000000001"
            assert fake.create_requests[-1].spec.image == ""
    finally:
        await server.stop(None)
