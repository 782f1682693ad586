"""The archive tier's object stores against real storage: a local directory and a real SeaweedFS
S3 gateway on loopback (atoll.testing.seaweed), both through the one ObjectStore interface."""

from __future__ import annotations

import os

import pytest

from atoll.testing.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS, free_ports
from atoll.worker.host import objectstore


@pytest.fixture(scope="module")
def seaweed():
    with SeaweedFS() as sw:
        yield sw


def _s3(sw: SeaweedFS, bucket: str | None = None) -> objectstore.S3Store:
    return objectstore.S3Store(objectstore.S3Config(sw.endpoint, bucket or sw.bucket, ACCESS_KEY, SECRET_KEY))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return objectstore.LocalStore(str(tmp_path / "archive"))
    return _s3(request.getfixturevalue("seaweed"))


def _file(path, size: int) -> str:
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    return str(path)


async def test_put_get_size_list_delete(store, tmp_path):
    # 21 MiB: above the 16 MiB multipart threshold, so S3 uploads it in parts of >= 5 MiB
    src = _file(tmp_path / "obj", 21 * 1024 * 1024 + 7)
    assert await store.put_file("sbx/one/image.tar.zst", src) == os.path.getsize(src)
    await store.put_file("sbx/two/manifest.json", _file(tmp_path / "m", 10))
    assert await store.size("sbx/one/image.tar.zst") == os.path.getsize(src)
    assert await store.list("sbx/one/") == ["sbx/one/image.tar.zst"]
    assert await store.list("sbx/") == ["sbx/one/image.tar.zst", "sbx/two/manifest.json"]
    dest = tmp_path / "back"
    assert await store.get_file("sbx/one/image.tar.zst", str(dest)) == os.path.getsize(src)
    assert dest.read_bytes() == open(src, "rb").read()
    await store.delete("sbx/one/image.tar.zst")
    await store.delete("sbx/one/image.tar.zst")  # absent: no error
    with pytest.raises(objectstore.ObjectNotFound):
        await store.size("sbx/one/image.tar.zst")
    with pytest.raises(objectstore.ObjectNotFound):
        await store.get_file("sbx/one/image.tar.zst", str(tmp_path / "none"))
    assert not (tmp_path / "none").exists()
    await store.delete("sbx/two/manifest.json")


async def test_bad_keys_are_refused(store, tmp_path):
    src = _file(tmp_path / "x", 1)
    for key in ("", "/abs", "a/../b", "a//b"):
        with pytest.raises(ValueError, match="object key"):
            await store.put_file(key, src)


async def test_local_put_is_atomic_and_leaves_no_temp(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "archive"))
    await store.put_file("k/v", _file(tmp_path / "a", 1000))
    assert os.listdir(tmp_path / "archive" / "k") == ["v"]
    # a temp file of a put cut short is never listed as an object
    (tmp_path / "archive" / "k" / "w.tmp-0123").write_bytes(b"half")
    assert await store.list("k/") == ["k/v"]


async def test_s3_existing_bucket_is_tolerated(seaweed, tmp_path):
    a, b = _s3(seaweed, "shared-bucket"), _s3(seaweed, "shared-bucket")
    await a.ensure_bucket()
    await b.ensure_bucket()  # created already (by us): BucketAlreadyOwnedByYou or a 200 is fine
    await b.put_file("x", _file(tmp_path / "x", 3))
    assert await a.size("x") == 3


async def test_s3_down_is_store_unavailable(tmp_path):
    (port,) = free_ports(1)  # nothing listens there
    store = objectstore.S3Store(
        objectstore.S3Config(f"http://127.0.0.1:{port}", "b", ACCESS_KEY, SECRET_KEY), connect_timeout=1
    )
    with pytest.raises(objectstore.StoreUnavailable, match="cannot be reached"):
        await store.put_file("k", _file(tmp_path / "k", 10))
    with pytest.raises(objectstore.StoreUnavailable):
        await store.size("k")


async def test_s3_wrong_secret_is_a_clear_error(seaweed, tmp_path):
    store = objectstore.S3Store(objectstore.S3Config(seaweed.endpoint, "atoll", ACCESS_KEY, "wrong"))
    with pytest.raises(objectstore.StoreError, match="refused"):
        await store.put_file("k", _file(tmp_path / "k", 10))


def test_settings_pick_the_store(tmp_path):
    local = objectstore.from_settings(str(tmp_path), None, None)
    assert isinstance(local, objectstore.LocalStore) and local.root == str(tmp_path / "archive")
    other = objectstore.from_settings(str(tmp_path), str(tmp_path / "elsewhere"), None)
    assert other.root == str(tmp_path / "elsewhere")
    s3 = objectstore.from_settings(
        str(tmp_path), None, objectstore.S3Config("http://127.0.0.1:1", "b", "a", "s")
    )
    assert isinstance(s3, objectstore.S3Store) and s3.cfg.region == "us-east-1"


async def test_a_local_store_drops_a_prefix_directory_with_its_last_object(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "archive"))
    src = tmp_path / "obj"
    src.write_bytes(b"x")
    for key in ("sandboxes/sb-1/a", "sandboxes/sb-1/b", "sandboxes/sb-2/a"):
        await store.put_file(key, str(src))
    await store.delete("sandboxes/sb-1/a")
    assert (tmp_path / "archive" / "sandboxes" / "sb-1").is_dir()  # b is still there
    await store.delete("sandboxes/sb-1/b")
    assert sorted(os.listdir(tmp_path / "archive" / "sandboxes")) == ["sb-2"]
    await store.delete("sandboxes/sb-2/a")
    assert os.path.isdir(tmp_path / "archive")  # the store's own root stays
