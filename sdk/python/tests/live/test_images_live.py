"""Live tests of client.images and Sandbox.pack_diff against a real system."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from live_helpers import IMAGE, run_args

from opendsec import ConfigError, DSecClient, InvalidArgumentError, NotFoundError

pytestmark = pytest.mark.live


async def test_pack_diff_compose_tag_gc(client: DSecClient) -> None:
    tag = uuid.uuid4().hex[:8]
    packed_name, env_name, stable = f"sdk-test/packed:{tag}", f"sdk-test/env:{tag}", f"sdk-test/env:{tag}-stable"
    base = await client.images.get(IMAGE)
    async with await client.run_sandbox(run_args(labels={"opendsec-sdk-test": "1"})) as sb:
        # pip-install-like changes, a file deleted from the image, a secret to scrub.
        r = await sb.run_shell(
            "mkdir -p /opt/site/pkg && echo 'VERSION = 1' > /opt/site/pkg/__init__.py && "
            "rm /bin/true && mkdir -p /root/.cache && echo tok > /root/.cache/secret && echo ok"
        )
        assert r.stdout == "ok\n", r.stderr
        packed = await sb.pack_diff(packed_name, scrub_paths=["/root/.cache"])
    assert packed.name == packed_name and len(packed.layers) == len(base.layers) + 1
    assert [layer.digest for layer in packed.layers[:-1]] == [layer.digest for layer in base.layers]

    check = (
        "cat /opt/site/pkg/__init__.py; test -e /bin/true && echo true-there; "
        "test -e /root/.cache/secret && echo secret; echo end"
    )

    async def run_one(image: str) -> str:
        async with await client.run_sandbox(run_args(image=image, labels={"opendsec-sdk-test": "1"})) as s:
            return (await s.run_shell(check)).stdout

    outs = await asyncio.gather(*(run_one(packed_name) for _ in range(3)))
    assert outs == ["VERSION = 1\nend\n"] * 3
    # The original image is unchanged.
    assert "true-there\n" in await run_one(IMAGE)

    # Compose the packed image's top layer onto the base again, by image name.
    env = await client.images.compose(IMAGE, [packed_name], env_name, env={"SDK_TEST": tag})
    assert [layer.digest for layer in env.layers] == [layer.digest for layer in packed.layers]
    assert f"SDK_TEST={tag}" in env.config.env
    assert (await client.images.tag(env_name, stable)).id == env.id
    names = {i.name for i in await client.images.list()}
    assert {packed_name, env_name, stable} <= names

    for n in (packed_name, env_name):
        await client.images.remove(n)
    gc = await client.images.gc()
    # stable still names the packed layer: gc must keep it.
    assert packed.layers[-1].digest not in gc.removed_layers
    assert "VERSION = 1\n" in await run_one(stable)
    await client.images.remove(stable)
    v = await client.images.verify()
    assert v.corrupt == {} and v.checked > 0


async def test_image_bad_input(client: DSecClient) -> None:
    with pytest.raises(NotFoundError, match="sdk-test/nope:v0"):
        await client.images.get("sdk-test/nope:v0")
    with pytest.raises(NotFoundError) as ei:
        await client.images.compose(IMAGE, ["sha256:" + "0" * 64], "sdk-test/x:v0")
    assert "layers[0].digest" in str(ei.value)
    with pytest.raises(ConfigError):
        await client.images.import_("")
    async with await client.run_sandbox(run_args(labels={"opendsec-sdk-test": "1"})) as sb:
        with pytest.raises(InvalidArgumentError) as bad:
            await sb.pack_diff("Not A Name")
        assert bad.value.field == "name"
        with pytest.raises(InvalidArgumentError) as bad:
            await sb.pack_diff("sdk-test/x:v0", scrub_paths=["relative/path"])
        assert bad.value.field == "scrub_paths[0]"
    with pytest.raises(NotFoundError):
        await client.images.pack_diff(sb.id, "sdk-test/x:v0")  # stopped and deleted
    assert "sdk-test/x:v0" not in {i.name for i in await client.images.list()}
