"""network.maskRequestHost and lifecycle auto_resume, sent by the unmodified
E2B SDK."""

import os
import time

import httpx
import pytest
from e2b import Sandbox, SandboxState

HEADERS_SERVER = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ''.join(k + ': ' + v + chr(10) for k, v in self.headers.items()).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(('', 8080), H).serve_forever()
"""


def _get(url, headers, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url, headers=headers, timeout=10)
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no 200 from {url} within {timeout}s")
        time.sleep(0.1)


def test_mask_request_host(test_id):
    sbx = Sandbox.create(metadata={"sandbox_test_id": test_id},
                         network={"mask_request_host": "custom-host.example.com:${PORT}"})
    try:
        sbx.files.write("/home/user/h.py", HEADERS_SERVER)
        sbx.commands.run("python /home/user/h.py", background=True)
        base = os.environ["E2B_SANDBOX_URL"]
        r = _get(base + "/", {"Host": sbx.get_host(8080)})
        assert "Host: custom-host.example.com:8080\n" in r.text, r.text
        info = httpx.get(f"{os.environ['E2B_API_URL']}/sandboxes/{sbx.sandbox_id}",
                         headers={"X-API-Key": os.environ["E2B_API_KEY"]}, timeout=10).json()
        assert info["network"]["maskRequestHost"] == "custom-host.example.com:${PORT}", info
    finally:
        sbx.kill()
    # Without a mask the sandbox sees the Host it was reached by.
    plain = Sandbox.create(metadata={"sandbox_test_id": test_id})
    try:
        plain.files.write("/home/user/h.py", HEADERS_SERVER)
        plain.commands.run("python /home/user/h.py", background=True)
        host = plain.get_host(8080)
        r = _get(os.environ["E2B_SANDBOX_URL"] + "/", {"Host": host})
        assert f"Host: {host}\n" in r.text, r.text
    finally:
        plain.kill()


def test_auto_resume_false_keeps_a_paused_sandbox_paused(test_id):
    sbx = Sandbox.create(metadata={"sandbox_test_id": test_id},
                         lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        assert sbx.get_info().lifecycle["auto_resume"] is False
        bg = sbx.commands.run("sleep 3600", background=True)
        assert sbx.pause() is True
        with pytest.raises(Exception):
            sbx.commands.run("echo woke", timeout=10)
        with pytest.raises(Exception):
            sbx.files.read("/etc/hostname")
        assert sbx.get_info().state == SandboxState.PAUSED
        # connect resumes it, memory kept.
        same = Sandbox.connect(sbx.sandbox_id)
        assert same.commands.run(f"kill -0 {bg.pid} && echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


def test_auto_resume_true_resumes_on_traffic(test_id):
    sbx = Sandbox.create(metadata={"sandbox_test_id": test_id},
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert sbx.get_info().lifecycle["auto_resume"] is True
        assert sbx.pause() is True
        assert sbx.commands.run("echo woke").stdout == "woke\n"
        assert sbx.get_info().state == SandboxState.RUNNING
    finally:
        sbx.kill()
