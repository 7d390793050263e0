"""Commands, files, watch and PTY with the sync and async E2B clients."""

import asyncio
import time

import httpx
import pytest
from e2b import AsyncSandbox, FilesystemEventType, PtySize
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.exceptions import NotFoundException, SandboxException, TimeoutException
from e2b.sandbox.commands.command_handle import CommandExitException


def until(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# --- commands (sync) -------------------------------------------------------


def test_background_wait_and_connect(sandbox):
    h = sandbox.commands.run("echo start; sleep 0.5; echo done; exit 0", background=True)
    same = sandbox.commands.connect(h.pid)
    r = same.wait()
    assert r.exit_code == 0
    assert "done\n" in r.stdout
    assert h.wait().stdout == "start\ndone\n"


def test_connect_unknown_pid(sandbox):
    with pytest.raises(SandboxException):
        sandbox.commands.connect(999999).wait()


def test_list_shows_cmd_and_envs(sandbox):
    h = sandbox.commands.run("sleep 600", background=True, envs={"LISTED": "1"}, cwd="/tmp")
    try:
        procs = {p.pid: p for p in sandbox.commands.list()}
        assert h.pid in procs
        p = procs[h.pid]
        assert p.cmd == "/bin/bash" and "sleep 600" in p.args[-1]
        assert p.envs.get("LISTED") == "1"
        assert p.cwd == "/tmp"
    finally:
        sandbox.commands.kill(h.pid)


def test_stdin_bytes_and_multiple_writes(sandbox):
    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(h.pid, "line 1\n")
    sandbox.commands.send_stdin(h.pid, b"line 2\n")
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "line 1\nline 2\n"


def test_command_timeout(sandbox):
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=1)
    # The process was killed on the server as well.
    until(lambda: not any("sleep 30" in " ".join(p.args) for p in sandbox.commands.list()), what="sleep to die")


def test_user_and_cwd_and_env_isolation(sandbox):
    assert sandbox.commands.run("id -un; echo $HOME", user="root").stdout == "root\n/root\n"
    assert sandbox.commands.run("id -un; echo $HOME").stdout == "user\n/home/user\n"
    sandbox.commands.run("echo $ONLY_ONCE", envs={"ONLY_ONCE": "x"})
    assert sandbox.commands.run("echo -n $ONLY_ONCE").stdout == ""
    with pytest.raises(SandboxException):
        sandbox.commands.run("pwd", cwd="/does/not/exist")
    # Root can write where the user cannot.
    with pytest.raises(CommandExitException):
        sandbox.commands.run("touch /etc/opendsec-test")
    sandbox.commands.run("touch /etc/opendsec-test", user="root")


def test_exit_error_carries_output(sandbox):
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo partial; echo oops >&2; exit 42")
    assert e.value.exit_code == 42
    assert e.value.stdout == "partial\n"
    assert e.value.stderr == "oops\n"
    assert "exit status 42" in (e.value.error or "")


# --- files (sync) -----------------------------------------------------------


def test_files_write_many_and_read_formats(sandbox):
    infos = sandbox.files.write_files(
        [WriteEntry(path="many/a.txt", data="A"), WriteEntry(path="/tmp/many/b.bin", data=b"\xff\x00B")]
    )
    assert sorted(i.path for i in infos) == ["/home/user/many/a.txt", "/tmp/many/b.bin"]
    assert sandbox.files.read("many/a.txt") == "A"
    assert sandbox.files.read("/tmp/many/b.bin", format="bytes") == bytearray(b"\xff\x00B")
    assert b"".join(sandbox.files.read("/tmp/many/b.bin", format="stream")) == b"\xff\x00B"
    sandbox.files.write("many/a.txt", "overwritten")
    assert sandbox.files.read("many/a.txt") == "overwritten"
    sandbox.files.write("empty.txt", "")
    assert sandbox.files.read("empty.txt") == ""


def test_files_list_depth_and_info(sandbox):
    sandbox.files.write("tree/a/b/c.txt", "c")
    sandbox.files.write("tree/top.txt", "t")
    one = {e.name for e in sandbox.files.list("tree")}
    assert one == {"a", "top.txt"}
    two = {e.path for e in sandbox.files.list("tree", depth=2)}
    assert two == {"/home/user/tree/a", "/home/user/tree/top.txt", "/home/user/tree/a/b"}
    info = sandbox.files.get_info("tree/top.txt")
    assert info.name == "top.txt" and info.type.value == "file" and info.size == 1
    assert info.owner == "user" and info.permissions == "-rw-r--r--" and info.mode == 0o644
    d = sandbox.files.get_info("tree/a")
    assert d.type.value == "dir"
    with pytest.raises(NotFoundException):
        sandbox.files.get_info("tree/nope")
    with pytest.raises(NotFoundException):
        sandbox.files.list("no-such-dir")


def test_files_rename_remove_make_dir(sandbox):
    assert sandbox.files.make_dir("mk/x/y")
    assert not sandbox.files.make_dir("mk/x/y")
    sandbox.files.write("mk/f.txt", "f")
    e = sandbox.files.rename("mk/f.txt", "mk/x/y/g.txt")
    assert e.path == "/home/user/mk/x/y/g.txt" and e.name == "g.txt"
    assert sandbox.files.read("mk/x/y/g.txt") == "f"
    with pytest.raises(NotFoundException):
        sandbox.files.rename("mk/missing", "mk/other")
    sandbox.files.remove("mk/x")
    assert not sandbox.files.exists("mk/x/y/g.txt")
    assert sandbox.files.exists("mk")
    sandbox.files.remove("mk/never-existed")  # removing nothing is not an error


def test_file_api_runs_as_root_like_envd(sandbox):
    # envd serves the file API as root whatever the user (docs/security.md):
    # the user picks ownership and the home for relative paths. Processes
    # do run as the user.
    sandbox.files.write("/etc/written-by-file-api.txt", "x")
    assert sandbox.commands.run("stat -c %U /etc/written-by-file-api.txt").stdout == "user\n"
    sandbox.files.write("/etc/as-root.txt", "x", user="root")
    assert sandbox.commands.run("stat -c %U /etc/as-root.txt").stdout == "root\n"
    with pytest.raises(CommandExitException):
        sandbox.commands.run("touch /etc/by-process.txt")
    assert not sandbox.files.exists("/etc/by-process.txt")
    with pytest.raises(SandboxException):
        sandbox.files.read("/etc")  # a directory


def test_signed_urls(sandbox):
    up = sandbox.upload_url("/home/user/up/signed.txt", use_signature_expiration=60)
    r = httpx.post(up, files={"file": ("signed.txt", b"uploaded via url")})
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"] == "/home/user/up/signed.txt"
    down = sandbox.download_url("/home/user/up/signed.txt", use_signature_expiration=60)
    assert httpx.get(down).content == b"uploaded via url"
    # A download signature does not authorize an upload, and vice versa.
    assert httpx.post(down.replace("/files?", "/files?"), files={"file": ("x", b"x")}).status_code == 401
    expired = sandbox.upload_url("/home/user/up/late.txt", use_signature_expiration=-5)
    r = httpx.post(expired, files={"file": ("late.txt", b"late")})
    assert r.status_code == 401
    assert r.json() == {"code": 401, "message": "signature is already expired"}
    assert not sandbox.files.exists("up/late.txt")


def test_watch_dir_sync(sandbox):
    sandbox.files.make_dir("w/sub")
    h = sandbox.files.watch_dir("w", recursive=True)
    try:
        sandbox.files.write("w/new.txt", "1")
        sandbox.files.write("w/sub/deep.txt", "2")
        sandbox.files.remove("w/new.txt")
        seen = []

        def have_all():
            seen.extend(h.get_new_events())
            kinds = {(e.name, e.type) for e in seen}
            return (
                ("new.txt", FilesystemEventType.CREATE) in kinds
                and ("new.txt", FilesystemEventType.WRITE) in kinds
                and ("sub/deep.txt", FilesystemEventType.CREATE) in kinds
                and ("new.txt", FilesystemEventType.REMOVE) in kinds
            )

        until(have_all, what="watch events")
    finally:
        h.stop()
    with pytest.raises(NotFoundException):
        sandbox.files.watch_dir("not-there")


# --- pty ---------------------------------------------------------------------


def test_pty_sync(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.send_stdin(h.pid, b"echo pty-$((40+2))\n")
    sandbox.pty.resize(h.pid, PtySize(rows=33, cols=111))
    sandbox.pty.send_stdin(h.pid, b"stty size; exit 3\n")
    out = []
    with pytest.raises(CommandExitException) as e:
        h.wait(on_pty=lambda d: out.append(bytes(d)))
    text = b"".join(out).decode(errors="replace")
    assert e.value.exit_code == 3
    assert "pty-42" in text and "33 111" in text
    k = sandbox.pty.create(PtySize(rows=10, cols=10))
    assert sandbox.pty.kill(k.pid)
    with pytest.raises(CommandExitException):
        k.wait()
    assert not sandbox.pty.kill(k.pid)


# --- get_host ---------------------------------------------------------------


# Serves /tmp/www and answers a POST with the length of the body it read
# whole. (http.server's own 501 for a POST closes with the body unread, and
# a close with unread data is a TCP reset that can drop the answer in
# flight: that raced, it did not test the proxy.)
_HOST_ROUTES_SERVER = """
import http.server
class H(http.server.SimpleHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        out = str(len(body)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
http.server.ThreadingHTTPServer(("", 8123), H).serve_forever()
"""


def test_get_host_routes(sandbox):
    import os

    sandbox.commands.run("mkdir -p /tmp/www && echo hostroute > /tmp/www/i.txt")
    sandbox.files.write("/tmp/srv.py", _HOST_ROUTES_SERVER)
    sandbox.commands.run("cd /tmp/www && python3 /tmp/srv.py", background=True)
    base = os.environ["E2B_SANDBOX_URL"]
    host = sandbox.get_host(8123)
    r = until(lambda: (lambda r: r if r.status_code == 200 else None)(httpx.get(base + "/i.txt", headers={"Host": host})),
              what="http.server via Host")
    assert r.text == "hostroute\n"
    r = httpx.get(base + "/i.txt", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8123"})
    assert r.status_code == 200 and r.text == "hostroute\n"
    # A request with a body goes through too, all of it.
    r = httpx.post(base + "/i.txt", headers={"Host": host}, content=b"x" * 100000)
    assert r.status_code == 200 and r.text == "100000"


# --- async -------------------------------------------------------------------


async def test_async_commands_full(async_sandbox):
    h = await async_sandbox.commands.run("cat", background=True, stdin=True)
    await async_sandbox.commands.send_stdin(h.pid, "async in\n")
    await async_sandbox.commands.close_stdin(h.pid)
    assert (await h.wait()).stdout == "async in\n"
    bg = await async_sandbox.commands.run("sleep 0.3; echo bg", background=True)
    again = await async_sandbox.commands.connect(bg.pid)
    assert (await again.wait()).stdout == "bg\n"
    assert (await async_sandbox.commands.run("id -un", user="root")).stdout == "root\n"
    long = await async_sandbox.commands.run("sleep 600", background=True)
    assert long.pid in [p.pid for p in await async_sandbox.commands.list()]
    assert await async_sandbox.commands.kill(long.pid)
    with pytest.raises(CommandExitException):
        await long.wait()
    with pytest.raises(TimeoutException):
        await async_sandbox.commands.run("sleep 30", timeout=1)


async def test_async_files_full(async_sandbox):
    await async_sandbox.files.write_files([WriteEntry(path="aw/1.txt", data="1"), WriteEntry(path="aw/2.bin", data=b"\x02")])
    assert await async_sandbox.files.read("aw/2.bin", format="bytes") == bytearray(b"\x02")
    assert {e.name for e in await async_sandbox.files.list("aw")} == {"1.txt", "2.bin"}
    assert (await async_sandbox.files.get_info("aw/1.txt")).size == 1
    assert await async_sandbox.files.make_dir("aw/d")
    await async_sandbox.files.rename("aw/1.txt", "aw/d/1.txt")
    assert await async_sandbox.files.exists("aw/d/1.txt")
    events = []
    await async_sandbox.files.make_dir("aw/watched/inner")
    h = await async_sandbox.files.watch_dir("aw/watched", on_event=events.append, recursive=True)
    try:
        await async_sandbox.files.write("aw/watched/inner/x.txt", "x")
        await async_sandbox.files.remove("aw/watched/inner/x.txt")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kinds = {(e.name, e.type) for e in events}
            if ("inner/x.txt", FilesystemEventType.CREATE) in kinds and ("inner/x.txt", FilesystemEventType.REMOVE) in kinds:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"async watch events: {events}")
    finally:
        await h.stop()


async def test_async_pty(async_sandbox):
    out = []
    h = await async_sandbox.pty.create(PtySize(rows=20, cols=70), on_data=lambda d: out.append(bytes(d)))
    await async_sandbox.pty.resize(h.pid, PtySize(rows=21, cols=71))
    await async_sandbox.pty.send_stdin(h.pid, b"stty size; exit\n")
    await h.wait()
    assert "21 71" in b"".join(out).decode(errors="replace")


async def test_async_signed_and_timeout(async_sandbox):
    await async_sandbox.files.write("/tmp/s.txt", "async signed")
    url = async_sandbox.download_url("/tmp/s.txt", use_signature_expiration=30)
    async with httpx.AsyncClient() as c:
        assert (await c.get(url)).text == "async signed"
    await async_sandbox.set_timeout(1)
    deadline = time.monotonic() + 20
    while await async_sandbox.is_running() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not await async_sandbox.is_running()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(async_sandbox.sandbox_id)


def test_large_output_is_not_lost(sandbox):
    n = 3_000_000  # beyond the agent's retained-output cap
    r = sandbox.commands.run(f"head -c {n} /dev/zero | tr '\\0' a")
    assert len(r.stdout) == n and set(r.stdout) == {"a"}
