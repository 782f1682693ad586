"""What this worker's retained state really takes, for the usage report (controlplane.metering
meters standby images and stores by these bytes, not by their size limits).

- a sandbox in the disk tier: the allocated blocks (`st_blocks × 512`; holes do not count) of its
  checkpoint directory and its upper (writable) layer image. The host's page cache writes them back
  for up to ~35 s after the pause (the upper filesystem, still mounted, into its loop image, then
  the image and the checkpoint to disk: blocks are allocated then, +25% for a fresh sandbox), so a
  new standby image is flushed first (`syncfs` of the upper filesystem, `fsync` of every file, on a
  thread: `snapshots` waits FLUSH_WAIT_S for it, else it is reported at the next report) and only
  then measured; measured again at every report for SETTLE_S, then every REFRESH_S (the files do
  not change while it is checkpointed; a restore starts a new runtime generation);
- a sandbox in the archive tier: its object's size in the store, from the manifest the worker
  wrote when it archived it (a sandbox adopted archived, whose manifest is only in the store, is
  not reported: the meter keeps its bound);
- the memory tier holds no image (its memory is metered as standby memory) and is not reported;
- a volume or drive: statvfs of its mounted filesystem, (blocks − free blocks) × fragment size,
  what `df` shows as used — chosen over the image's allocated blocks because that is what the
  tenant can see and free (the image keeps blocks of deleted files and the ext4 journal); for a
  filer drive it is what its FUSE mount reports. Measured on a thread, at most one pass at a time,
  so a FUSE mount that hangs never stalls the worker's monitor (its last figures are reported).

Called by worker.service.node (its monitor, every `usage_every_s`: ATOLL_USAGE_EVERY_S).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import time

from atoll.core import mounts
from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase, Tier
from atoll.worker.host import archive, storage
from atoll.worker.host.stores import FS, Stores
from atoll.worker.runtimes.archiving import disk_bytes
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore

log = logging.getLogger(__name__)

FLUSH_WAIT_S = 0.5
"""How long a report waits for a new standby image's flush (it is reported at the next otherwise)."""
SETTLE_S = 60.0
"""How long after a standby began its image is measured at every report."""
REFRESH_S = 600.0
"""How often a settled image is measured again."""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class Retained:
    def __init__(self, runtimes: RuntimeStore, stores: Stores):
        self.runtimes = runtimes
        self.stores = stores
        self._images: dict[str, tuple[tuple, float, float, api.SnapshotUsage]] = {}
        """sandbox id -> ((generation, phase), first seen, last measured (monotonic), the last
        measurement)."""
        self._store_bytes: tuple[api.StoreUsage, ...] = ()
        self._probe: asyncio.Future | None = None
        self._flushes: dict[str, tuple[tuple, asyncio.Future]] = {}
        """sandbox id -> ((generation, phase), the flush of its new standby image)."""

    # ---- standby images ----------------------------------------------------------------------
    async def snapshots(self, runtimes: list[Runtime]) -> tuple[api.SnapshotUsage, ...]:
        listed = [
            rt for rt in runtimes if not rt.temporary and rt.phase in (Phase.CHECKPOINTED, Phase.ARCHIVED)
        ]
        # new disk-tier images: flushed first (all at once, on threads), measured once flushed
        flushes: dict[str, tuple[tuple, asyncio.Future]] = {}
        for rt in listed:
            key = (rt.generation, rt.phase)
            seen = self._images.get(rt.sandbox_id)
            if rt.phase == Phase.CHECKPOINTED and (seen is None or seen[0] != key):
                flush = self._flushes.get(rt.sandbox_id)
                if flush is None or flush[0] != key:
                    flush = (key, asyncio.ensure_future(asyncio.to_thread(self._flush, rt.sandbox_id)))
                flushes[rt.sandbox_id] = flush
        pending = {f for _, f in flushes.values() if not f.done()}
        if pending:
            await asyncio.wait(pending, timeout=FLUSH_WAIT_S)
        out = []
        kept: dict[str, tuple[tuple, float, float, api.SnapshotUsage]] = {}
        now = time.monotonic()
        for rt in listed:
            key = (rt.generation, rt.phase)
            seen = self._images.get(rt.sandbox_id)
            if seen is not None and seen[0] != key:
                seen = None
            flush = flushes.get(rt.sandbox_id)
            if flush is not None:
                if not flush[1].done():
                    continue  # measured at a later report, once flushed
                del flushes[rt.sandbox_id]
                if not flush[1].cancelled() and flush[1].exception() is not None:
                    log.warning(
                        "usage: the standby image of %s could not be flushed (measured as it is): %s",
                        rt.sandbox_id,
                        flush[1].exception(),
                    )
            first = seen[1] if seen is not None else now
            if seen is not None and now - first >= SETTLE_S and now - seen[2] < REFRESH_S:
                kept[rt.sandbox_id] = seen
                out.append(seen[3])
                continue
            try:
                u = self._measure(rt)
            except (OSError, ValueError, archive.ArchiveDamaged) as e:
                log.warning("usage: the standby image of %s could not be measured: %s", rt.sandbox_id, e)
                continue
            if u is not None:
                kept[rt.sandbox_id] = (key, first, now, u)
                out.append(u)
        self._images = kept
        self._flushes = flushes  # those still running
        return tuple(out)

    def _flush(self, sid: str) -> None:
        """Write a new standby image's files back to disk, so their blocks are allocated: the upper
        filesystem (still mounted) into its loop image, then every file of the image."""
        mounted = self.runtimes.path(sid, "upper")
        if os.path.ismount(mounted):
            fd = os.open(mounted, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if _libc().syncfs(fd) != 0:
                    raise OSError(ctypes.get_errno(), f"syncfs {mounted}")
            finally:
                os.close(fd)
        files = [self.runtimes.path(sid, "upper.img")]
        for dirpath, _dirs, names in os.walk(self.runtimes.path(sid, "snapshot")):
            files += [os.path.join(dirpath, n) for n in names]
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _measure(self, rt: Runtime) -> api.SnapshotUsage | None:
        sid = rt.sandbox_id
        if rt.phase == Phase.CHECKPOINTED:
            n = disk_bytes(self.runtimes.path(sid, "snapshot"))
            upper = self.runtimes.path(sid, "upper.img")
            if os.path.exists(upper):
                n += disk_bytes(upper)
            return api.SnapshotUsage(sid, Tier.DISK, n)
        man = archive.local_manifest(self.runtimes.dir(sid))
        return api.SnapshotUsage(sid, Tier.ARCHIVE, man.size) if man is not None else None

    # ---- volumes and drives ------------------------------------------------------------------
    async def stores_now(self, wait_s: float = 0.2) -> tuple[api.StoreUsage, ...]:
        """The stores' figures: a pass on a thread, waited for up to `wait_s`; when it takes
        longer (a hung FUSE mount) the last figures, and that pass is taken up next time (never
        two at once)."""
        if self._probe is None:
            self._probe = asyncio.ensure_future(asyncio.to_thread(self._measure_stores))
        await asyncio.wait({self._probe}, timeout=wait_s)
        if self._probe.done():
            probe, self._probe = self._probe, None
            if probe.cancelled():
                return self._store_bytes
            err = probe.exception()
            if err is None:
                self._store_bytes = probe.result()
            else:
                log.warning("usage: the stores could not be measured: %s", err)
        return self._store_bytes

    def _measure_stores(self) -> tuple[api.StoreUsage, ...]:
        mounted = {mp for mp, _ in storage.mounts()}
        out = []
        for kind in mounts.KINDS:
            for name in self.stores.names(kind):
                fs = os.path.realpath(os.path.join(self.stores.dir(kind, name), FS))
                if fs not in mounted:
                    continue  # statvfs would describe the host's filesystem
                try:
                    st = os.statvfs(fs)
                except OSError:
                    continue
                out.append(api.StoreUsage(kind, name, (st.f_blocks - st.f_bfree) * st.f_frsize))
        return tuple(out)

    def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        for _, flush in self._flushes.values():
            flush.cancel()
        self._flushes.clear()
