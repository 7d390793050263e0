"""Sandbox.fork with the unmodified E2B SDK (its fork call exists in the pinned version)."""

import pytest
from e2b import AsyncSandbox, Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxNotFoundException


def test_fork_copies_files_and_keeps_writes_apart(sandbox):
    sandbox.files.write("state.txt", "step-1")  # in the user's home, on the root filesystem
    forks = sandbox.fork(count=3, timeout=120)
    try:
        assert len(forks) == 3
        for f in forks:
            assert isinstance(f, Sandbox), f  # an exception would mean that fork failed
            assert f.sandbox_id != sandbox.sandbox_id
            assert f.files.read("state.txt") == "step-1"
            # The sandbox-wide env comes along (the fork's processes start again).
            assert f.commands.run("echo $SBX_WIDE").stdout == "everywhere\n"
        forks[0].files.write("state.txt", "fork-0")
        for other in [sandbox, *forks[1:]]:
            assert other.files.read("state.txt") == "step-1"
        assert len({f.sandbox_id for f in forks}) == 3
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()


def test_fork_bad_input(sandbox):
    # The SDK itself allows 1..20; the API 1..100; OpenDsec makes at most 64.
    with pytest.raises(InvalidArgumentException):
        sandbox.fork(count=0)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.fork("nosuchsandbox0000000")


async def test_async_fork(async_sandbox):
    await async_sandbox.files.write("a.txt", "x")
    (f,) = await async_sandbox.fork()
    try:
        assert isinstance(f, AsyncSandbox)
        assert await f.files.read("a.txt") == "x"
    finally:
        await f.kill()
