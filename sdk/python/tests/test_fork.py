"""Unit tests of Sandbox.fork against the fake server."""

from __future__ import annotations

import grpc
import pytest
from fake_server import FakeServer

from opendsec import DSecClient, DSecRunArgs, InvalidArgumentError, NotFoundError, Sandbox


async def test_fork_returns_running_sandboxes_with_memory_preserved(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox", task_id="job", labels={"k": "v"}))
    forks = await sb.fork(count=4, timeout=90.5)
    assert len(forks) == 4 and all(isinstance(f, Sandbox) for f in forks)
    assert len({f.id for f in forks} | {sb.id}) == 5
    assert all(f.memory_preserved is False for f in forks)
    assert all(f.parent_id == sb.id and f.info.spec.task_id == "job" for f in forks)
    assert sb.memory_preserved is False and sb.parent_id == ""
    req = server.fork_requests[-1]
    assert (req.sandbox_id, req.count, req.timeout_seconds) == (sb.id, 4, 91)
    assert req.request_id  # generated, so a retry is safe
    # Forks are sandboxes like any other.
    await forks[0].stop()


async def test_fork_retries_a_lost_answer_with_the_same_request_id(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    server.fork_failures.append((grpc.StatusCode.UNAVAILABLE, "connection reset"))
    forks = await sb.fork(count=2)
    assert len(server.fork_requests) == 2
    assert server.fork_requests[0].request_id == server.fork_requests[1].request_id
    assert [f.id for f in forks] == server.forks_by_request[server.fork_requests[0].request_id]
    assert sum(1 for s in server.sandboxes.values() if s.parent_id == sb.id) == 2


@pytest.mark.parametrize("count", [0, 65, -1, 2.5, True, "4"])
async def test_fork_bad_count_is_refused_before_sending(client: DSecClient, server: FakeServer, count: object) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    with pytest.raises(InvalidArgumentError, match="count") as ei:
        await sb.fork(count=count)  # type: ignore[arg-type]
    assert ei.value.field == "count"
    assert server.fork_requests == []


async def test_fork_of_a_gone_sandbox_is_not_found(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    del server.sandboxes[sb.id]
    with pytest.raises(NotFoundError, match="sandbox_id"):
        await sb.fork()
