"""The real E2B SDK over https with HTTP/2 and a wildcard certificate."""

import os
import socket
import ssl
import threading
import time

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxNotRunningException
from pyqwest import StreamError

from conftest import DOMAIN, GATEWAY_IP


@pytest.fixture
def sandbox():
    sbx = Sandbox.create()
    try:
        yield sbx
    finally:
        sbx.kill()


def test_https_hosts_commands_files(sandbox, resolver):
    assert sandbox.connection_config.api_url == f"https://api.{DOMAIN}"
    host = sandbox.get_host(49983)
    assert host == f"49983-{sandbox.sandbox_id}.{DOMAIN}"
    assert sandbox.envd_api_url == f"https://{host}"

    r = sandbox.commands.run("echo hello over tls; echo err >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hello over tls\n", "err\n")
    sandbox.files.write("/tmp/tls.txt", "written over h2")
    assert sandbox.files.read("/tmp/tls.txt") == "written over h2"
    assert sandbox.is_running()
    # Both names went through the test's resolver.
    assert len(resolver) >= 2


def test_gateway_negotiates_h2(sandbox):
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    host = sandbox.get_host(49983)
    with socket.create_connection((GATEWAY_IP, 443), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            assert tls.selected_alpn_protocol() == "h2"
            assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_kill_under_running_command_is_sandbox_killed():
    sbx = Sandbox.create()
    try:
        started = time.monotonic()
        threading.Timer(1.5, lambda: Sandbox.kill(sbx.sandbox_id)).start()
        with pytest.raises(SandboxNotRunningException) as ei:
            sbx.commands.run("sleep 60")
        assert time.monotonic() - started < 20
        assert "The sandbox was killed" in str(ei.value)
        # It came as a transport failure of the stream (an HTTP/2
        # RST_STREAM: pyqwest's StreamError), not an envd error.
        assert isinstance(ei.value.__cause__.__cause__, StreamError), repr(ei.value.__cause__)
    finally:
        Sandbox.kill(sbx.sandbox_id)

