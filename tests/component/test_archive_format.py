"""The archive tier's format (worker.host.archive) against a real local store and a real SeaweedFS:
a snapshot directory and a sparse upper image go up and come back byte for byte, holes kept; a
flipped byte anywhere is caught before anything is unpacked into place."""

from __future__ import annotations

import os

import pytest

from atoll.testing.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS
from atoll.worker.host import archive, objectstore


@pytest.fixture(scope="module")
def seaweed():
    with SeaweedFS() as sw:
        yield sw


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return objectstore.LocalStore(str(tmp_path / "archive"))
    sw = request.getfixturevalue("seaweed")
    return objectstore.S3Store(objectstore.S3Config(sw.endpoint, sw.bucket, ACCESS_KEY, SECRET_KEY))


def _sandbox(d, image_mb: int = 6) -> dict[str, bytes]:
    """A sandbox directory as a checkpoint leaves it: snapshot/ and a 256 MiB sparse upper.img."""
    os.makedirs(d / "snapshot")
    files = {
        "snapshot/checkpoint.img": os.urandom(image_mb * 1024 * 1024),
        "snapshot/manifest.json": b'{"image": "checkpoint.img"}',
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    with open(d / "upper.img", "wb") as f:
        f.truncate(256 * 1024 * 1024)
        for off in (0, 1024 * 1024, 200 * 1024 * 1024):
            f.seek(off)
            f.write(os.urandom(64 * 1024))
    return files


def _man(sid: str = "sbx-a", generation: int = 3) -> archive.ArchiveManifest:
    return archive.ArchiveManifest(
        sid, generation, archive.object_key(sid, generation), 0, "", runsc="r", runtime_key="k", template="t"
    )


async def test_round_trip_keeps_bytes_and_holes(store, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = _sandbox(src)
    man = await archive.upload(store, str(src), _man())
    assert await store.list("sandboxes/sbx-a/") == [
        "sandboxes/sbx-a/3.tar.zst",
        "sandboxes/sbx-a/manifest.json",
    ]
    assert man.upper_size == 256 * 1024 * 1024 and man.members["upper.img.data"]["size"] < 1024 * 1024
    assert archive.local_manifest(str(src)) == man
    assert not (src / archive.PACKING).exists()
    # another worker: no local manifest, the store's
    os.makedirs(dst)
    fetched = await archive.fetch_manifest(store, "sbx-a", str(dst))
    assert fetched == man
    await archive.download(store, str(dst), fetched)
    for name, data in files.items():
        assert (dst / name).read_bytes() == data
    assert (dst / "upper.img").read_bytes() == (src / "upper.img").read_bytes()
    assert os.stat(dst / "upper.img").st_blocks * 512 < 2 * 1024 * 1024  # still sparse
    assert sorted(os.listdir(dst)) == ["snapshot", "upper.img"]
    assert await archive.remove(store, "sbx-a") == 2
    assert await store.list("sandboxes/sbx-a/") == []
    with pytest.raises(archive.ArchiveMissing, match="no archive"):
        await archive.fetch_manifest(store, "sbx-a", str(dst))


async def test_a_later_archive_replaces_the_earlier_object(store, tmp_path):
    _sandbox(tmp_path)
    await archive.upload(store, str(tmp_path), _man(generation=1))
    await archive.upload(store, str(tmp_path), _man(generation=2))
    assert await store.list("sandboxes/sbx-a/") == [
        "sandboxes/sbx-a/2.tar.zst",
        "sandboxes/sbx-a/manifest.json",
    ]


async def test_corrupted_object_is_refused_as_such_and_nothing_moves_into_place(tmp_path):
    # the object's sha256 is checked while it is unpacked: the flipped byte breaks the unpacking
    # (zstd, tar or a member's sha256) too, and the object's own verdict is the one reported
    store = objectstore.LocalStore(str(tmp_path / "archive"))
    src, dst = tmp_path / "src", tmp_path / "dst"
    _sandbox(src)
    man = await archive.upload(store, str(src), _man())
    obj = tmp_path / "archive" / man.key
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    os.makedirs(dst / "snapshot")
    (dst / "snapshot" / "old").write_bytes(b"kept")
    with pytest.raises(archive.ArchiveDamaged, match="is damaged.*sha256"):
        await archive.download(store, str(dst), man)
    assert os.listdir(dst / "snapshot") == ["old"]  # nothing moved into place
    assert sorted(os.listdir(dst)) == ["snapshot"]  # and nothing left behind


async def test_a_member_that_does_not_match_is_refused(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "archive"))
    _sandbox(tmp_path / "src")
    man = await archive.upload(store, str(tmp_path / "src"), _man())
    man.members["snapshot/checkpoint.img"]["sha256"] = "0" * 64  # the object is fine, a member is not
    os.makedirs(tmp_path / "dst")
    with pytest.raises(archive.ArchiveDamaged, match="checkpoint.img"):
        await archive.download(store, str(tmp_path / "dst"), man)
    assert os.listdir(tmp_path / "dst") == []


async def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(archive.ArchiveDamaged, match="format"):
        archive.ArchiveManifest.loads('{"format": 99}')


async def test_store_down_keeps_the_local_copy(tmp_path):
    from atoll.testing.seaweed import free_ports

    (port,) = free_ports(1)
    store = objectstore.S3Store(
        objectstore.S3Config(f"http://127.0.0.1:{port}", "b", ACCESS_KEY, SECRET_KEY), connect_timeout=1
    )
    files = _sandbox(tmp_path)
    with pytest.raises(objectstore.StoreUnavailable):
        await archive.upload(store, str(tmp_path), _man())
    assert sorted(os.listdir(tmp_path)) == ["snapshot", "upper.img"]
    assert (tmp_path / "snapshot" / "checkpoint.img").read_bytes() == files["snapshot/checkpoint.img"]


def test_drop_leftovers_removes_cut_short_transfers_only(tmp_path):
    for name in (
        "archive.in.tar.zst.tmp-0a1b2c",
        "archive.out.tar.zst",
        "archive.json.new",
        "runtime.json",
        "upper.img",
    ):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "archive.unpack").mkdir()
    (tmp_path / "archive.unpack" / "upper.img").write_bytes(b"x")
    dropped = archive.drop_leftovers(str(tmp_path))
    assert len(dropped) == 4
    assert sorted(os.listdir(tmp_path)) == ["runtime.json", "upper.img"]
