"""The async E2B client against OpenDsec."""

import asyncio

import pytest
from e2b import AsyncSandbox
from e2b.exceptions import NotFoundException
from e2b.sandbox.commands.command_handle import CommandExitException


async def test_async_lifecycle(async_sandbox, test_id):
    info = await async_sandbox.get_info()
    assert info.metadata == {"sandbox_test_id": test_id}
    assert await async_sandbox.is_running()
    same = await AsyncSandbox.connect(async_sandbox.sandbox_id)
    assert (await same.commands.run("echo hi")).stdout == "hi\n"


async def test_async_commands(async_sandbox):
    r = await async_sandbox.commands.run("echo $A; pwd", envs={"A": "b"}, cwd="/tmp")
    assert r.stdout == "b\n/tmp\n"
    with pytest.raises(CommandExitException) as e:
        await async_sandbox.commands.run("exit 7")
    assert e.value.exit_code == 7
    results = await asyncio.gather(*(async_sandbox.commands.run(f"echo {i}") for i in range(5)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
    h = await async_sandbox.commands.run("sleep 600", background=True)
    assert await async_sandbox.commands.kill(h.pid)


async def test_async_files(async_sandbox):
    await async_sandbox.files.write("a/b.txt", "content")
    assert await async_sandbox.files.read("a/b.txt") == "content"
    assert [e.name for e in await async_sandbox.files.list("a")] == ["b.txt"]
    await async_sandbox.files.remove("a")
    assert not await async_sandbox.files.exists("a")


async def test_async_kill_and_not_found():
    sbx = await AsyncSandbox.create()
    await sbx.kill()
    assert not await sbx.is_running()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(sbx.sandbox_id)
