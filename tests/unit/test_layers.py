"""The layer cache's host-side writes never follow what a build or an image made: a symlinked
/etc (a build step's `ln -s /x /etc`, or an OCI image's) is refused before anything is written,
and the identity files are removed only inside the layer."""

from __future__ import annotations

import asyncio
import os

import pytest

from atoll.worker.images import layers
from tests.unit.test_ociarchive import d, docker_save, f, layer, sym


def test_a_step_that_symlinks_etc_out_is_refused_and_the_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("hosts", "hostname", "resolv.conf"):
        (victim / name).write_text("host's own\n")
    upper = tmp_path / "upper"
    upper.mkdir()
    os.symlink(str(victim), upper / "etc")
    store = layers.LayerStore(str(tmp_path / "templates"))

    async def run():
        async with store.making("k1") as fs:
            assert fs is not None
            await store.from_upper(fs, str(upper))

    with pytest.raises(layers.BadLayer, match="/etc is a symlink"):
        asyncio.run(run())
    assert sorted(os.listdir(victim)) == ["hostname", "hosts", "resolv.conf"]
    assert not store.exists("k1")


def test_identity_files_are_dropped_from_a_step_layer(tmp_path):
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    for name in ("hosts", "hostname", "resolv.conf", "motd"):
        (upper / "etc" / name).write_text("x")
    store = layers.LayerStore(str(tmp_path / "templates"))

    async def run():
        async with store.making("k2") as fs:
            await store.from_upper(fs, str(upper))
            store.commit("k2", fs, "RUN x")

    asyncio.run(run())
    assert os.listdir(os.path.join(store.path("k2"), "etc")) == ["motd"]


@pytest.mark.parametrize("link", ["etc", "usr", "opt"])
def test_an_image_whose_system_dirs_are_symlinks_is_refused_before_any_write(tmp_path, link):
    victim = tmp_path / "victim"
    victim.mkdir()
    entries = [d("bin"), f("bin/true", b"x", 0o755), sym(link, str(victim))]
    if link != "usr":
        entries += [d("usr"), d("usr/bin"), f("usr/bin/python3", b"x", 0o755)]
    archive = docker_save(tmp_path / "img.tar", [layer(*entries)])
    store = layers.LayerStore(str(tmp_path / "templates"))
    with pytest.raises(layers.BadLayer, match=f"/{link}"):
        asyncio.run(store.bottom_from_archive(archive, lambda line: None))
    assert os.listdir(victim) == []
