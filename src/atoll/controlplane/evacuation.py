"""Drain with evacuation: every sandbox of a draining worker moves to another one, in the background.

`POST /v1/workers/{id}/drain` (controlplane.routes_workers) cordons the worker (controlplane.workers
`drain`) and starts an `Evacuation` of it here. Each sandbox moves under its lifecycle lock (an exec
that arrives meanwhile waits, then runs wherever the sandbox is):

1. another ready worker must have room for it (placement, never the drained worker), else it stays;
2. it is paused to the archive tier on its worker (running and memory-tier ones: the checkpoint
   gate first — a sandbox the gate keeps in memory, e.g. an epoll server on TCP, is frozen by that
   step and thawed again, never checkpointed: a failed checkpoint would kill it; a store that fails
   leaves it in the disk tier on its worker);
3. another worker adopts it from the shared object store by reference (SandboxManager
   `_move_archived_locked`: worker verb `adopt`, which names the new worker the archive's `holder`);
4. the drained worker drops its local copy (worker `delete`: its archive removal leaves the objects
   alone, their manifest names another holder);
5. a sandbox that was running is resumed on its new worker at once (a pause of a few seconds, its
   processes and memory intact); a standby one stays in the archive tier there and resumes on the
   next call.

A sandbox that cannot move (gated, busy for BUSY_WAIT_S, the store failing, no other worker with
room, failed, a volume that stays with its worker) stays where it is, back in the state it had when
it was running, and is listed in `left` with the reason. Unclaimed warm-pool members are deleted
instead (the pool keepers refill on the ready workers). `{"draining": false}` stops an evacuation
between sandboxes. Evacuations live in this process: after a server restart the worker is still
draining and a new `POST …/drain` moves what is left. Called by controlplane.routes_workers; the
SandboxManager owns one `Evacuator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import typing
from dataclasses import dataclass, field

from atoll.controlplane import db as dbm
from atoll.core import errors
from atoll.core.lifecycle import State, Tier

if typing.TYPE_CHECKING:
    from atoll.controlplane.lifecycle import SandboxManager
    from atoll.controlplane.workers import WorkerHandle

log = logging.getLogger(__name__)

CONCURRENCY = 4
"""Sandboxes moved at once (each is a checkpoint, an upload, a download and a restore)."""
BUSY_WAIT_S = 30.0
"""How long a sandbox with exec/file calls in flight is waited for before it is reported."""


@dataclass
class Evacuation:
    """One drain's progress on one worker (shown as `evacuation` by GET /v1/workers/{id})."""

    worker_id: str
    state: str = "running"  # running | done | stopped
    moved: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    pool_members_dropped: int = 0
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    stop: bool = False
    task: asyncio.Task | None = None

    def view(self) -> dict:
        return {
            "state": self.state,
            "moved": len(self.moved),
            "left": [{"id": sid, "reason": why} for sid, why in self.left.items()],
            "pool_members_dropped": self.pool_members_dropped,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
        }


class Evacuator:
    def __init__(self, manager: SandboxManager):
        self.m = manager
        self.runs: dict[str, Evacuation] = {}

    def get(self, worker_id: str) -> Evacuation | None:
        return self.runs.get(worker_id)

    def start(self, h: WorkerHandle) -> Evacuation:
        """Evacuate `h` (draining) in the background; one already running goes on."""
        cur = self.runs.get(h.id)
        if cur is not None and cur.state == "running" and not cur.stop:
            return cur
        ev = Evacuation(h.id)
        self.runs[h.id] = ev
        ev.task = asyncio.ensure_future(self._run(ev, h))
        return ev

    def stop(self, worker_id: str) -> None:
        """Undrained: no further sandbox starts moving (one moving now finishes its move)."""
        ev = self.runs.get(worker_id)
        if ev is not None and ev.state == "running":
            ev.stop = True

    async def aclose(self) -> None:
        for ev in self.runs.values():
            ev.stop = True
            if ev.task is not None and not ev.task.done():
                ev.task.cancel()
                with contextlib.suppress(BaseException):
                    await ev.task

    async def _run(self, ev: Evacuation, h: WorkerHandle) -> None:
        log.info("worker.evacuate.started", extra={"worker": h.name, "worker_id": h.id})
        t0 = time.perf_counter()
        limit = asyncio.Semaphore(CONCURRENCY)

        async def one(rec: dbm.SandboxRecord) -> None:
            async with limit:
                if ev.stop or h.state != "draining":
                    ev.stop = True
                    return
                try:
                    why = await self._one(rec, h)
                except Exception as e:  # one sandbox's trouble must not stop the others
                    log.exception("evacuating a sandbox failed", extra={"sandbox_id": rec.id})
                    why = f"moving it failed: {e!r}"[:500]
                if why is None:
                    ev.moved.append(rec.id)
                elif why == POOL_DROPPED:
                    ev.pool_members_dropped += 1
                else:
                    ev.left[rec.id] = why

        try:
            # running ones first: their pause is what users notice; standby ones wait unnoticed
            recs = sorted(
                (r for r in self.m.ledger.live() if r.worker_id == h.id),
                key=lambda r: r.state != State.RUNNING,
            )
            await asyncio.gather(*(one(r) for r in recs))
        finally:
            ev.state = "stopped" if ev.stop else "done"
            ev.finished_at = time.time()
            log.info(
                "worker.evacuate.%s: %d moved, %d left, %d pool member(s) dropped in %.1f s",
                ev.state,
                len(ev.moved),
                len(ev.left),
                ev.pool_members_dropped,
                time.perf_counter() - t0,
                extra={"worker": h.name, "worker_id": h.id},
            )
            self.m.pools.wake()  # refill on the ready workers

    async def _one(self, rec: dbm.SandboxRecord, h: WorkerHandle) -> str | None:
        """Move one sandbox off `h`: None when it moved, POOL_DROPPED, else why it stays."""
        m = self.m
        sid = rec.id
        if rec.pooled:
            if m.busy(sid):
                return "a warm-pool member being claimed"
            with contextlib.suppress(errors.SandboxNotFound):
                await m.delete(sid)
            return POOL_DROPPED
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            async with m.ledger.lock(sid):
                rec = m.get(sid)
                if rec.worker_id != h.id or rec.state == State.DELETED:
                    return None if rec.state != State.DELETED else "deleted meanwhile"
                if not m.ledger.inflight.get(sid):
                    return await self._move_locked(rec, h)
            if time.monotonic() >= deadline:
                n = m.ledger.inflight.get(sid, 0)
                return (
                    f"busy: {n} exec/file call(s) in progress for {BUSY_WAIT_S:.0f} s; it stays "
                    "(drain again once they end)"
                )
            await asyncio.sleep(0.5)

    async def _move_locked(self, rec: dbm.SandboxRecord, h: WorkerHandle) -> str | None:
        m = self.m
        sid = rec.id
        if rec.state == State.FAILED:
            return f"failed ({rec.failure_reason}); a failed sandbox does not move — delete it"
        if rec.state == State.CREATING:
            return "still being created; drain again once it runs"
        if any(mt.get("kind") == "volume" for mt in rec.mounts or ()):
            return "it mounts a volume, which stays on its worker; it cannot move"
        try:
            m.ledger.place(  # room elsewhere, before touching it
                None,
                rec.memory_mb,
                cpus=rec.cpus,
                tenant=rec.tenant_id,
                avoid=h.id,
                what=f"room check for {rec.id}",
            )
        except errors.AtollError as e:
            return f"no other worker can take it: {e.message}"
        was_running = rec.state == State.RUNNING
        if rec.standby_tier != Tier.ARCHIVE:
            try:
                rec = await m._pause_locked(rec, Tier.ARCHIVE, False)
            except errors.SandboxBusy as e:
                return f"busy: {e.message}"
            except errors.AtollError as e:
                if rec.state == State.FAILED:
                    return f"it failed while being archived: {e.message}"
                return f"it could not be archived: {e.message}"
            if rec.standby_tier != Tier.ARCHIVE:
                stayed = rec.standby_reason or f"it stayed in the {rec.standby_tier or 'running'} state"
                if was_running and rec.state == State.STANDBY:
                    await self._resume_here(rec)
                return stayed
        refused = await m._move_archived_locked(rec, h.name, avoid=h.id)
        if refused is not None:
            if was_running:
                await self._resume_here(rec)
            return f"no other worker adopted it from the object store: {refused}"
        # the new holder owns the archive now: the drained worker drops its local copy only
        if h.worker is not None:
            try:
                await h.worker.delete(sid)
            except errors.AtollError as e:
                log.warning(
                    "sandbox.evacuate: the old copy stays on %s until its reconciliation: %s",
                    h.name,
                    e.message,
                    extra={"sandbox_id": sid},
                )
        if was_running:
            try:
                await m._resume_locked(rec)
            except errors.AtollError as e:  # it resumes on its next call (or says why it cannot)
                log.warning(
                    "sandbox.evacuate: moved, not resumed yet: %s", e.message, extra={"sandbox_id": sid}
                )
        return None

    async def _resume_here(self, rec: dbm.SandboxRecord) -> None:
        """A running sandbox that could not move runs again where it is."""
        try:
            await self.m._resume_locked(rec)
        except errors.AtollError as e:
            log.warning(
                "sandbox.evacuate: not resumed on its worker: %s", e.message, extra={"sandbox_id": rec.id}
            )


POOL_DROPPED = "\x00pool"


def _iso(t: float | None) -> str | None:
    return None if t is None else dt.datetime.fromtimestamp(t, dt.UTC).isoformat()
