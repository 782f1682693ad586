"""worker.runtimes.snapstore.stored: the snapshots whose manifest is in the store, each with when
it was stored and the installation that uploaded it (the control plane removes only its own
workers'); a manifest is read once, a damaged one is left out (never taken for garbage), and a
removed one leaves the cache."""

from __future__ import annotations

import os

from atoll.worker.host import objectstore
from atoll.worker.runtimes import snapstore


async def _put(store: objectstore.LocalStore, key: str, text: str, tmp) -> None:
    path = os.path.join(tmp, "upload")
    with open(path, "w") as f:
        f.write(text)
    await store.put_file(key, path)


def _manifest(snapshot_id: str, holder: str, at: float) -> str:
    return snapstore.SnapshotManifest(
        snapshot_id, snapstore.object_key(snapshot_id), 1, "0" * 64, True, {}, holder=holder, stored_at=at
    ).dumps()


async def test_stored_names_each_snapshots_uploader_and_skips_damaged_manifests(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "store"))
    work = str(tmp_path / "work")
    os.makedirs(work)
    a, b, bad = "snp-00000000000000aa", "snp-00000000000000bb", "snp-00000000000000cc"
    await _put(store, snapstore.manifest_key(a), _manifest(a, "inst-one", 10.0), work)
    await _put(store, snapstore.manifest_key(b), _manifest(b, "inst-two", 20.0), work)
    await _put(store, snapstore.manifest_key(bad), "{not json", work)
    await _put(store, snapstore.object_key(bad), "x", work)
    seen: dict[str, tuple[float, str]] = {}
    found = sorted(await snapstore.stored(store, work, seen))
    assert found == [(a, 10.0, "inst-one"), (b, 20.0, "inst-two")]
    assert set(seen) == {a, b}
    # cached: a manifest is read once (they never change once written)
    seen[a] = (10.0, "cached")
    assert (a, 10.0, "cached") in await snapstore.stored(store, work, seen)
    await snapstore.remove(store, a)
    assert sorted(await snapstore.stored(store, work, seen)) == [(b, 20.0, "inst-two")]
    assert set(seen) == {b}
    assert os.listdir(work) == ["upload"]  # no manifest download left behind


async def test_a_store_directory_that_fails_is_a_store_error_not_a_raw_oserror(tmp_path):
    """A directory store whose tree is broken under a key (a file where a directory should be, as
    on a damaged or wrongly mounted share) answers StoreUnavailable, which the worker turns into a
    clear 503: never a bare OSError (a 500 and a traceback in the worker's log)."""
    root = tmp_path / "store"
    store = objectstore.LocalStore(str(root))
    os.makedirs(root)
    (root / "layers").write_text("not a directory")
    src = tmp_path / "upload"
    src.write_text("x")
    for call in (
        lambda: store.size("layers/a/b.json"),
        lambda: store.put_file("layers/a/b.json", str(src)),
    ):
        try:
            await call()
        except objectstore.ObjectNotFound:
            raise AssertionError("a broken store is not an absent object") from None
        except objectstore.StoreUnavailable as e:
            assert str(root) in str(e)
        else:
            raise AssertionError("a broken store answered")


async def test_a_snapshot_the_store_cannot_give_names_no_host_path_to_the_caller(tmp_path):
    """409 snapshot_unavailable goes to the API caller (a tenant): its message says what is wrong
    with the snapshot, and the store's host path (or S3 endpoint) is only in `detail`, which is
    logged, never sent (docs/security-model.md, "Host details in errors")."""
    import pytest

    from atoll.core import errors

    root = tmp_path / "secret-store-path"
    store = objectstore.LocalStore(str(root))
    work = tmp_path / "work"
    os.makedirs(work)
    missing = "snp-00000000000000dd"
    with pytest.raises(errors.AtollError) as caught:
        await snapstore.read_manifest(store, missing, str(work))
    assert caught.value.code == "snapshot_unavailable"
    assert "secret-store-path" not in caught.value.message, caught.value.message
    assert "secret-store-path" in (caught.value.detail or "")
    other = "snp-00000000000000ee"
    await _put(store, snapstore.manifest_key(missing), _manifest(other, "inst", 1.0), str(work))
    with pytest.raises(errors.AtollError) as caught:
        await snapstore.read_manifest(store, missing, str(work))
    assert "names another snapshot" in caught.value.message
    assert "secret-store-path" not in caught.value.message, caught.value.message
