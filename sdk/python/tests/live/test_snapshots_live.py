"""Live tests of Sandbox.snapshot and the snapshot calls against a real system."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from live_helpers import IMAGE, run_args

from opendsec import AlreadyExistsError, DSecClient, DSecRunArgs, InvalidArgumentError, NotFoundError

pytestmark = pytest.mark.live


async def test_snapshot_start_list_delete(client: DSecClient) -> None:
    name = f"sdk-test-{uuid.uuid4().hex[:8]}"
    async with await client.run_sandbox(run_args(labels={"opendsec-sdk-test": "1"}, env={"FROM_SRC": "1"})) as src:
        r = await src.run_shell("mkdir -p /opt/state && echo saved > /opt/state/f && echo ok")
        assert r.stdout == "ok\n", r.stderr
        snap = await src.snapshot(name=name)
        assert snap.name == name and snap.source_sandbox_id == src.id and not snap.memory
        assert snap.spec.image.startswith(IMAGE.split(":")[0]) and snap.spec.env.get("FROM_SRC") == "1"
        # The source keeps running.
        assert (await src.run_shell("cat /opt/state/f")).stdout == "saved\n"
        with pytest.raises(AlreadyExistsError):
            await src.snapshot(name=name)
        with pytest.raises(InvalidArgumentError) as bad:
            await src.snapshot(name="a/b")
        assert bad.value.field == "name"

        async def run_one() -> str:
            args = DSecRunArgs(backend=run_args().backend, snapshot=snap.id, labels={"opendsec-sdk-test": "1"})
            async with await client.run_sandbox(args) as s:
                assert s.info.spec.snapshot == snap.id
                return (await s.run_shell("cat /opt/state/f; echo $FROM_SRC")).stdout

        assert await asyncio.gather(run_one(), run_one()) == ["saved\n1\n"] * 2
        assert snap.id in {s.id for s in await client.list_snapshots()}
        assert (await client.get_snapshot(snap.id)).name == name
        await client.delete_snapshot(snap.id)
    with pytest.raises(NotFoundError):
        await client.get_snapshot(snap.id)
    with pytest.raises(NotFoundError):
        await client.run_sandbox(DSecRunArgs(snapshot=snap.id))
    with pytest.raises(InvalidArgumentError) as both:
        await client.run_sandbox(DSecRunArgs(image=IMAGE, snapshot=snap.id))
    assert both.value.field == "snapshot"
