"""The routes E2B's dashboard and CLI use, read through the E2B SDK's own
generated API client (its models parse the answers, so a field missing or of
the wrong type fails here): a template with its builds, PATCH public, the v2
template list, a build's logs, the key's team, and a sandbox's logs."""

import os
import uuid

import httpx
from e2b import ConnectionConfig, Sandbox, Template
from e2b.api.client.api.sandboxes import get_sandboxes_sandbox_id_logs, get_v_2_sandboxes_sandbox_id_logs
from e2b.api.client.api.templates import (
    get_templates_template_id,
    get_templates_template_id_builds_build_id_logs,
    get_v2_templates,
    patch_v_2_templates_template_id,
)
from e2b.api.client.models import (
    Error,
    LogLevel,
    LogsDirection,
    SandboxLogs,
    SandboxLogsV2Response,
    Template as TemplateModel,
    TemplateBuildLogsResponse,
    TemplateUpdateRequest,
    TemplateUpdateResponse,
    TemplateWithBuilds,
)
from e2b.api.client_sync import get_api_client

API = os.environ["E2B_API_URL"].rstrip("/")
KEY = os.environ["E2B_API_KEY"]
OTHER = os.environ.get("E2B_TEST_OTHER_KEY")


def client(key=None):
    return get_api_client(ConnectionConfig(api_key=key or KEY))


def test_template_routes():
    name = "routes-" + uuid.uuid4().hex[:8]
    tpl = Template().from_image("root/busybox").run_cmd("echo routes-marker")
    info = Template.build(tpl, name)
    try:
        c = client()
        got = get_templates_template_id.sync(info.template_id, client=c)
        assert isinstance(got, TemplateWithBuilds), got
        assert got.template_id == info.template_id and got.names == [name] and got.public is False
        assert [str(b.build_id) for b in got.builds] == [info.build_id]
        assert got.builds[0].status.value == "ready" and got.builds[0].finished_at is not None

        listed = get_v2_templates.sync(client=c)
        assert isinstance(listed, list) and all(isinstance(t, TemplateModel) for t in listed), listed
        assert info.template_id in {t.template_id for t in listed}

        logs = get_templates_template_id_builds_build_id_logs.sync(info.template_id, info.build_id, client=c)
        assert isinstance(logs, TemplateBuildLogsResponse), logs
        assert any("routes-marker" in e.message for e in logs.logs), [e.message for e in logs.logs]
        back = get_templates_template_id_builds_build_id_logs.sync(
            info.template_id, info.build_id, client=c, direction=LogsDirection.BACKWARD, limit=1, level=LogLevel.INFO)
        assert len(back.logs) == 1 and back.logs[0].timestamp >= logs.logs[0].timestamp
        bad = httpx.get(f"{API}/templates/{info.template_id}/builds/{info.build_id}/logs?direction=up",
                        headers={"X-API-Key": KEY})
        assert bad.status_code == 400 and "direction" in bad.json()["message"], bad.text

        upd = patch_v_2_templates_template_id.sync(info.template_id, client=c, body=TemplateUpdateRequest(public=True))
        assert isinstance(upd, TemplateUpdateResponse) and upd.names == [name], upd
        if OTHER:
            o = client(OTHER)
            # Public: the other key starts it by its ID, and sees it exist;
            # its builds and logs stay the owner's.
            assert Template.exists(info.template_id, api_key=OTHER) is True
            sbx = Sandbox.create(info.template_id, api_key=OTHER)
            sbx.kill()
            r = get_templates_template_id_builds_build_id_logs.sync_detailed(info.template_id, info.build_id, client=o)
            assert r.status_code == 404, r
            assert info.template_id not in {t.template_id for t in get_v2_templates.sync(client=o)}
        patch_v_2_templates_template_id.sync(info.template_id, client=c, body=TemplateUpdateRequest(public=False))
        if OTHER:
            assert Template.exists(info.template_id, api_key=OTHER) is False
    finally:
        httpx.delete(f"{API}/templates/{info.template_id}", headers={"X-API-Key": KEY})


def test_teams():
    r = httpx.get(f"{API}/teams", headers={"X-API-Key": KEY})
    assert r.status_code == 200, r.text
    teams = r.json()
    assert len(teams) == 1 and teams[0]["apiKey"] == KEY and teams[0]["isDefault"] is True and teams[0]["teamID"]


def test_sandbox_logs(sandbox):
    sandbox.commands.run("echo sandbox-logs-marker")
    c = client()
    v2 = get_v_2_sandboxes_sandbox_id_logs.sync(sandbox.sandbox_id, client=c)
    assert isinstance(v2, SandboxLogsV2Response), v2
    msgs = [e.message for e in v2.logs]
    assert msgs[0].startswith("sandbox started from template"), msgs
    assert any("sandbox-logs-marker" in m and m.endswith("ended with exit code 0") for m in msgs), msgs
    v1 = get_sandboxes_sandbox_id_logs.sync(sandbox.sandbox_id, client=c)
    assert isinstance(v1, SandboxLogs) and len(v1.logs) == len(v1.log_entries) >= 2, v1
    if OTHER:
        r = get_v_2_sandboxes_sandbox_id_logs.sync(sandbox.sandbox_id, client=client(OTHER))
        assert isinstance(r, Error) and r.code == 404, r
