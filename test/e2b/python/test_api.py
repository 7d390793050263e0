"""Control plane: bad input through raw HTTP, API-key isolation, network
policies and traffic tokens, with the sync and async E2B clients."""

import os
import time

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

API = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
OTHER = os.environ.get("E2B_TEST_OTHER_KEY")


def raw(method, path, key=KEY, **kw):
    headers = kw.pop("headers", {})
    if key is not None:
        headers["X-API-Key"] = key
    return httpx.request(method, API + path, headers=headers, timeout=30, **kw)


def ids(key=KEY):
    r = raw("GET", "/v2/sandboxes", key=key)
    assert r.status_code == 200, r.text
    return sorted(s["sandboxID"] for s in r.json())


@pytest.mark.parametrize(
    "body,status,words",
    [
        (b'{"templateID": "base",', 400, "JSON"),
        (b'["not", "an", "object"]', 400, "JSON"),
        (b'{"templateID": ""}', 400, "templateID"),
        (b'{"templateID": "no-such-template-xyz"}', 404, "no-such-template-xyz"),
        (b'{"templateID": "base", "timeout": 0}', 400, "Timeout must be greater than 0"),
        (b'{"templateID": "base", "timeout": -5}', 400, "Timeout must be greater than 0"),
        (b'{"templateID": "base", "timeout": 9999999}', 400, "Timeout cannot be greater than"),
        (b'{"templateID": "base", "timeout": "ten"}', 400, "JSON"),
        (b'{"templateID": "base", "metadata": {"k": 1}}', 400, "JSON"),
        (b'{"templateID": "base", "network": {"denyOut": ["not-a-cidr"]}}', 400, "network.denyOut[0]"),
        (b'{"templateID": "base", "network": {"allowOut": ["pypi.org"]}}', 400, "network.allowOut[0]"),
        (b'{"templateID": "base", "autoPause": false, "volumeMounts": [{"name": "v", "path": "/v"}]}', 400, "volumeMounts"),
    ],
)
def test_bad_create_is_e2b_shaped_and_makes_nothing(body, status, words):
    before = ids()
    for route in ("/sandboxes", "/v2/sandboxes"):
        r = raw("POST", route, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
        e = r.json()
        assert set(e) >= {"code", "message"} and e["code"] == status
        assert words in e["message"], e["message"]
    assert ids() == before


def test_huge_metadata_refused():
    before = ids()
    md = {f"k{i}": "v" for i in range(1000)}
    r = raw("POST", "/v2/sandboxes", json={"templateID": "base", "metadata": md})
    assert r.status_code == 400 and r.json()["code"] == 400
    assert "metadata" in r.json()["message"]
    r = raw("POST", "/v2/sandboxes", json={"templateID": "base", "metadata": {"k": "v" * 100000}})
    assert r.status_code == 400 and "metadata" in r.json()["message"]
    big = b'{"templateID": "base", "metadata": {"k": "' + b"v" * (2 << 20) + b'"}}'
    r = raw("POST", "/v2/sandboxes", content=big)
    assert r.status_code in (400, 413) and r.json()["code"] == r.status_code
    with pytest.raises(SandboxException) as e:
        Sandbox.create(metadata=md)
    assert "400" in str(e.value)
    assert ids() == before


def test_bad_input_on_other_routes(sandbox):
    sid = sandbox.sandbox_id
    for method, path, body, status in [
        ("POST", f"/sandboxes/{sid}/timeout", b"{", 400),
        ("POST", f"/sandboxes/{sid}/timeout", b'{"timeout": -1}', 400),
        ("POST", f"/sandboxes/{sid}/timeout", b'{"timeout": 99999999}', 400),
        ("POST", f"/v2/sandboxes/{sid}/connect", b'{"timeout": -3}', 400),
        ("GET", "/v2/sandboxes?limit=0", None, 400),
        ("GET", "/v2/sandboxes?state=sleeping", None, 400),
        ("GET", "/v2/sandboxes?nextToken=garbage", None, 400),
        ("GET", "/v2/sandboxes?metadata=novalue", None, 400),
        ("PUT", f"/sandboxes/{sid}/network", b'{"denyOut": ["::1/128"]}', 400),
        ("GET", "/sandboxes/n001aaaaaaaaaaaaaaaa", None, 404),
        ("DELETE", "/sandboxes/n001aaaaaaaaaaaaaaaa", None, 404),
    ]:
        r = raw(method, path, content=body)
        assert r.status_code == status, (method, path, r.text)
        assert r.json()["code"] == status and r.json()["message"]
    assert sandbox.is_running()
    assert sandbox.get_info().end_at > sandbox.get_info().started_at


def test_envd_bad_input(sandbox):
    base = os.environ["E2B_SANDBOX_URL"]
    h = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": sandbox._envd_access_token}
    r = httpx.get(base + "/files", params={"path": "/nope/missing.txt"}, headers=h)
    assert r.status_code == 404 and r.json()["code"] == 404 and "does not exist" in r.json()["message"]
    r = httpx.get(base + "/files", params={"path": "/etc"}, headers=h)
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.get(base + "/files", params={"path": "/etc/hostname", "username": "nobody-here"}, headers=h)
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.post(base + "/files", headers=h, content=b"x")
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.get(base + "/", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "99999"})
    assert r.status_code == 400
    r = httpx.get(base + "/health", headers={"E2b-Sandbox-Id": "BAD-ID!", "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 400


def test_wrong_key_everywhere():
    bad = "e2b_" + "f" * 40
    for method, path in [("GET", "/v2/sandboxes"), ("POST", "/v2/sandboxes"), ("GET", "/sandboxes/x"), ("DELETE", "/sandboxes/x")]:
        for key in (None, bad, "not-a-key"):
            r = raw(method, path, key=key, json={"templateID": "base"})
            assert r.status_code == 401 and r.json()["code"] == 401, (method, path, key)
    with pytest.raises(AuthenticationException):
        Sandbox.get_info("n001aaaaaaaaaaaaaaaa", api_key=bad)
    with pytest.raises(AuthenticationException):
        Sandbox.kill("n001aaaaaaaaaaaaaaaa", api_key=bad)


def test_key_isolation(sandbox):
    assert OTHER, "E2B_TEST_OTHER_KEY (a key of another principal) is set by scripts/test-e2b.sh"
    sid = sandbox.sandbox_id
    assert sid not in ids(OTHER)
    assert sid not in [s.sandbox_id for s in Sandbox.list(api_key=OTHER).next_items()]
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sid, api_key=OTHER)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sid, api_key=OTHER)
    with pytest.raises(NotFoundException):
        Sandbox.set_timeout(sid, 5, api_key=OTHER)
    assert Sandbox.kill(sid, api_key=OTHER) is False
    for method, path in [("GET", f"/sandboxes/{sid}"), ("POST", f"/sandboxes/{sid}/timeout"), ("PUT", f"/sandboxes/{sid}/network")]:
        r = raw(method, path, key=OTHER, json={"timeout": 5})
        assert r.status_code == 404, (method, path, r.text)
    # The other key's own sandbox is invisible the other way round.
    theirs = Sandbox.create(api_key=OTHER)
    try:
        assert theirs.sandbox_id in ids(OTHER)
        assert theirs.sandbox_id not in ids()
        assert Sandbox.kill(theirs.sandbox_id) is False
    finally:
        theirs.kill()
    assert sandbox.is_running()


def test_info_list_and_filters(sandbox, test_id):
    info = sandbox.get_info()
    assert info.state == SandboxState.RUNNING
    assert info.cpu_count >= 1 and info.memory_mb >= 128
    assert info.envd_version
    found = Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": test_id}, state=[SandboxState.RUNNING])).next_items()
    assert [s.sandbox_id for s in found] == [sandbox.sandbox_id]
    assert Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": test_id}, state=[SandboxState.PAUSED])).next_items() == []
    assert Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": "other" + test_id})).next_items() == []
    before = sandbox.get_info().end_at
    sandbox.set_timeout(3600)
    assert sandbox.get_info().end_at > before
    assert sandbox.commands.run("echo $SBX_WIDE").stdout == "everywhere\n"


def test_internet_by_default(sandbox):
    # E2B's default: no network option reaches the (public) internet.
    assert sandbox.get_info().allow_internet_access is True


def test_network_policy_and_update(test_id):
    sbx = Sandbox.create(allow_internet_access=False, metadata={"sandbox_test_id": test_id})
    try:
        assert sbx.get_info().allow_internet_access is False
        Sandbox.update_network(sbx.sandbox_id, {"allow_out": ["1.1.1.1"], "deny_out": ["0.0.0.0/0"]})
        assert sbx.get_info().allow_internet_access is False
        sbx.update_network({})
        assert sbx.get_info().allow_internet_access is True
        with pytest.raises(SandboxException):
            sbx.update_network({"deny_out": ["not-an-address"]})
        assert sbx.get_info().allow_internet_access is True
        with pytest.raises(NotFoundException):
            Sandbox.update_network("n001aaaaaaaaaaaaaaaa", {})
    finally:
        sbx.kill()


def test_traffic_access_token(test_id):
    sbx = Sandbox.create(network={"allow_public_traffic": False}, metadata={"sandbox_test_id": test_id})
    try:
        tok = sbx.traffic_access_token
        assert tok
        sbx.commands.run("cd /tmp && python3 -m http.server 8124", background=True)
        base = os.environ["E2B_SANDBOX_URL"]
        h = {"Host": sbx.get_host(8124)}

        def get(extra):
            return httpx.get(base + "/", headers={**h, **extra})

        deadline = time.monotonic() + 20
        while get({"e2b-traffic-access-token": tok}).status_code != 200:
            assert time.monotonic() < deadline, "http.server did not come up"
            time.sleep(0.1)
        assert get({}).status_code == 403
        assert get({"e2b-traffic-access-token": "wrong"}).status_code == 403
        # envd (49983) keeps its own token and needs no traffic token.
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()


async def test_async_api(test_id):
    sbx = await AsyncSandbox.create(metadata={"sandbox_test_id": test_id}, envs={"AE": "1"}, timeout=120)
    try:
        assert (await sbx.commands.run("echo $AE")).stdout == "1\n"
        info = await sbx.get_info()
        assert info.metadata == {"sandbox_test_id": test_id}
        paginator = AsyncSandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": test_id}))
        assert [s.sandbox_id for s in await paginator.next_items()] == [sbx.sandbox_id]
        await sbx.set_timeout(600)
        assert (await sbx.get_info()).end_at > info.end_at
        with pytest.raises(AuthenticationException):
            await AsyncSandbox.create(api_key="e2b_" + "2" * 40)
        with pytest.raises(NotFoundException):
            await AsyncSandbox.connect("n001aaaaaaaaaaaaaaaa")
    finally:
        assert await sbx.kill() in (True, None)
    assert await AsyncSandbox.kill(sbx.sandbox_id) is False
