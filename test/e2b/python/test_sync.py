"""The sync E2B client against OpenDsec."""

import time

import pytest
from e2b import Sandbox
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
)
from e2b.sandbox.commands.command_handle import CommandExitException


def test_create_info_metadata(sandbox, test_id):
    info = sandbox.get_info()
    assert info.sandbox_id == sandbox.sandbox_id
    assert info.metadata == {"sandbox_test_id": test_id}
    assert info.template_id == "base"
    assert info.end_at > info.started_at
    assert sandbox.is_running()


def test_list_filters_by_metadata(sandbox, test_id):
    other = Sandbox.create(metadata={"sandbox_test_id": test_id + "x"})
    try:
        from e2b import SandboxQuery

        found = Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": test_id})).next_items()
        assert [s.sandbox_id for s in found] == [sandbox.sandbox_id]
        assert found[0].metadata == {"sandbox_test_id": test_id}
    finally:
        other.kill()


def test_list_paging(test_id):
    a = Sandbox.create(metadata={"paging": test_id})
    b = Sandbox.create(metadata={"paging": test_id})
    try:
        from e2b import SandboxQuery

        pager = Sandbox.list(query=SandboxQuery(metadata={"paging": test_id}), limit=1)
        first = pager.next_items()
        assert pager.has_next
        second = pager.next_items()
        assert [s.sandbox_id for s in first + second] == [b.sandbox_id, a.sandbox_id]
        assert not pager.has_next
    finally:
        a.kill()
        b.kill()


def test_connect_and_timeout(sandbox):
    same = Sandbox.connect(sandbox.sandbox_id)
    assert same.commands.run("echo hi").stdout == "hi\n"
    sandbox.set_timeout(2)
    deadline = time.monotonic() + 20
    while sandbox.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sandbox.is_running()
    with pytest.raises(NotFoundException):
        Sandbox.connect(sandbox.sandbox_id)


def test_kill(test_id):
    sbx = Sandbox.create()
    assert sbx.kill() is None or True
    assert not sbx.is_running()
    assert Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)


def test_unknown_sandbox_not_found():
    with pytest.raises(NotFoundException):
        Sandbox.connect("n001aaaaaaaaaaaaaaaa")
    with pytest.raises(NotFoundException):
        Sandbox.get_info("n001aaaaaaaaaaaaaaaa")


def test_wrong_key_authentication_error():
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_" + "0" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_" + "1" * 40).next_items()


def test_unknown_template():
    with pytest.raises(SandboxException):
        Sandbox.create("no-such-template-xyz")


def test_commands_run(sandbox):
    r = sandbox.commands.run("echo out; echo err >&2")
    assert r.exit_code == 0
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    assert sandbox.commands.run("whoami").stdout == "user\n"
    assert sandbox.commands.run("pwd").stdout == "/home/user\n"
    assert sandbox.commands.run("whoami", user="root").stdout == "root\n"
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sandbox.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout == "bar\n"
    assert sandbox.commands.run("echo $SBX_WIDE").stdout == "everywhere\n"
    assert sandbox.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"


def test_commands_nonzero_exit(sandbox):
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo bad >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stderr == "bad\n"


def test_commands_background_and_kill(sandbox):
    h = sandbox.commands.run("sleep 600", background=True)
    pids = [p.pid for p in sandbox.commands.list()]
    assert h.pid in pids
    assert sandbox.commands.kill(h.pid)
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(h.pid) is False


def test_commands_stdin(sandbox):
    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(h.pid, "hello stdin\n")
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "hello stdin\n"


def test_commands_streaming_callbacks(sandbox):
    got = []
    sandbox.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=got.append)
    assert "".join(got) == "1\n2\n3\n"


def test_files(sandbox):
    sandbox.files.write("hello.txt", "hi there")
    assert sandbox.files.read("hello.txt") == "hi there"
    assert sandbox.files.read("/home/user/hello.txt", format="bytes") == b"hi there"
    assert sandbox.files.exists("hello.txt")
    assert not sandbox.files.exists("nope.txt")
    assert sandbox.files.make_dir("d/e/f")
    assert not sandbox.files.make_dir("d/e/f")
    sandbox.files.write("d/e/f/x.bin", b"\x00\x01\x02")
    names = sorted(e.name for e in sandbox.files.list("d", depth=3))
    assert names == ["e", "f", "x.bin"]
    info = sandbox.files.get_info("d/e/f/x.bin")
    assert info.size == 3 and info.path == "/home/user/d/e/f/x.bin"
    moved = sandbox.files.rename("hello.txt", "d/moved.txt")
    assert moved.path == "/home/user/d/moved.txt"
    assert not sandbox.files.exists("hello.txt")
    assert sandbox.commands.run("cat d/moved.txt").stdout == "hi there"
    sandbox.files.remove("d")
    assert not sandbox.files.exists("d")
    with pytest.raises(NotFoundException):
        sandbox.files.read("missing.txt")


def test_files_owned_by_user(sandbox):
    sandbox.files.write("owned.txt", "x")
    assert sandbox.commands.run("stat -c %U owned.txt").stdout == "user\n"


def test_access_token_enforced(sandbox):
    import httpx
    import os

    url = os.environ["E2B_SANDBOX_URL"]
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    r = httpx.get(url + "/files", params={"path": "/etc/hostname"}, headers=headers)
    assert r.status_code == 401
    r = httpx.get(url + "/files", params={"path": "/etc/hostname"},
                  headers={**headers, "X-Access-Token": "wrong"})
    assert r.status_code == 401
    assert r.json()["message"].startswith("unauthorized access")
    # Signed URLs work with the routing headers and, as a browser would
    # fetch them, without.
    sandbox.files.write("/tmp/signed.txt", "signed content")
    for hdrs in (headers, {}):
        r = httpx.get(sandbox.download_url("/tmp/signed.txt"), headers=hdrs)
        assert r.status_code == 200, r.text
        assert r.text == "signed content"
        r = httpx.get(sandbox.download_url("/tmp/signed.txt", use_signature_expiration=60), headers=hdrs)
        assert r.status_code == 200, r.text
        expired = sandbox.download_url("/tmp/signed.txt", use_signature_expiration=-10)
        r = httpx.get(expired, headers=hdrs)
        assert r.status_code == 401
    r = httpx.get(expired, headers=headers)
    assert r.json() == {"code": 401, "message": "signature is already expired"}
    r = httpx.get(sandbox.download_url("/tmp/signed.txt").replace("signed.txt", "other.txt"))
    assert r.status_code == 401
    up = sandbox.upload_url("/tmp/uploaded.txt")
    r = httpx.post(up, files={"file": ("uploaded.txt", b"via signed upload")})
    assert r.status_code == 200, r.text
    assert sandbox.files.read("/tmp/uploaded.txt") == "via signed upload"
    r = httpx.post(url + "/init", headers={**headers, "X-Access-Token": sandbox._envd_access_token})
    assert r.status_code == 404
    r = httpx.get(url + "/health", headers={"E2b-Sandbox-Id": "n001bbbbbbbbbbbbbbbb", "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502
    assert r.json() == {"sandboxId": "n001bbbbbbbbbbbbbbbb", "message": "The sandbox was not found", "code": 502}


def test_port_proxy(sandbox):
    import httpx
    import os

    sandbox.commands.run("cd /tmp && echo served > index.html && python3 -m http.server 8000", background=True)
    url = os.environ["E2B_SANDBOX_URL"]
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8000"}
    deadline = time.monotonic() + 20
    r = None
    while time.monotonic() < deadline:
        r = httpx.get(url + "/index.html", headers=headers)
        if r.status_code == 200:
            break
        time.sleep(0.2)
    assert r is not None and r.status_code == 200 and r.text == "served\n"
    host = sandbox.get_host(8000)
    assert host == f"8000-{sandbox.sandbox_id}.{os.environ.get('E2B_DOMAIN', 'opendsec.local')}"
    r = httpx.get(url + "/index.html", headers={"Host": host})
    assert r.status_code == 200 and r.text == "served\n"
    r = httpx.get(url + "/", headers={**headers, "E2b-Sandbox-Port": "8001"})
    assert r.status_code == 502
    assert r.json()["message"] == "The sandbox is running but port is not open"
    assert r.json()["port"] == 8001
