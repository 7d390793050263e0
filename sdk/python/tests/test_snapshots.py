"""Unit tests of the snapshot types (no server)."""

from __future__ import annotations

from opendsec import DSecRunArgs, Snapshot
from opendsec._gen.opendsec.v1 import snapshot_pb2 as spb


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
