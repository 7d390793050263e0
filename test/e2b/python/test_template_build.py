"""Template builds with the unmodified E2B SDK: Template()...build() through
POST /v3/templates, the files-hash upload, POST /v2/templates/{id}/builds/{id}
and the build status, run by OpenDsec's native builder; then sandboxes of the
template, Template.exists and tags."""

import os
import uuid

import httpx
import pytest
from e2b import Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException

API = os.environ["E2B_API_URL"].rstrip("/")
KEY = os.environ["E2B_API_KEY"]


def _delete(template_id):
    httpx.delete(f"{API}/templates/{template_id}", headers={"X-API-Key": KEY})


@pytest.fixture
def context_dir(tmp_path):
    (tmp_path / "hello.txt").write_text("hello from the build context\n")
    return tmp_path


def test_template_build_and_start(context_dir):
    name = "sdk-tpl-" + uuid.uuid4().hex[:8]
    logs = []
    tpl = (
        Template(file_context_path=str(context_dir))
        .from_template("base")
        .run_cmd("mkdir -p /opt/app && chown user /opt/app && echo built-marker", user="root")
        .copy("hello.txt", "/opt/app/hello.txt")
        .set_envs({"GREETING": "hi there", "QUOTED": 'a "b" $c'})
        .set_workdir("/opt/app")
        .run_cmd("pwd > where.txt && echo $GREETING > env.txt")
    )
    info = Template.build(tpl, name, on_build_logs=logs.append)
    try:
        text = "\n".join(e.message for e in logs)
        assert "built-marker" in text, text
        assert Template.exists(name) is True
        assert Template.exists(name + "-nope") is False
        other = os.environ.get("E2B_TEST_OTHER_KEY")
        if other:
            # Another principal sees neither the name nor the build.
            assert Template.exists(name, api_key=other) is False
            r = httpx.get(f"{API}/templates/{info.template_id}/builds/{info.build_id}/status",
                          headers={"X-API-Key": other})
            assert r.status_code == 404, r.text

        sbx = Sandbox.create(name)
        try:
            assert sbx.files.read("/opt/app/hello.txt") == "hello from the build context\n"
            assert sbx.files.read("/opt/app/where.txt") == "/opt/app\n"
            assert sbx.files.read("/opt/app/env.txt") == "hi there\n"
            assert sbx.commands.run("pwd").stdout == "/opt/app\n"
            assert sbx.commands.run("echo $GREETING").stdout == "hi there\n"
            assert sbx.commands.run('echo "$QUOTED"').stdout == 'a "b" $c\n'
            assert sbx.commands.run("id -un").stdout == "user\n"
        finally:
            sbx.kill()

        # Tags: a second name for the build, started by name:tag.
        tagged = Template.assign_tags(f"{name}:default", ["v1"])
        assert tagged.build_id == info.build_id and tagged.tags == ["v1"]
        assert {t.tag for t in Template.get_tags(name)} == {"default", "v1"}
        sbx = Sandbox.create(f"{name}:v1")
        sbx.kill()
        Template.remove_tags(name, "v1")
        assert {t.tag for t in Template.get_tags(name)} == {"default"}

        # A rebuild of the same steps comes from the build cache.
        logs.clear()
        Template.build(tpl, name, on_build_logs=logs.append)
        assert "CACHED" in "\n".join(e.message for e in logs)
    finally:
        _delete(info.template_id)
    assert Template.exists(name) is False


def test_template_start_cmd(context_dir):
    # E2B runs the start command when it builds the template and snapshots
    # the running sandbox; OpenDsec runs it in each sandbox of the template
    # and waits for the ready command before the create returns.
    name = "sdk-start-" + uuid.uuid4().hex[:8]
    tpl = (
        Template(file_context_path=str(context_dir))
        .from_template("base")
        .copy("hello.txt", "/home/user/site/index.html")
        .set_workdir("/home/user/site")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )
    info = Template.build(tpl, name)
    try:
        sbx = Sandbox.create(name)
        try:
            # Ready before create returned: no retry needed.
            r = sbx.commands.run("curl -sf http://127.0.0.1:8000/index.html")
            assert r.stdout == "hello from the build context\n", (r.stdout, r.stderr)
        finally:
            sbx.kill()
    finally:
        _delete(info.template_id)


def test_template_build_failing_step():
    name = "sdk-fail-" + uuid.uuid4().hex[:8]
    logs = []
    tpl = Template().from_template("base").run_cmd("echo ok").run_cmd("echo about-to-fail; exit 3")
    with pytest.raises(BuildException) as ei:
        Template.build(tpl, name, on_build_logs=logs.append)
    msg = str(ei.value)
    assert "step 2" in msg and "exit" in msg, msg
    assert "about-to-fail" in "\n".join(e.message for e in logs)
    # Nothing was made: the name starts nothing.
    assert Template.exists(name) is False


def test_template_build_refuses_unknown_base():
    name = "sdk-nobase-" + uuid.uuid4().hex[:8]
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_image("no-such-registry.example/nothing:1").run_cmd("true"), name)
    assert "not in OpenDsec's image store" in str(ei.value)
