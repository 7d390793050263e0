"""Unit tests of pause, resume, metrics and batch pause, against the fake server."""

from __future__ import annotations

import pytest
from fake_server import FakeServer

from opendsec import (
    ConfigError,
    DSecClient,
    DSecRunArgs,
    NotFoundError,
    SandboxMetrics,
    SandboxReclaim,
    SandboxState,
)
from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb


async def test_pause_resume_and_metrics(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox", auto_pause=True))
    assert server.create_requests[0].spec.auto_pause is True
    assert sb.info.spec.auto_pause is True
    info = await sb.pause()
    assert info.state is SandboxState.PAUSED and sb.info.state is SandboxState.PAUSED
    m = await sb.metrics()
    assert isinstance(m, SandboxMetrics)
    assert (m.cpu_count, m.cpu_used_pct, m.mem_used, m.mem_total, m.pids) == (1, 12.5, 1 << 20, 512 << 20, 2)
    assert m.state is SandboxState.PAUSED and m.timestamp is not None
    info = await sb.resume(timeout=90.5)
    assert info.state is SandboxState.RUNNING
    assert server.resume_requests[-1].timeout_seconds == 91
    await sb.resume()
    assert server.resume_requests[-1].timeout_seconds == 0  # keep the lifetime left at the pause
    assert server.pause_requests[-1].reclaim is False and sb.reclaimed_bytes == 0


async def test_pause_with_reclaim(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    info = await sb.pause(reclaim=True)
    assert info.state is SandboxState.PAUSED
    assert server.pause_requests[-1].reclaim is True
    assert sb.reclaimed_bytes == 20 << 20
    await sb.pause()
    assert sb.reclaimed_bytes == 0
    with pytest.raises(ConfigError, match="reclaim"):
        await sb.pause(reclaim="yes")  # type: ignore[arg-type]
    assert len(server.pause_requests) == 2


async def test_pause_filesystem_only(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox", on_timeout="pause_filesystem"))
    info = await sb.pause(filesystem_only=True)
    assert info.state is SandboxState.PAUSED and info.paused_filesystem is True
    assert server.pause_requests[-1].filesystem_only is True
    assert server.pause_requests[-1].reclaim is False
    info = await sb.resume()
    assert info.paused_filesystem is False
    with pytest.raises(ConfigError, match="reclaim"):
        await sb.pause(filesystem_only=True, reclaim=True)
    with pytest.raises(ConfigError, match="filesystem_only"):
        await sb.pause(filesystem_only=1)  # type: ignore[arg-type]
    assert len(server.pause_requests) == 1


async def test_batch_pause_by_task_and_resume_by_labels(client: DSecClient, server: FakeServer) -> None:
    job_args = DSecRunArgs(image="root/busybox", task_id="job", labels={"k": "v"})
    job = [await client.run_sandbox(job_args) for _ in range(3)]
    other = await client.run_sandbox(DSecRunArgs(image="root/busybox", task_id="other"))
    out = await client.pause_sandboxes(task_id="job")
    assert out.ok and sorted(s.id for s in out.sandboxes) == sorted(s.id for s in job)
    assert all(s.info.state is SandboxState.PAUSED for s in out.sandboxes)
    assert server.sandboxes[other.id].state == pb.SANDBOX_STATE_RUNNING
    out = await client.resume_sandboxes(labels={"k": "v"})
    assert len(out.sandboxes) == 3 and all(s.info.state is SandboxState.RUNNING for s in out.sandboxes)


async def test_batch_failures_are_per_sandbox(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    out = await client.pause_sandboxes(ids=[sb.id, "nosuch"])
    assert [s.id for s in out.sandboxes] == [sb.id]
    assert not out.ok and out.failures[0].sandbox_id == "nosuch"
    assert isinstance(out.failures[0].error, NotFoundError)


async def test_empty_selector_is_refused_before_sending(client: DSecClient, server: FakeServer) -> None:
    with pytest.raises(ConfigError, match="selector"):
        await client.pause_sandboxes()
    with pytest.raises(ConfigError, match="selector"):
        await client.resume_sandboxes(labels={})
    assert not any(m == "PauseSandboxes" for m, _ in server.auth)


async def test_pause_unknown_sandbox(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    await sb.stop()
    with pytest.raises(NotFoundError):
        await sb.pause()


async def test_on_timeout_is_sent_and_read_back(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox", on_timeout="pause"))
    assert server.create_requests[-1].spec.on_timeout == "pause"
    assert sb.info.spec.on_timeout == "pause"
    assert DSecRunArgs(image="x").to_proto().on_timeout == ""
    assert DSecRunArgs.from_proto(pb.SandboxSpec(image="x", on_timeout="stop")).on_timeout == "stop"


async def test_pause_task_reclaims_and_resume_task(client: DSecClient, server: FakeServer) -> None:
    job = [await client.run_sandbox(DSecRunArgs(image="root/busybox", task_id="job", labels={"k": str(i)})) for i in range(3)]
    other = await client.run_sandbox(DSecRunArgs(image="root/busybox", task_id="other"))
    out = await client.pause_task("job")
    assert server.pause_batch_requests[-1].reclaim is True  # reclaim is the default
    assert out.ok and sorted(s.id for s in out.sandboxes) == sorted(s.id for s in job)
    assert sorted(r.sandbox_id for r in out.reclaimed) == sorted(s.id for s in job)
    assert all(isinstance(r, SandboxReclaim) and r.bytes_freed == 20 << 20 for r in out.reclaimed)
    assert out.bytes_freed == 3 * (20 << 20)
    assert server.sandboxes[other.id].state == pb.SANDBOX_STATE_RUNNING
    out = await client.resume_task("job")
    assert len(out.sandboxes) == 3 and all(s.info.state is SandboxState.RUNNING for s in out.sandboxes)
    out = await client.pause_task("job", reclaim=False, labels={"k": "1"})
    assert [s.id for s in out.sandboxes] == [job[1].id] and out.reclaimed == [] and out.bytes_freed == 0
    assert server.pause_batch_requests[-1].reclaim is False


async def test_pause_task_bad_input(client: DSecClient, server: FakeServer) -> None:
    with pytest.raises(NotFoundError, match="task nosuch"):
        await client.pause_task("nosuch")
    n = len(server.pause_batch_requests)
    with pytest.raises(ConfigError, match="task_id"):
        await client.pause_task("")
    with pytest.raises(ConfigError, match="reclaim"):
        await client.pause_task("job", reclaim="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="task_id"):
        await client.resume_task("")
    assert len(server.pause_batch_requests) == n


def test_allow_privilege_escalation_round_trips() -> None:
    spec = DSecRunArgs(image="root/base", allow_privilege_escalation=True).to_proto()
    assert spec.allow_privilege_escalation is True
    assert DSecRunArgs.from_proto(spec).allow_privilege_escalation is True
    assert DSecRunArgs(image="x").to_proto().allow_privilege_escalation is False


def test_cpu_class_round_trips() -> None:
    spec = DSecRunArgs(image="root/base", cpu_class="best_effort").to_proto()
    assert spec.cpu_class == "best_effort"
    assert DSecRunArgs.from_proto(spec).cpu_class == "best_effort"
    assert DSecRunArgs(image="x").to_proto().cpu_class == ""
