"""Calls through the E2B gateway are in the sandbox's trajectory log.

The log is read through OpenDsec's own API (ProcessService.GetTrajectory,
Connect protocol with JSON over HTTP/1.1; field names in lowerCamelCase) with the admin token that
scripts/test-e2b.sh passes in E2B_TEST_OPENDSEC_API / _TOKEN (the E2B key's
principal owns the sandbox; the admin may read every log).
"""

import base64
import json
import os
import struct

import httpx
import pytest
from e2b_code_interpreter import Sandbox

API = os.environ.get("E2B_TEST_OPENDSEC_API")
TOKEN = os.environ.get("E2B_TEST_OPENDSEC_TOKEN")

pytestmark = pytest.mark.skipif(not API or not TOKEN, reason="E2B_TEST_OPENDSEC_API/_TOKEN not set (scripts/test-e2b.sh sets them)")


def trajectory(sandbox_id):
    """GetTrajectory as a list of entries (Connect server stream, JSON)."""
    msg = json.dumps({"sandbox_id": sandbox_id}).encode()
    resp = httpx.post(
        f"{API}/opendsec.v1.ProcessService/GetTrajectory",
        content=b"\x00" + struct.pack(">I", len(msg)) + msg,
        headers={"Content-Type": "application/connect+json", "Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    data, out = resp.content, []
    while data:
        flags, n = data[0], struct.unpack(">I", data[1:5])[0]
        payload, data = json.loads(data[5 : 5 + n] or b"{}"), data[5 + n :]
        if flags & 0x02:
            assert "error" not in payload, payload
            break
        out.append(payload)
    return out


def test_run_code_and_commands_are_logged():
    sbx = Sandbox.create()
    try:
        ex = sbx.run_code("print(6*7)")
        assert ex.logs.stdout == ["42\n"]
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        entries = trajectory(sbx.sandbox_id)
    finally:
        sbx.kill()
    code = [e for e in entries if e.get("kind") == "code"]
    execs = [e for e in entries if e.get("kind") == "exec" and any("echo hi" in a for a in e.get("command", []))]
    assert len(code) == 1, entries
    assert code[0]["code"] == "print(6*7)" and code[0]["state"] == "done" and code[0]["status"] == "ok", code[0]
    assert code[0]["httpStatus"] == 200  # protojson: lowerCamelCase names
    assert "42" in base64.b64decode(code[0]["stdout"]).decode(), code[0]
    assert len(execs) == 1 and execs[0]["state"] == "done", entries
    assert "hi" in base64.b64decode(execs[0]["stdout"]).decode()
    assert int(code[0]["seq"]) < int(execs[0]["seq"])
