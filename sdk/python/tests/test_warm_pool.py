"""Unit tests of the warm pool options: skip_warm_pool on create and batch
create, from_warm_pool on the sandbox."""

from __future__ import annotations

import pytest
from fake_server import FakeServer

from opendsec import ConfigError, DSecClient, DSecRunArgs, SandboxInfo


async def test_create_takes_the_pool_by_default(client: DSecClient, server: FakeServer) -> None:
    server.warm_pool = 1
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    assert server.create_requests[-1].skip_warm_pool is False
    assert sb.from_warm_pool is True
    assert sb.info.from_warm_pool is True
    # The pool is empty now: the next create is cold.
    cold = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    assert cold.from_warm_pool is False


async def test_skip_warm_pool_is_sent_and_gives_a_cold_sandbox(client: DSecClient, server: FakeServer) -> None:
    server.warm_pool = 1
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox", skip_warm_pool=True))
    assert server.create_requests[-1].skip_warm_pool is True
    assert sb.from_warm_pool is False
    assert server.warm_pool == 1


async def test_from_warm_pool_survives_refresh(client: DSecClient, server: FakeServer) -> None:
    server.warm_pool = 1
    sb = await client.run_sandbox(DSecRunArgs())
    info = await sb.refresh()
    assert info.from_warm_pool is True
    assert (await client.get_sandbox(sb.id)).from_warm_pool is True


@pytest.mark.parametrize("skip", [False, True])
async def test_batch_create_sends_skip_warm_pool(client: DSecClient, server: FakeServer, skip: bool) -> None:
    server.warm_pool = 1
    items = await client.run_sandboxes(DSecRunArgs(skip_warm_pool=skip), 3)
    assert server.batch_requests[-1].skip_warm_pool is skip
    warm = [i.index for i in items if i.sandbox is not None and i.sandbox.from_warm_pool]
    # The fake answers index 2 first; it takes the one pooled sandbox.
    assert warm == ([] if skip else [2])


@pytest.mark.parametrize("bad", ["false", 1, None])
async def test_skip_warm_pool_must_be_a_bool(client: DSecClient, server: FakeServer, bad: object) -> None:
    args = DSecRunArgs(skip_warm_pool=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="skip_warm_pool: must be True or False"):
        await client.run_sandbox(args)
    with pytest.raises(ConfigError, match="skip_warm_pool"):
        client.run_sandboxes(args, 2)
    assert server.create_requests == []
    assert server.batch_requests == []


def test_skip_warm_pool_is_not_part_of_the_spec() -> None:
    spec = DSecRunArgs(image="root/busybox", skip_warm_pool=True).to_proto()
    assert DSecRunArgs.from_proto(spec).skip_warm_pool is False


def test_sandbox_info_defaults_to_cold() -> None:
    from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb

    assert SandboxInfo.from_proto(pb.Sandbox(id="x")).from_warm_pool is False
    assert SandboxInfo.from_proto(pb.Sandbox(id="x", from_warm_pool=True)).from_warm_pool is True


async def test_prewarm_returns_the_held_count(client: DSecClient, server: FakeServer) -> None:
    held = await client.prewarm(DSecRunArgs(image="root/busybox", cpu=0.1, memory_mb=128), 5, ttl=90, wait=True)
    assert held == 5
    req = server.prewarm_requests[-1]
    assert (req.count, req.ttl_seconds, req.wait) == (5, 90, True)
    assert req.spec.image == "root/busybox" and req.spec.cpu == 0.1 and req.spec.memory_mb == 128
    # The batch that follows takes them.
    items = await client.run_sandboxes(DSecRunArgs(image="root/busybox"), 3)
    assert all(i.sandbox.from_warm_pool for i in items if i.sandbox is not None)


async def test_prewarm_may_hold_fewer(client: DSecClient, server: FakeServer, caplog: pytest.LogCaptureFixture) -> None:
    server.pool_room = 2
    assert await client.prewarm(DSecRunArgs(), 10) == 2
    assert server.prewarm_requests[-1].ttl_seconds == 0
    assert "capacity: node node1 has room for 2" in caplog.text


@pytest.mark.parametrize("count", [0, 5000])
async def test_prewarm_bad_count_names_the_field(client: DSecClient, server: FakeServer, count: int) -> None:
    from opendsec import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as e:
        await client.prewarm(DSecRunArgs(), count)
    assert e.value.field == "count"


async def test_prewarm_bad_image_names_the_field(client: DSecClient, server: FakeServer) -> None:
    from opendsec import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as e:
        await client.prewarm(DSecRunArgs(image="bad"), 1)
    assert e.value.field == "image"


@pytest.mark.parametrize(("count", "ttl"), [("3", None), (True, None), (1, -1), (1, 86401)])
async def test_prewarm_bad_types_send_nothing(
    client: DSecClient, server: FakeServer, count: object, ttl: object
) -> None:
    with pytest.raises(ConfigError):
        await client.prewarm(DSecRunArgs(), count, ttl=ttl)  # type: ignore[arg-type]
    assert server.prewarm_requests == []
