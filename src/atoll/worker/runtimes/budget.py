"""The worker's disk budget (ATOLL_DISK_BUDGET_GB): archive disk-tier sandboxes until under it.

`DiskBudget.enforce` adds up what the sandboxes take on this worker's disk (allocated blocks of each
sandbox directory's own files: checkpoint images, upper images, records; never what is mounted
there), and while that is over the budget moves checkpointed sandboxes to the archive tier, the
longest idle first (oldest committed checkpoint). A running or frozen sandbox is never touched, nor
one whose lock is held (a step or a call in progress). Each move is reported as a RuntimeChanged
event, so the control plane's record follows (standby: archive). A pass measures again after
each round (sandboxes keep landing in the disk tier while it archives) and goes on until under the
budget or nothing more can be archived. A store that fails stops the pass (the next one tries again). Called by worker.node's monitor loop every BUDGET_EVERY_S.
"""

from __future__ import annotations

import contextlib
import logging
import os
import typing

from atoll.core.lifecycle import Phase
from atoll.core.worker_api import RuntimeChanged
from atoll.worker.host.snapshots import SnapshotStore
from atoll.worker.runtimes.archiving import Archiver
from atoll.worker.runtimes.runtime import Runtime, RuntimeStore

log = logging.getLogger(__name__)

BUDGET_EVERY_S = 5.0
MOUNT_POINTS = ("rootfs", "upper")  # never walked: what is mounted there is not this directory's


def sandbox_disk_bytes(sandbox_dir: str) -> int:
    """Allocated bytes of one sandbox directory's own files (holes and mounted trees excluded)."""
    total = 0
    for dirpath, dirs, files in os.walk(sandbox_dir):
        if dirpath == sandbox_dir:
            dirs[:] = [d for d in dirs if d not in MOUNT_POINTS]
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


class DiskBudget:
    def __init__(
        self,
        budget_bytes: int,
        runtimes: RuntimeStore,
        snapshots: SnapshotStore,
        archiver: Archiver,
        lock: typing.Callable[[str], typing.Any],
        emit: typing.Callable[[typing.Any], None],
    ):
        self.budget_bytes = budget_bytes
        self.runtimes = runtimes
        self.snapshots = snapshots
        self.archiver = archiver
        self._lock = lock
        self._emit = emit

    def usage(self) -> dict[str, int]:
        return {
            rt.sandbox_id: sandbox_disk_bytes(self.runtimes.dir(rt.sandbox_id))
            for rt in self.runtimes.cached()
        }

    def _idle_since(self, rt: Runtime) -> float:
        snap = self.snapshots.committed(rt.sandbox_id)
        return snap.manifest.created_at if snap else float("inf")

    async def enforce(self) -> list[str]:
        """One pass; returns the sandboxes it archived. A round counts what it frees against one
        measure, so what landed meanwhile (pauses to the disk tier go on during a pass) is measured
        by another round, until the worker is under the budget or a round can archive nothing."""
        moved: list[str] = []
        while True:
            got = await self._round()
            moved += got
            if not got or sum(self.usage().values()) <= self.budget_bytes:
                return moved

    async def _round(self) -> list[str]:
        usage = self.usage()
        total = sum(usage.values())
        if total <= self.budget_bytes:
            return []
        candidates = sorted(
            (rt for rt in self.runtimes.cached() if rt.phase == Phase.CHECKPOINTED and not rt.temporary),
            key=self._idle_since,
        )
        moved: list[str] = []
        for rt in candidates:
            if total <= self.budget_bytes:
                break
            sid = rt.sandbox_id
            lock = self._lock(sid)
            if lock.locked():
                continue  # a call or a step holds it: it is not idle
            async with lock:
                if rt.phase != Phase.CHECKPOINTED:
                    continue
                why = await self.archiver.archive(rt)
            if why is not None:
                log.warning(
                    "disk budget: %s stays on disk (%s); %d of %d bytes used",
                    sid,
                    why,
                    total,
                    self.budget_bytes,
                    extra={"sandbox_id": sid},
                )
                if self.archiver.store_failed:
                    break  # the store is down: the next pass tries again
                continue
            freed = usage.get(sid, 0) - sandbox_disk_bytes(self.runtimes.dir(sid))
            total -= freed
            moved.append(sid)
            self._emit(RuntimeChanged(sid, rt.phase, "archived: the worker's disk budget was exceeded"))
            log.info(
                "disk budget: archived %s, %d bytes freed; %d of %d bytes used",
                sid,
                freed,
                total,
                self.budget_bytes,
                extra={"sandbox_id": sid},
            )
        return moved
