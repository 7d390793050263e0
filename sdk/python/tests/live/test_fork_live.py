"""Live tests of Sandbox.fork (see conftest.py)."""

from __future__ import annotations

import asyncio

import pytest

from opendsec import InvalidArgumentError, NotFoundError, Sandbox, SandboxState


async def test_fork_copies_files_and_keeps_writes_apart(sandbox: Sandbox) -> None:
    await sandbox.files.write("/home/user/fork-state.txt", b"step-1")
    forks = await sandbox.fork(count=3)
    try:
        assert len(forks) == 3 and len({f.id for f in forks} | {sandbox.id}) == 4
        for f in forks:
            assert f.info.state is SandboxState.RUNNING and f.parent_id == sandbox.id
            assert f.memory_preserved is False  # containers fork their files, not memory
            assert await f.files.read("/home/user/fork-state.txt") == b"step-1"
        await forks[0].files.write("/home/user/fork-state.txt", b"fork-0")
        for other in [sandbox, *forks[1:]]:
            assert await other.files.read("/home/user/fork-state.txt") == b"step-1"
        r = await forks[1].run_shell("hostname")
        assert r.exit_code == 0 and r.stdout.strip() != (await sandbox.run_shell("hostname")).stdout.strip()
    finally:
        await asyncio.gather(*(f.stop() for f in forks))


async def test_fork_bad_input(sandbox: Sandbox) -> None:
    with pytest.raises(InvalidArgumentError, match="count"):
        await sandbox.fork(count=65)
    await sandbox.stop()
    with pytest.raises(NotFoundError, match="sandbox_id"):
        await sandbox.fork(count=1)
