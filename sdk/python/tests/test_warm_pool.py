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
