"""Snapshots: a sandbox saved under a name its caller owns. Take one with
:meth:`opendsec.Sandbox.snapshot`, start sandboxes from it with
``DSecRunArgs(snapshot=snap.id)``, and list, get or delete them with
:meth:`DSecClient.list_snapshots`, :meth:`DSecClient.get_snapshot` and
:meth:`DSecClient.delete_snapshot`."""

from __future__ import annotations

import dataclasses
import datetime as _dt

from opendsec._conn import Conn
from opendsec._gen.opendsec.v1 import snapshot_pb2 as spb
from opendsec._gen.opendsec.v1 import snapshot_pb2_grpc as spbg
from opendsec.types import DSecRunArgs

__all__ = ["Snapshot"]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A saved sandbox.

    Attributes:
        id: 20 characters of ``[a-z0-9]``; pass it as ``DSecRunArgs(snapshot=...)``.
        name: unique among its owner's snapshots (1-128 of ``[A-Za-z0-9._-]``).
        node_id: the node that keeps the record.
        source_sandbox_id: the sandbox it was taken from.
        backend: the source's backend.
        image: the snapshot's image in the store (``snapshot/<id>``); empty for
            a backend (memory) snapshot.
        spec: the source's spec, the defaults of a create from the snapshot.
        memory: the snapshot holds memory and processes (VM backends); ``False``
            on containers, whose sandboxes start their processes again on the
            saved files.
        size_bytes: what the snapshot adds to the store.
        created_at: when it was taken.
        owner: the principal that took it.
    """

    id: str
    name: str
    node_id: str
    source_sandbox_id: str
    backend: str
    image: str
    spec: DSecRunArgs
    memory: bool
    size_bytes: int
    created_at: _dt.datetime | None
    owner: str

    @classmethod
    def from_proto(cls, m: spb.Snapshot) -> Snapshot:
        return cls(
            id=m.id,
            name=m.name,
            node_id=m.node_id,
            source_sandbox_id=m.source_sandbox_id,
            backend=m.backend,
            image=m.image,
            spec=DSecRunArgs.from_proto(m.spec),
            memory=m.memory,
            size_bytes=m.size_bytes,
            created_at=m.created_at.ToDatetime(tzinfo=_dt.UTC) if m.HasField("created_at") else None,
            owner=m.owner,
        )


class _Snapshots:
    """The snapshot calls over one connection."""

    def __init__(self, conn: Conn) -> None:
        self._conn = conn
        self._stub = spbg.SnapshotServiceStub(conn.channel)

    async def create(self, sandbox_id: str, name: str | None) -> Snapshot:
        req = spb.CreateSnapshotRequest(sandbox_id=sandbox_id, name=name or "")
        resp = await self._conn.unary(self._stub.CreateSnapshot, req)
        return Snapshot.from_proto(resp.snapshot)

    async def get(self, snapshot_id: str) -> Snapshot:
        resp = await self._conn.unary(self._stub.GetSnapshot, spb.GetSnapshotRequest(id=snapshot_id), retry=True)
        return Snapshot.from_proto(resp.snapshot)

    async def list(self) -> list[Snapshot]:
        resp = await self._conn.unary(self._stub.ListSnapshots, spb.ListSnapshotsRequest(), retry=True)
        return [Snapshot.from_proto(s) for s in resp.snapshots]

    async def delete(self, snapshot_id: str) -> None:
        await self._conn.unary(self._stub.DeleteSnapshot, spb.DeleteSnapshotRequest(id=snapshot_id))
