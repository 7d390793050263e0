"""Snapshots with the unmodified E2B SDK: create_snapshot, a snapshot ID as
the template of Sandbox.create, list_snapshots and delete_snapshot."""

import uuid

import pytest
from e2b import AsyncSandbox, Sandbox
from e2b.exceptions import SandboxException


def test_snapshot_then_create_from_it(sandbox, test_id):
    sandbox.files.write("/home/user/state.txt", "saved")
    name = f"e2b-{uuid.uuid4().hex[:8]}"
    info = sandbox.create_snapshot(name=name)
    assert info.snapshot_id and info.names == [name]
    # The source keeps running.
    assert sandbox.is_running()
    assert sandbox.files.read("/home/user/state.txt") == "saved"

    forks = [Sandbox.create(info.snapshot_id, metadata={"sandbox_test_id": test_id}) for _ in range(2)]
    try:
        for f in forks:
            assert f.files.read("/home/user/state.txt") == "saved"
            # Sandbox-wide env comes with the snapshot (the source's spec).
            assert f.commands.run("echo $SBX_WIDE").stdout == "everywhere\n"
        forks[0].files.write("/home/user/mine.txt", "x")
        assert not forks[1].files.exists("/home/user/mine.txt")
    finally:
        for f in forks:
            f.kill()

    mine = sandbox.list_snapshots().next_items()
    assert [s.snapshot_id for s in mine] == [info.snapshot_id]
    by_name = Sandbox.list_snapshots(name=name).next_items()
    assert [s.snapshot_id for s in by_name] == [info.snapshot_id]
    assert Sandbox.delete_snapshot(info.snapshot_id) is True
    assert Sandbox.delete_snapshot(info.snapshot_id) is False
    with pytest.raises(SandboxException):
        Sandbox.create(info.snapshot_id)


def test_snapshot_bad_input(sandbox):
    with pytest.raises(SandboxException) as e:
        sandbox.create_snapshot(name="team/with-slash")
    assert "name" in str(e.value)
    with pytest.raises(SandboxException) as e:
        sandbox.create_snapshot(mode="full")  # memory: true
    assert "memory" in str(e.value)


async def test_async_snapshot(async_sandbox):
    info = await async_sandbox.create_snapshot()
    assert info.snapshot_id
    f = await AsyncSandbox.create(info.snapshot_id)
    try:
        assert (await f.commands.run("echo ok")).stdout == "ok\n"
    finally:
        await f.kill()
    assert await AsyncSandbox.delete_snapshot(info.snapshot_id) is True
