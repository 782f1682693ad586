"""Garbage collection of the archive tier: removals the store refused, objects an upload cut short,
archive files a stopped worker left in sandbox directories.

The object store may be shared by several workers (one bucket), so a worker only ever deletes what
it owns: the objects its own runtime records name (worker.host.archive.remove checks the store's
manifest names them too), never a prefix wholesale.

- `PendingRemovals`: a removal the store could not take (down, refusing) is written to a small
  journal, `<home>/archive-removals.json` (fsync'd, replaced atomically), and retried by `retry`
  until the store takes it — at start and every pass of the worker's garbage loop. An entry is
  dropped once done, or when the key is live again (this worker archived the same generation anew).
- `ArchiveCollector.sweep`: for each sandbox this worker holds with an archive key, an archived one's
  objects its manifest does not name are removed (an upload cut short); an archive key kept by a
  sandbox that is on disk again (an archive aborted, a stale archive whose removal failed) is
  removed as above, unless it was kept on purpose (a resume with `keep_archive`).
- `drop_local_leftovers`: the staging files of a transfer cut short (archive.drop_leftovers) and a
  stale local manifest in the directory of a sandbox not archiving or archived, at start.

Every step on a sandbox runs under its lock (the one its pause, resume and delete take), so a
removal never races a new upload of the same sandbox; a busy sandbox is left for the next pass.
Called by worker.runtimes.archiving (the journal), worker.runtimes.recovery (leftovers at start)
and worker.service.node's garbage loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import typing

from atoll.core.lifecycle import Phase
from atoll.worker.host import archive, objectstore

if typing.TYPE_CHECKING:
    from atoll.worker.runtimes.runtime import Runtime, RuntimeStore

log = logging.getLogger(__name__)

JOURNAL = "archive-removals.json"


class PendingRemovals:
    """The durable list of (sandbox id, object key) removals still owed to the object store."""

    def __init__(self, path: str):
        self.path = path

    def entries(self) -> list[tuple[str, str]]:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return [(str(sid), str(key)) for sid, key in data]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as e:
            # never overwritten: what it names must not be forgotten by the next add()
            aside = f"{self.path}.unreadable-{int(time.time())}"
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.error(
                "the journal of pending archive removals was unreadable (%s); moved to %s, its objects "
                "stay in the store until removed by hand",
                e,
                aside,
            )
            return []

    def _write(self, entries: list[tuple[str, str]]) -> None:
        if not entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        tmp = self.path + ".tmp"
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump([list(e) for e in entries], f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def add(self, sid: str, key: str) -> None:
        entries = self.entries()
        if (sid, key) not in entries:
            self._write([*entries, (sid, key)])

    def discard(self, sid: str, key: str) -> None:
        entries = self.entries()
        if (sid, key) in entries:
            self._write([e for e in entries if e != (sid, key)])


def drop_local_leftovers(rt: Runtime, sandbox_dir: str) -> list[str]:
    """What an archive or a download cut short left in the directory of a sandbox that is neither
    archiving nor archived (at start: nothing is transferring): staging files and a stale local
    manifest. Returns the paths removed."""
    if rt.phase in (Phase.ARCHIVING, Phase.ARCHIVED):
        return []
    try:
        out = archive.drop_leftovers(sandbox_dir)
    except FileNotFoundError:
        return []
    stale = os.path.join(sandbox_dir, archive.LOCAL_MANIFEST)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(stale)
        out.append(stale)
    return out


class Archives(typing.Protocol):
    """What the collector uses of worker.runtimes.archiving.Archiver (which imports this module)."""

    store: objectstore.ObjectStore
    pending: PendingRemovals
    holder: str

    async def remove(self, sid: str, archive_key: str) -> bool: ...


class ArchiveCollector:
    def __init__(
        self,
        runtimes: RuntimeStore,
        archiver: Archives,
        lock: typing.Callable[[str], asyncio.Lock],
    ):
        self.runtimes = runtimes
        self.archiver = archiver
        self._lock = lock

    @property
    def store(self) -> objectstore.ObjectStore:
        return self.archiver.store

    async def retry(self) -> int:
        """Retry the journal's removals; returns how many are still owed. Stops at the first
        failure of the store (it is down: the next pass tries again)."""
        pending = self.archiver.pending
        for sid, key in pending.entries():
            lock = self._lock(sid)
            if lock.locked():
                continue  # a step of that sandbox is in progress: the next pass
            async with lock:
                rt = self.runtimes.find(sid)
                if rt is not None and rt.archive_key == key and rt.phase in (Phase.ARCHIVING, Phase.ARCHIVED):
                    pending.discard(sid, key)  # archived anew under the same key: it is live
                    continue
                try:
                    n = await archive.remove(self.store, sid, key, self.archiver.holder)
                except objectstore.StoreError as e:
                    log.info("pending archive removals wait for the store: %s", e)
                    break
                pending.discard(sid, key)
                log.info(
                    "sandbox.archive.removed: %d object(s) of a removal the store had refused",
                    n,
                    extra={"sandbox_id": sid, "key": key},
                )
        return len(pending.entries())

    async def sweep(self) -> list[str]:
        """One pass over the sandboxes this worker holds with an archive key (see the module
        doc); returns the keys removed. Stops at the first failure of the store."""
        removed: list[str] = []
        for rt in self.runtimes.cached():
            if not rt.archive_key or rt.temporary or rt.phase in (Phase.FAILED, Phase.DELETING):
                continue  # a failed one keeps its archive until its delete (which removes it)
            lock = self._lock(rt.sandbox_id)
            if lock.locked():
                continue
            async with lock:
                try:
                    removed += await self._sweep_one(rt)
                except objectstore.StoreError as e:
                    log.info("archive garbage collection waits for the store: %s", e)
                    break
        return removed

    async def _sweep_one(self, rt: Runtime) -> list[str]:
        sid, key = rt.sandbox_id, rt.archive_key
        if rt.phase == Phase.ARCHIVED:
            gone = await archive.drop_orphans(self.store, sid, key, self.archiver.holder)
            for k in gone:
                log.info("sandbox.archive.orphan_removed", extra={"sandbox_id": sid, "key": k})
            return gone
        if rt.phase == Phase.ARCHIVING or not key or rt.archive_kept:
            return []  # a kept archive is the control plane's to restore from (`keep_archive`)
        # on disk again with an archive key left: that archive is stale (an aborted archive, or
        # an unarchive whose removal failed before the journal existed)
        done = await self.archiver.remove(sid, key)  # journaled when the store fails
        rt.archive_key = ""
        self.runtimes.save(rt)
        return [key] if done else []
