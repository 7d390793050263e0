"""Unit tests of trajectory blocks and replay against the fake server."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_server import FakeServer

from opendsec import DSecClient, DSecRunArgs

# The fake's Exec answers an unknown command with this stdout and exit 0.
FAKE_OUT = b"\xff\xfebad utf8"


def _entry(seq: int, cmd: str, stdout: bytes, exit_code: int = 0, **kw: object) -> dict[str, object]:
    e: dict[str, object] = {
        "seq": str(seq),
        "call_id": f"r/{seq - 1}",
        "kind": "exec",
        "state": "done",
        "command": ["/bin/sh", "-c", cmd],
        "stdout": base64.b64encode(stdout).decode(),
    }
    if exit_code:
        e["exit_code"] = exit_code
    e.update(kw)
    return e


async def test_replay_from_snapshot_sets_spec_snapshot(client: DSecClient, server: FakeServer) -> None:
    rep = await client.replay([_entry(1, "same", FAKE_OUT)], snapshot="n001snapabcdefghijkl")
    spec = server.create_requests[-1].spec
    # "snapshot/<id>" as an image is refused by the server: the snapshot
    # goes in spec.snapshot, with no image.
    assert (spec.snapshot, spec.image) == ("n001snapabcdefghijkl", "")
    assert rep.ok and rep.calls == 1 and rep.skipped == 0
    assert rep.sandbox_id in server.stopped


async def test_replay_image_overrides_args_snapshot(client: DSecClient, server: FakeServer) -> None:
    await client.replay([], image="root/busybox", args=DSecRunArgs(snapshot="n001old", cpu=0.5))
    spec = server.create_requests[-1].spec
    assert (spec.image, spec.snapshot, spec.cpu) == ("root/busybox", "", 0.5)


async def test_replay_image_and_snapshot_refused(client: DSecClient, server: FakeServer) -> None:
    with pytest.raises(ValueError, match="image or snapshot"):
        await client.replay([], image="root/busybox", snapshot="n001snap")
    assert server.create_requests == []


async def test_replay_names_first_differing_call(client: DSecClient, server: FakeServer) -> None:
    log = [
        _entry(1, "a", FAKE_OUT),
        _entry(2, "b", b"recorded time 1\n"),
        _entry(3, "c", FAKE_OUT, exit_code=3),
        {"seq": "4", "kind": "exec", "state": "interrupted", "command": ["x"]},
        # Truncated output is compared on the exit code only.
        _entry(5, "d", b"cut", output_truncated=True),
    ]
    rep = await client.replay(log, keep=True)
    assert rep.calls == 4 and rep.skipped == 1
    assert [(d.seq, d.call_id, d.field) for d in rep.differences] == [(2, "r/1", "stdout"), (3, "r/2", "exit_code")]
    first = rep.differences[0]
    assert first.command == ["/bin/sh", "-c", "b"]
    assert (first.recorded, first.replayed) == (b"recorded time 1\n", FAKE_OUT)
    assert rep.sandbox_id not in server.stopped
    # Every call ran in the log's order, as recorded (argv, no shell added).
    cmds = [r.start.command for r in server.exec_requests]
    assert cmds == [["/bin/sh", "-c", c] for c in "abcd"]


async def test_trajectory_block_numbers_calls_per_sandbox(client: DSecClient, server: FakeServer) -> None:
    a = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    b = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    with client.trajectory("roll7"):
        await a.run_shell("x")
        await b.run_shell("x")
        await a.run_shell("x", call_id="mine")
        await a.run_shell("x")
    await a.run_shell("outside")
    with client.trajectory("roll7"):  # a new block numbers from 0 again
        await a.run_shell("x")
    got = [(r.start.sandbox_id, r.start.call_id) for r in server.exec_requests]
    assert got == [
        (a.id, "roll7/0"),
        (b.id, "roll7/0"),
        (a.id, "mine"),
        (a.id, "roll7/1"),
        (a.id, ""),
        (a.id, "roll7/0"),
    ]


async def test_call_id_too_long_refused_before_sending(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    with pytest.raises(ValueError, match="call_id is 10240 bytes; at most 256"):
        await sb.run_shell("x", call_id="x" * 10240)
    assert server.exec_requests == []
    with pytest.raises(ValueError, match="rollout_id"):
        with client.trajectory(""):
            pass
