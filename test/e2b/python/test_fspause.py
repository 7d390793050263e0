"""Filesystem-only pause (E2B's mode "filesystem" / memory false) with the
unmodified E2B SDK: the files stay, the processes do not."""

import time

from e2b import Sandbox, SandboxState


def _wait(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.1)


def _sleeps(sbx):
    return sbx.commands.run("pgrep -x sleep || true").stdout.split()


def test_pause_filesystem_then_connect(sandbox):
    sandbox.files.write("/home/user/kept.txt", "on disk")
    sandbox.commands.run("sleep 3600", background=True)
    assert _sleeps(sandbox), "the background sleep runs before the pause"

    assert sandbox.pause(mode="filesystem") is True
    assert sandbox.is_running() is False  # /health through the gateway: 502
    assert sandbox.get_info().state == SandboxState.PAUSED
    assert Sandbox.pause(sandbox.sandbox_id, mode="filesystem") is False  # already paused: 409

    same = Sandbox.connect(sandbox.sandbox_id)
    assert same.sandbox_id == sandbox.sandbox_id
    assert same.is_running()
    assert same.files.read("/home/user/kept.txt") == "on disk"
    # The memory was not kept: the sleep from before the pause is gone ...
    assert _sleeps(same) == []
    # ... but the sandbox's env, metadata and commands work as before.
    assert same.commands.run("echo $SBX_WIDE").stdout == "everywhere\n"
    assert same.get_info().metadata.get("sandbox_test_id")


def test_keep_memory_false_then_traffic_restarts_it(sandbox):
    """The deprecated keep_memory=False; a command into the paused sandbox
    starts it again on its files (OpenDsec's auto-resume)."""
    sandbox.files.write("/home/user/t.txt", "kept too")
    sandbox.files.write("/tmp/t.txt", "in memory")
    assert sandbox.pause(keep_memory=False) is True
    assert sandbox.commands.run("cat /home/user/t.txt").stdout == "kept too"
    # /tmp is a tmpfs (memory) on the container backend: it starts empty,
    # as after a reboot (docs/E2B.md, what differs).
    assert not sandbox.files.exists("/tmp/t.txt")
    assert sandbox.get_info().state == SandboxState.RUNNING


def test_connect_reboot_drops_memory(sandbox):
    """connect(on_resume="reboot") of a sandbox paused with its memory."""
    sandbox.commands.run("sleep 3600", background=True)
    assert _sleeps(sandbox), "the background sleep runs before the pause"
    assert sandbox.pause() is True
    same = Sandbox.connect(sandbox.sandbox_id, on_resume="reboot")
    assert _sleeps(same) == []


def test_auto_pause_filesystem_on_timeout(test_id):
    # 8 s: the calls before the timeout must fit in it on a loaded machine
    # (a call after it would resume the sandbox).
    sbx = Sandbox.create(
        timeout=8,
        metadata={"sandbox_test_id": test_id},
        lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}},
    )
    try:
        sbx.files.write("/home/user/a.txt", "a")
        sbx.commands.run("sleep 3600", background=True)
        assert _sleeps(sbx) != []
        _wait(lambda: sbx.get_info().state == SandboxState.PAUSED, "auto-paused after its 8 s timeout")
        again = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert again.files.read("/home/user/a.txt") == "a"
        assert _sleeps(again) == []
    finally:
        sbx.kill()
