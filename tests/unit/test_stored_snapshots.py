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
