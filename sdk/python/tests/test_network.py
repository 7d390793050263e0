"""Unit tests of the network policy forms, against the in-process fake server."""

from __future__ import annotations

from typing import Any

import pytest
from fake_server import FakeServer

from opendsec import (
    ConfigError,
    DSecClient,
    DSecRunArgs,
    InvalidArgumentError,
    NetworkPolicy,
    NetworkRule,
)
from opendsec._gen.opendsec.v1 import sandbox_pb2 as pb


def _rules(p: pb.NetworkPolicy) -> list[tuple[str, str, str, str]]:
    return [(r.cidr, r.domain, r.protocol, r.ports) for r in p.allow]


async def test_create_sends_the_papers_rule_set_form(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox", network={"pypi": True, "npm": False}))
    spec = server.create_requests[0].spec
    assert spec.HasField("network")
    assert list(spec.network.rule_sets) == ["pypi"]
    assert list(spec.network.allow) == []
    assert sb.info.spec.network == NetworkPolicy(rule_sets=("pypi",))


async def test_create_sends_explicit_rules_mixed_with_rule_sets(client: DSecClient, server: FakeServer) -> None:
    net: list[Any] = [
        NetworkRule(cidr="10.0.0.0/8", protocol="tcp", ports=443),
        {"domain": "*.pythonhosted.org", "ports": "8000-8100"},
        "npm",
    ]
    await client.run_sandbox(DSecRunArgs(image="root/busybox", network=net))
    got = server.create_requests[0].spec.network
    assert list(got.rule_sets) == ["npm"]
    assert _rules(got) == [("10.0.0.0/8", "", "tcp", "443"), ("", "*.pythonhosted.org", "", "8000-8100")]


async def test_create_without_network_leaves_it_unset(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    assert not server.create_requests[0].spec.HasField("network")
    assert sb.info.spec.network is None


async def test_create_with_empty_mapping_sends_a_deny_all_policy(client: DSecClient, server: FakeServer) -> None:
    await client.run_sandbox(DSecRunArgs(image="root/busybox", network={"pypi": False}))
    spec = server.create_requests[0].spec
    assert spec.HasField("network")
    assert list(spec.network.rule_sets) == [] and list(spec.network.allow) == []


def test_a_single_rule_dict_is_one_rule() -> None:
    p = NetworkPolicy.parse({"cidr": "192.0.2.7", "protocol": "icmp"})
    assert p == NetworkPolicy(allow=(NetworkRule(cidr="192.0.2.7", protocol="icmp"),))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"pypi": "yes"}, r"network: a mapping must map rule-set names to True/False"),
        ([{"cidr": "10.0.0.0/8", "port": 443}], r"network\[0\]: unknown rule keys \['port'\]"),
        ([{"domain": "pypi.org", "ports": [443]}], r"network\[0\]\.ports: must be a port or range"),
        ([42], r"network\[0\]: must be a rule-set name"),
        ("pypi", r"network: must be a NetworkPolicy"),
    ],
)
async def test_bad_shapes_are_refused_before_sending(
    client: DSecClient, server: FakeServer, value: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        await client.run_sandbox(DSecRunArgs(image="root/busybox", network=value))
    assert server.create_requests == []


async def test_set_network_replaces_the_policy(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    info = await sb.set_network({"pypi": True, "npm": True})
    req = server.set_networks[0]
    assert req.id == sb.id
    assert list(req.network.rule_sets) == ["pypi", "npm"]
    assert info.spec.network == NetworkPolicy(rule_sets=("pypi", "npm"))
    assert sb.info is info

    await sb.set_network([{"cidr": "10.1.2.0/24", "ports": "22"}])
    assert _rules(server.set_networks[1].network) == [("10.1.2.0/24", "", "", "22")]
    assert list(server.set_networks[1].network.rule_sets) == []


async def test_set_network_none_denies_everything(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox", network={"pypi": True}))
    info = await sb.set_network(None)
    assert server.set_networks[0].HasField("network")
    assert info.spec.network == NetworkPolicy()


async def test_set_network_bad_rule_names_the_field(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox", network={"pypi": True}))
    with pytest.raises(InvalidArgumentError) as ei:
        await sb.set_network([{"cidr": "10.0.0.0/8"}, NetworkRule(cidr="bad")])
    assert ei.value.field == "network.allow[1].cidr"
    assert sb.info.spec.network == NetworkPolicy(rule_sets=("pypi",))


async def test_set_network_bad_shape_sends_nothing(client: DSecClient, server: FakeServer) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox"))
    with pytest.raises(ConfigError, match="network"):
        await sb.set_network({"pypi": 1})
    assert server.set_networks == []
