"""Live tests of the trajectory log: exactly-once calls in trajectory blocks,
Sandbox.trajectory, and client.replay (a determinism check)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from live_helpers import IMAGE, run_args

from opendsec import DSecClient, FailedPreconditionError, InvalidArgumentError, Sandbox

# Debian's coreutils date prints nanoseconds (busybox's prints "%N").
PY_IMAGE = "root/py:3.11"

DETERMINISTIC = [
    "echo hello",
    "printf 'b\\na\\n' | sort",
    "echo to-stderr >&2; exit 3",
    "echo once >> /tmp/appended; wc -l < /tmp/appended",
    "seq 1 5 | tr '\\n' ,",
]


async def _rollout(sb: Sandbox, client: DSecClient, rollout: str, cmds: list[str]) -> list:
    out = []
    with client.trajectory(rollout):
        for c in cmds:
            out.append(await sb.run_shell(c))
    return out


async def test_trajectory_block_replays_done_calls(client: DSecClient, sandbox: Sandbox) -> None:
    first = await _rollout(sandbox, client, "live-r1", DETERMINISTIC)
    assert [r.call_id for r in first] == [f"live-r1/{i}" for i in range(len(DETERMINISTIC))]
    assert not any(r.replayed for r in first)
    assert [r.seq for r in first] == sorted(r.seq for r in first) and first[0].seq > 0

    # The trainer comes back and runs the same rollout: nothing runs again.
    again = await _rollout(sandbox, client, "live-r1", DETERMINISTIC)
    assert all(r.replayed for r in again)
    assert [(r.seq, r.exit_code, r.stdout, r.stderr) for r in again] == [
        (r.seq, r.exit_code, r.stdout, r.stderr) for r in first
    ]
    assert again[2].exit_code == 3 and again[2].stderr == "to-stderr\n"
    lines = await sandbox.run_shell("cat /tmp/appended")
    assert lines.stdout == "once\n", "the append ran more than once"

    # A known call ID with another command is refused, naming both.
    with pytest.raises(FailedPreconditionError) as ei:
        await sandbox.run_shell("echo other", call_id="live-r1/0")
    assert "echo hello" in str(ei.value) and "echo other" in str(ei.value)
    with pytest.raises((InvalidArgumentError, ValueError), match="call_id"):
        await sandbox.run_shell("true", call_id="x" * 10240)

    # The log holds each call once, in order, and the untagged calls too.
    log = [e async for e in sandbox.trajectory()]
    assert log[0]["sandbox_id"] == sandbox.id
    ids = [e.get("call_id", "") for e in log]
    assert ids[: len(DETERMINISTIC)] == [f"live-r1/{i}" for i in range(len(DETERMINISTIC))]
    assert ids[len(DETERMINISTIC) :] == [""]  # the cat; the refused calls are not logged
    assert [int(e["seq"]) for e in log] == sorted(int(e["seq"]) for e in log)


async def test_replay_deterministic_log_has_no_differences(client: DSecClient, sandbox: Sandbox) -> None:
    await _rollout(sandbox, client, "live-det", DETERMINISTIC)
    rep = await client.replay(sandbox.id, image=IMAGE)
    assert rep.calls == len(DETERMINISTIC) and rep.skipped == 0
    assert rep.differences == [], rep.differences
    assert rep.sandbox_id != sandbox.id


async def test_replay_names_the_call_printing_the_time(client: DSecClient) -> None:
    sb = await client.run_sandbox(run_args(image=PY_IMAGE, labels={"opendsec-sdk-test": "1"}))
    try:
        cmds = ["echo start", "date +%s%N", "echo end"]
        res = await _rollout(sb, client, "live-time", cmds)
        assert res[1].stdout.strip().isdigit(), res[1].stdout  # nanoseconds, not "%N"
        rep = await client.replay(sb.id, image=PY_IMAGE)
    finally:
        await sb.stop()
    assert rep.calls == 3
    assert rep.differences, "a replay of a call printing the time reported no difference"
    first = rep.differences[0]
    assert (first.call_id, first.field, first.command) == ("live-time/1", "stdout", ["/bin/sh", "-c", "date +%s%N"])
    assert first.recorded == res[1].stdout_bytes and first.replayed != first.recorded
    assert len(rep.differences) == 1
