"""Template lookups with the unmodified E2B SDK: Template.exists (GET
/templates/aliases/{alias}) and the not-found errors of routes OpenDsec does
not serve yet."""

import os

import httpx

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import NotFoundException, SandboxException


def test_template_exists():
    assert Template.exists("base") is True
    assert Template.exists("code-interpreter-v1") is True
    assert Template.exists("no-such-template-xyz") is False


def test_unknown_template_names_only_the_gateways_templates():
    with pytest.raises(SandboxException) as ei:
        Sandbox.create("no-such-template-xyz")
    msg = str(ei.value)
    assert "no-such-template-xyz" in msg and "base" in msg
    assert "available:" not in msg and "`" not in msg


def test_unserved_sandbox_route_is_404_for_unknown_sandbox():
    url = os.environ["E2B_API_URL"].rstrip("/")
    r = httpx.get(f"{url}/sandboxes/n001aaaaaaaaaaaaaaaa/logs", headers={"X-API-Key": os.environ["E2B_API_KEY"]})
    assert r.status_code == 404 and r.json()["code"] == 404
    with pytest.raises(NotFoundException):
        Sandbox.connect("n001aaaaaaaaaaaaaaaa")
