"""worker.images.layerpack: a layer published to a (local-directory) object store and fetched by
another layer cache comes back byte for byte — owners, modes, symlinks, hard links, the
overlay's whiteouts and opaque marks — under its own instance, never replaced by a separately
made layer of the same key; a damaged object is refused."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess

import pytest

from atoll.worker.host import objectstore
from atoll.worker.images import layerpack
from atoll.worker.images.layers import LayerStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and owners need root")


def _make(store: LayerStore, key: str) -> str:
    async def go() -> str:
        async with store.making(key) as fs:
            assert fs is not None
            os.makedirs(os.path.join(fs, "etc/opaque"))
            os.setxattr(os.path.join(fs, "etc/opaque"), "trusted.overlay.opaque", b"y")
            with open(os.path.join(fs, "etc/conf"), "w") as f:
                f.write("conf\n")
            os.chown(os.path.join(fs, "etc/conf"), 1234, 5678)
            os.chmod(os.path.join(fs, "etc/conf"), 0o4750)
            os.link(os.path.join(fs, "etc/conf"), os.path.join(fs, "etc/conf.link"))
            os.symlink("/etc/conf", os.path.join(fs, "etc/sym"))
            os.mknod(os.path.join(fs, "etc/gone"), stat.S_IFCHR | 0o000, os.makedev(0, 0))
            with open(os.path.join(fs, "big"), "wb") as f:
                f.write(os.urandom(3 << 20))
            store.commit(key, fs, "test")
        return store.path(key)

    return asyncio.run(go())


def _tree(fs: str) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(fs):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, fs)
            entry = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_nlink)
            if stat.S_ISREG(st.st_mode):
                entry += (open(p, "rb").read(),)
            elif stat.S_ISLNK(st.st_mode):
                entry += (os.readlink(p),)
            elif stat.S_ISCHR(st.st_mode):
                entry += (st.st_rdev,)
            else:
                entry += (os.getxattr(p, "trusted.overlay.opaque") if "opaque" in n else b"",)
            out[rel] = entry
    return out


def test_a_published_layer_comes_back_whole_under_its_instance(tmp_path):
    here, there = LayerStore(str(tmp_path / "a")), LayerStore(str(tmp_path / "b"))
    store = objectstore.LocalStore(str(tmp_path / "store"))
    fs = _make(here, "k1")
    refs = layerpack.refs_of(fs)
    assert refs is not None and refs[0]["key"] == "k1"
    instance = refs[0]["instance"]
    assert asyncio.run(layerpack.publish(store, refs, str(tmp_path))) == 1
    assert asyncio.run(layerpack.publish(store, refs, str(tmp_path))) == 0  # already there
    # the other cache made "k1" itself: other bytes, another instance -> never used in its place
    mine = _make(there, "k1")
    with open(os.path.join(mine, "etc/conf"), "w") as f:
        f.write("built separately\n")
    got = asyncio.run(layerpack.fetch(store, there, refs[0]))
    assert got != mine and got.endswith(f"k1@{instance}/fs")
    assert _tree(got) == _tree(fs)
    assert layerpack.refs_of(got)[0]["instance"] == instance  # and it can be published on from here
    assert asyncio.run(layerpack.fetch(store, there, refs[0])) == got  # cached
    assert asyncio.run(layerpack.fetch(store, here, refs[0])) == fs  # the maker uses its own


def test_archives_published_at_once_upload_a_shared_layer_once(tmp_path):
    """A drain archives several sandboxes of one template at once: their publications of the same
    layer must not race (they shared a staging file, and one's size check saw the other's)."""
    here = LayerStore(str(tmp_path / "a"))
    store = objectstore.LocalStore(str(tmp_path / "store"))
    refs = layerpack.refs_of(_make(here, "k1"))

    async def many() -> list[int]:
        return await asyncio.gather(*(layerpack.publish(store, refs, str(tmp_path)) for _ in range(4)))

    assert sorted(asyncio.run(many())) == [0, 0, 0, 1]
    there = LayerStore(str(tmp_path / "b"))
    assert _tree(asyncio.run(layerpack.fetch(store, there, refs[0]))) == _tree(here.path("k1"))


def test_a_layer_made_before_instances_gets_one_and_keeps_it(tmp_path):
    here = LayerStore(str(tmp_path / "a"))
    fs = _make(here, "old")
    meta_path = os.path.join(os.path.dirname(fs), "layer.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["instance"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    first = layerpack.refs_of(fs)[0]["instance"]
    assert layerpack.refs_of(fs)[0]["instance"] == first


def test_a_damaged_or_missing_layer_is_refused(tmp_path):
    here, there = LayerStore(str(tmp_path / "a")), LayerStore(str(tmp_path / "b"))
    store = objectstore.LocalStore(str(tmp_path / "store"))
    refs = layerpack.refs_of(_make(here, "k2"))
    asyncio.run(layerpack.publish(store, refs, str(tmp_path)))
    obj = os.path.join(store.root, layerpack.object_key("k2", refs[0]["instance"]))
    with open(obj, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    with pytest.raises(layerpack.LayerUnavailable, match="checksum"):
        asyncio.run(layerpack.fetch(store, there, refs[0]))
    assert not there.exists(f"k2@{refs[0]['instance']}")  # nothing half-made stays
    with pytest.raises(layerpack.LayerUnavailable, match="not in"):
        asyncio.run(layerpack.fetch(store, there, {"key": "k2", "instance": "0" * 32}))
    with pytest.raises(layerpack.LayerUnavailable, match="malformed"):
        asyncio.run(layerpack.fetch(store, there, {"key": "../x", "instance": "0" * 32}))


def test_a_stack_not_made_of_layers_has_no_refs(tmp_path):
    os.makedirs(tmp_path / "rootfs")
    assert layerpack.refs_of(str(tmp_path / "rootfs")) is None
    assert subprocess.run(["tar", "--version"], capture_output=True).returncode == 0
