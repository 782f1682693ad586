"""worker.runtimes.retained on files in a temporary directory: a disk-tier image is its allocated
blocks (holes do not count), measured while it settles and then seldom; an archive-tier image is its manifest's
object size; other phases report nothing; a store pass that hangs never holds up the report."""

from __future__ import annotations

import asyncio
import os
import threading
import types

from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase, Tier
from atoll.worker.host import archive
from atoll.worker.runtimes import retained
from atoll.worker.runtimes.retained import Retained

MIB = 1 << 20


class Runtimes:
    def __init__(self, root: str):
        self.root = root

    def dir(self, sid: str) -> str:
        return os.path.join(self.root, sid)

    def path(self, sid: str, *parts: str) -> str:
        return os.path.join(self.root, sid, *parts)


def _rt(sid: str, phase: Phase, generation: int = 1, temporary: bool = False):
    return types.SimpleNamespace(sandbox_id=sid, phase=phase, generation=generation, temporary=temporary)


def _checkpoint(root, sid: str) -> int:
    d = root / sid / "snapshot"
    d.mkdir(parents=True)
    (d / "checkpoint.img").write_bytes(os.urandom(MIB))
    with open(root / sid / "upper.img", "wb") as f:  # a sparse 100 MiB image with 64 KiB written
        f.truncate(100 * MIB)
        f.seek(10 * MIB)
        f.write(os.urandom(64 * 1024))
    return sum(os.stat(p).st_blocks * 512 for p in (d / "checkpoint.img", root / sid / "upper.img"))


async def test_images_are_their_allocated_bytes_measured_while_they_settle_then_seldom(tmp_path, monkeypatch):
    """Measured at every report for SETTLE_S (the page cache still writes the upper image back
    after the pause), then only every REFRESH_S; a new standby (generation) starts over."""
    clock = [1000.0]
    monkeypatch.setattr(retained.time, "monotonic", lambda: clock[0])
    r = Retained(Runtimes(str(tmp_path)), stores=None)  # type: ignore[arg-type]
    allocated = _checkpoint(tmp_path, "sb-a")
    assert MIB <= allocated < 3 * MIB  # not the upper image's 100 MiB
    got = await r.snapshots([_rt("sb-a", Phase.CHECKPOINTED)])
    assert got == (api.SnapshotUsage("sb-a", Tier.DISK, allocated),)
    (tmp_path / "sb-a" / "snapshot" / "more").write_bytes(os.urandom(MIB))
    clock[0] += 5  # still settling: measured again, and the written-back bytes count
    grown = await r.snapshots([_rt("sb-a", Phase.CHECKPOINTED)])
    assert grown[0].bytes >= allocated + MIB
    clock[0] += retained.SETTLE_S
    assert await r.snapshots([_rt("sb-a", Phase.CHECKPOINTED)]) == grown  # measured once more at settling
    (tmp_path / "sb-a" / "snapshot" / "late").write_bytes(os.urandom(MIB))
    clock[0] += 5
    assert await r.snapshots([_rt("sb-a", Phase.CHECKPOINTED)]) == grown  # settled: not walked again
    clock[0] += retained.REFRESH_S
    assert (await r.snapshots([_rt("sb-a", Phase.CHECKPOINTED)]))[0].bytes >= grown[0].bytes + MIB
    again = await r.snapshots([_rt("sb-a", Phase.CHECKPOINTED, generation=2)])  # a new standby is
    assert again[0].bytes >= allocated + 2 * MIB


async def test_archived_images_are_their_objects_size_and_other_phases_are_not_reported(tmp_path):
    r = Retained(Runtimes(str(tmp_path)), stores=None)  # type: ignore[arg-type]
    (tmp_path / "sb-b").mkdir()
    man = archive.ArchiveManifest(sandbox_id="sb-b", generation=1, key="k", size=123_456, sha256="")
    (tmp_path / "sb-b" / archive.LOCAL_MANIFEST).write_text(man.dumps())
    (tmp_path / "sb-c").mkdir()  # archived, its manifest only in the store: not reported
    _checkpoint(tmp_path, "sb-t")
    runtimes = [
        _rt("sb-b", Phase.ARCHIVED),
        _rt("sb-c", Phase.ARCHIVED),
        _rt("sb-r", Phase.RUNNING),
        _rt("sb-f", Phase.FROZEN),
        _rt("sb-t", Phase.CHECKPOINTED, temporary=True),
    ]
    assert await r.snapshots(runtimes) == (api.SnapshotUsage("sb-b", Tier.ARCHIVE, 123_456),)


async def test_a_new_disk_tier_image_is_measured_once_its_files_are_flushed(tmp_path):
    """The page cache writes a fresh standby image back for ~35 s after the pause, and its blocks
    are allocated only then: a new image is flushed first (on a thread) and measured after that,
    at a later report if the flush takes longer than FLUSH_WAIT_S."""
    r = Retained(Runtimes(str(tmp_path)), stores=None)  # type: ignore[arg-type]
    allocated = _checkpoint(tmp_path, "sb-f")
    release, flushed = threading.Event(), []
    real_flush = r._flush

    def slow_flush(sid):
        release.wait(10)
        real_flush(sid)
        flushed.append(sid)

    r._flush = slow_flush  # type: ignore[method-assign]
    assert await r.snapshots([_rt("sb-f", Phase.CHECKPOINTED)]) == ()  # not yet flushed: not reported
    assert await r.snapshots([_rt("sb-f", Phase.CHECKPOINTED)]) == ()  # the same flush, not another
    release.set()
    got = ()
    for _ in range(50):
        got = await r.snapshots([_rt("sb-f", Phase.CHECKPOINTED)])
        if got:
            break
    assert flushed == ["sb-f"]
    assert got == (api.SnapshotUsage("sb-f", Tier.DISK, allocated),)
    # measured, it is not flushed again; a new standby (generation) is
    assert await r.snapshots([_rt("sb-f", Phase.CHECKPOINTED)]) == got
    assert (await r.snapshots([_rt("sb-f", Phase.CHECKPOINTED, generation=2)]))[0].bytes == allocated
    assert flushed == ["sb-f", "sb-f"]


async def test_a_store_pass_that_hangs_gives_the_last_figures_and_is_never_doubled(tmp_path):
    r = Retained(Runtimes(str(tmp_path)), stores=None)  # type: ignore[arg-type]
    release = threading.Event()
    passes = []

    def measure():
        passes.append(1)
        if len(passes) == 1:
            return (api.StoreUsage("volume", "v", 10 * MIB),)
        release.wait(10)  # a FUSE mount that does not answer
        return (api.StoreUsage("volume", "v", 20 * MIB),)

    r._measure_stores = measure  # type: ignore[method-assign]
    assert await r.stores_now() == (api.StoreUsage("volume", "v", 10 * MIB),)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await r.stores_now(wait_s=0.1) == (api.StoreUsage("volume", "v", 10 * MIB),)
    assert await r.stores_now(wait_s=0.1) == (api.StoreUsage("volume", "v", 10 * MIB),)
    assert loop.time() - t0 < 2 and len(passes) == 2  # the hung pass is waited on, not repeated
    release.set()
    for _ in range(50):
        got = await r.stores_now(wait_s=0.1)
        if got[0].used_bytes == 20 * MIB:
            break
    assert got == (api.StoreUsage("volume", "v", 20 * MIB),)
