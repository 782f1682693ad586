"""Garbage collection of the archive tier (worker.runtimes.archive_gc, worker.host.archive.remove and
drop_orphans) against a real local store (and SeaweedFS for the ownership rules): a worker deletes
only what its own records name — never another worker's newer manifest or objects in a shared
store; a removal the store refuses is journaled durably and done once the store is back; objects
an upload cut short are removed for the sandboxes this worker holds; transfer leftovers go at start."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from atoll.core import ids
from atoll.core.lifecycle import Phase
from atoll.testing.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS
from atoll.worker.host import archive, objectstore
from atoll.worker.runtimes import archive_gc
from atoll.worker.runtimes.archiving import Archiver
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore


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


async def _put(store, tmp_path, key: str, data: bytes = b"x") -> None:
    src = tmp_path / "obj"
    src.write_bytes(data)
    await store.put_file(key, str(src))


async def _archive(store, tmp_path, sid: str, generation: int, holder: str = "") -> str:
    """An archive of `sid` as a worker's upload leaves it: object, then the manifest naming it."""
    key = archive.object_key(sid, generation)
    await _put(store, tmp_path, key, b"object of generation %d" % generation)
    man = archive.ArchiveManifest(sid, generation, key, 1, "0" * 64, holder=holder)
    man_file = tmp_path / "manifest.json"
    man_file.write_text(man.dumps())
    await store.put_file(archive.manifest_key(sid), str(man_file))
    return key


async def _keys(store, sid: str) -> list[str]:
    return await store.list(archive.prefix(sid))


async def test_remove_deletes_only_what_the_caller_owns(store, tmp_path):
    sid = ids.new_sandbox_id()
    mine = await _archive(store, tmp_path, sid, 3)
    # another worker adopted the sandbox since and archived it anew: a newer manifest, its object
    theirs = await _archive(store, tmp_path, sid, 5)
    await _put(store, tmp_path, archive.object_key(sid, 6))  # an upload of theirs in progress
    assert await archive.remove(store, sid, mine) == 1  # my object only: the manifest is theirs
    assert await _keys(store, sid) == [theirs, archive.object_key(sid, 6), archive.manifest_key(sid)]
    assert (await archive.fetch_manifest(store, sid, str(tmp_path))).key == theirs
    # their removal (they own the manifest now) takes both, and what an upload of theirs left
    assert await archive.remove(store, sid, theirs) == 3
    assert await _keys(store, sid) == []
    assert await archive.remove(store, sid, theirs) == 0
    with pytest.raises(ValueError, match="not an archive object"):
        await archive.remove(store, sid, archive.manifest_key(sid))
    with pytest.raises(ValueError, match="not an archive object"):
        await archive.remove(store, sid, archive.object_key(ids.new_sandbox_id(), 1))


async def test_an_archive_another_worker_adopted_is_left_to_it(store, tmp_path):
    """Worker A archived the sandbox; it was lost and B adopted it (claimed the manifest) without
    archiving anew: the same object, now B's. A, back with its stale record, removes nothing."""
    sid = ids.new_sandbox_id()
    key = await _archive(store, tmp_path, sid, 2, holder="install-a")
    d = tmp_path / "b-sandbox"
    d.mkdir()
    man = await archive.fetch_manifest(store, sid, str(tmp_path))
    claimed = await archive.claim(store, str(d), man, "install-b")
    assert claimed.holder == "install-b" and archive.local_manifest(str(d)) == claimed
    assert (await archive.fetch_manifest(store, sid, str(tmp_path))).holder == "install-b"
    assert sorted(os.listdir(d)) == [archive.LOCAL_MANIFEST]
    await _put(store, tmp_path, archive.object_key(sid, 3))  # B's upload of a new archive, under way
    assert await archive.drop_orphans(store, sid, key, "install-a") == []
    assert await archive.remove(store, sid, key, "install-a") == 0
    assert len(await _keys(store, sid)) == 3
    # B's own removal (its resume) takes all of it
    assert await archive.remove(store, sid, key, "install-b") == 3
    assert await _keys(store, sid) == []


async def test_orphans_go_only_when_the_manifest_is_the_callers(store, tmp_path):
    sid, other = ids.new_sandbox_id(), ids.new_sandbox_id()
    key = await _archive(store, tmp_path, sid, 4)
    cut_short = archive.object_key(sid, 9)  # an upload cut short before its manifest
    await _put(store, tmp_path, cut_short)
    foreign = await _archive(store, tmp_path, other, 1)
    # a caller whose manifest is not the store's (the sandbox moved on): nothing goes
    assert await archive.drop_orphans(store, sid, archive.object_key(sid, 2)) == []
    assert cut_short in await _keys(store, sid)
    assert await archive.drop_orphans(store, sid, key) == [cut_short]
    assert await _keys(store, sid) == [key, archive.manifest_key(sid)]
    assert await _keys(store, other) == [foreign, archive.manifest_key(other)]  # never looked at
    # no manifest at all (an upload cut short before any): nothing can be told, nothing goes
    lone = ids.new_sandbox_id()
    await _put(store, tmp_path, archive.object_key(lone, 1))
    assert await archive.drop_orphans(store, lone, archive.object_key(lone, 1)) == []


def _runtimes(tmp_path) -> RuntimeStore:
    return RuntimeStore(str(tmp_path / "home"), "abc123")


def _rt(runtimes: RuntimeStore, phase: Phase, archive_key: str = "", sid: str | None = None) -> Runtime:
    rt = runtimes.new(sid or ids.new_sandbox_id(), template="base", memory_mb=256, cpus=1, env={}, disk_mb=0)
    rt.phase, rt.archive_key = phase, archive_key
    runtimes.save(rt)
    return rt


class _Locks:
    def __init__(self) -> None:
        self.locks: dict[str, asyncio.Lock] = {}

    def __call__(self, sid: str) -> asyncio.Lock:
        return self.locks.setdefault(sid, asyncio.Lock())


def _down(store: objectstore.LocalStore) -> str:
    """The archive directory unusable (a shared mount gone): its path is a file meanwhile."""
    aside = store.root + ".aside"
    os.rename(store.root, aside)
    with open(store.root, "w") as f:
        f.write("not a directory")
    return aside


def _up(store: objectstore.LocalStore, aside: str) -> None:
    os.unlink(store.root)
    os.rename(aside, store.root)


async def test_a_refused_removal_is_journaled_and_done_when_the_store_is_back(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "archive"))
    runtimes = _runtimes(tmp_path)
    archiver = Archiver(runtimes, store)
    journal = tmp_path / "home" / archive_gc.JOURNAL
    assert archiver.pending.path == str(journal)
    sid = ids.new_sandbox_id()
    key = await _archive(store, tmp_path, sid, 2)

    aside = _down(store)
    assert await archiver.remove(sid, key) is False  # the delete of a sandbox: the store is down
    assert json.loads(journal.read_text()) == [[sid, key]]
    collector = archive_gc.ArchiveCollector(runtimes, archiver, _Locks())
    assert await collector.retry() == 1  # still down: still owed
    # a worker restarted meanwhile reads the same journal
    assert Archiver(runtimes, store).pending.entries() == [(sid, key)]

    _up(store, aside)
    locks = _Locks()
    collector = archive_gc.ArchiveCollector(runtimes, archiver, locks)
    async with locks(sid):  # a step of that sandbox in progress: left for the next pass
        assert await collector.retry() == 1
    assert await collector.retry() == 0
    assert await _keys(store, sid) == []
    assert not journal.exists()


async def test_a_pending_removal_of_a_key_archived_anew_is_dropped_not_done(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "archive"))
    runtimes = _runtimes(tmp_path)
    archiver = Archiver(runtimes, store)
    rt = _rt(runtimes, Phase.ARCHIVED)
    rt.archive_key = await _archive(store, tmp_path, rt.sandbox_id, rt.generation)
    runtimes.save(rt)
    archiver.pending.add(rt.sandbox_id, rt.archive_key)  # owed from before the same generation's new archive
    assert await archive_gc.ArchiveCollector(runtimes, archiver, _Locks()).retry() == 0
    assert await _keys(store, rt.sandbox_id) == [rt.archive_key, archive.manifest_key(rt.sandbox_id)]


async def test_sweep_removes_orphans_and_stale_archives_of_held_sandboxes_only(tmp_path):
    store = objectstore.LocalStore(str(tmp_path / "archive"))
    runtimes = _runtimes(tmp_path)
    archiver = Archiver(runtimes, store)
    archived = _rt(runtimes, Phase.ARCHIVED)
    archived.archive_key = await _archive(store, tmp_path, archived.sandbox_id, 1)
    runtimes.save(archived)
    cut_short = archive.object_key(archived.sandbox_id, 7)
    await _put(store, tmp_path, cut_short)
    # on disk again with its archive left (an aborted archive, or a removal that failed)
    back = _rt(runtimes, Phase.CHECKPOINTED)
    stale = back.archive_key = await _archive(store, tmp_path, back.sandbox_id, 3)
    runtimes.save(back)
    # running again with its archive kept on purpose (`on_worker_lost: "restore"`)
    kept = _rt(runtimes, Phase.RUNNING)
    kept.archive_key = await _archive(store, tmp_path, kept.sandbox_id, 2)
    kept.archive_kept = True
    runtimes.save(kept)
    failed = _rt(runtimes, Phase.FAILED)  # keeps its archive until its delete
    failed.archive_key = await _archive(store, tmp_path, failed.sandbox_id, 1)
    runtimes.save(failed)
    foreign = ids.new_sandbox_id()  # another worker's, in the shared store
    await _archive(store, tmp_path, foreign, 1)
    await _put(store, tmp_path, archive.object_key(foreign, 2))

    removed = await archive_gc.ArchiveCollector(runtimes, archiver, _Locks()).sweep()
    assert sorted(removed) == sorted([cut_short, stale])
    assert await _keys(store, archived.sandbox_id) == [
        archived.archive_key,
        archive.manifest_key(archived.sandbox_id),
    ]
    assert await _keys(store, back.sandbox_id) == []
    assert runtimes.load(back.sandbox_id).archive_key == ""  # recorded: never tried again
    assert len(await _keys(store, failed.sandbox_id)) == 2
    assert len(await _keys(store, foreign)) == 3
    assert len(await _keys(store, kept.sandbox_id)) == 2
    assert runtimes.load(kept.sandbox_id).archive_key == kept.archive_key
    # its delete removes it (the manifest names this worker's object)
    assert await archiver.remove(kept.sandbox_id, kept.archive_key)
    assert await _keys(store, kept.sandbox_id) == []


def test_unreadable_journal_is_kept_aside_not_overwritten(tmp_path):
    path = tmp_path / archive_gc.JOURNAL
    path.write_text("[[not json")
    pending = archive_gc.PendingRemovals(str(path))
    assert pending.entries() == []
    assert not path.exists()
    aside = [n for n in os.listdir(tmp_path) if n.startswith(archive_gc.JOURNAL + ".unreadable-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_text() == "[[not json"
    pending.add("sb-x", "sandboxes/sb-x/1.tar.zst")
    pending.add("sb-x", "sandboxes/sb-x/1.tar.zst")
    assert pending.entries() == [("sb-x", "sandboxes/sb-x/1.tar.zst")]


def test_local_leftovers_go_unless_a_transfer_may_be_in_progress(tmp_path):
    runtimes = _runtimes(tmp_path)
    for phase, kept in ((Phase.CHECKPOINTED, False), (Phase.RUNNING, False), (Phase.ARCHIVED, True)):
        rt = _rt(runtimes, phase)
        d = runtimes.dir(rt.sandbox_id)
        os.makedirs(os.path.join(d, archive.UNPACKING, "snapshot"))
        for name in (archive.FETCHED, archive.PACKING, archive.LOCAL_MANIFEST, "upper.img"):
            with open(os.path.join(d, name), "w") as f:
                f.write("x")
        dropped = archive_gc.drop_local_leftovers(rt, d)
        left = sorted(os.listdir(d))
        if kept:
            assert dropped == [] and archive.UNPACKING in left, (phase, left)
        else:
            assert left == ["runtime.json", "upper.img"], (phase, left)
            assert len(dropped) == 4


async def test_an_archive_made_in_another_store_is_not_called_lost(tmp_path):
    """A worker restarted with another archive store (make run, then make run-s3 on one home):
    its archived sandbox's object is in the old store. The resume says where it is and keeps the
    sandbox archived (found by the adversarial run: it was failed as 'gone')."""
    from atoll.core import errors

    runtimes = RuntimeStore(str(tmp_path / "home"), "inst")
    old = objectstore.LocalStore(str(tmp_path / "old-archive"))
    new = objectstore.LocalStore(str(tmp_path / "new-archive"))
    rt = _rt(runtimes, Phase.ARCHIVED)
    key = await _archive(old, tmp_path, rt.sandbox_id, 0)
    man = archive.ArchiveManifest(rt.sandbox_id, 0, key, 1, "0" * 64, store=old.name)
    archive.write_local_manifest(runtimes.dir(rt.sandbox_id), man)
    rt.archive_key = key
    with pytest.raises(errors.ResumeFailed, match="start the worker with that store again"):
        await Archiver(runtimes, new).unarchive(rt)
    assert rt.phase == Phase.ARCHIVED and await old.list(archive.prefix(rt.sandbox_id))


def test_the_manifest_pins_the_volumes_state(tmp_path):
    from atoll.core import worker_api as api

    archiver = Archiver(
        RuntimeStore(str(tmp_path / "home"), "inst"), objectstore.LocalStore(str(tmp_path / "a"))
    )
    archiver.store_info = lambda kind, name: api.StoreInfo(kind, name, 64, 12.5)
    m = {"kind": "volume", "name": "data", "path": "/data", "read_only": False}
    assert archiver._mount_state(m) == {**m, "state": {"size_mb": 64, "used_mb": 12.5, "backend": "local"}}

    def gone(kind, name):
        raise FileNotFoundError(name)

    archiver.store_info = gone
    assert "error" in archiver._mount_state(m)["state"]  # informative only: the archive goes on
