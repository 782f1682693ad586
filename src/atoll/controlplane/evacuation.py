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
   `move_archived_locked`: worker verb `adopt`, which names the new worker the archive's `holder`);
4. a sandbox that was running is resumed on its new worker at once (a pause of a few seconds, its
   processes and memory intact); a standby one stays in the archive tier there and resumes on the
   next call;
5. once the sandbox's lock is released, the drained worker drops its local copy (worker `delete`:
   its archive removal leaves the objects alone, their manifest names another holder). A call that
   waited for the move, and the resume of a running one, do not wait for that `runsc delete` and
   sweep (0.1-1.3 s measured on loopback by bench/bench_resume_elsewhere.py); the verdict does.

A sandbox that cannot move (gated, busy for BUSY_WAIT_S, the store failing, no other worker with
room, failed, a volume that stays with its worker) stays where it is, back in the state it had when
it was running, and is listed in `left` with the reason. Unclaimed warm-pool members are deleted
instead (the pool keepers refill on the ready workers). `{"draining": false}` stops an evacuation
between sandboxes. Once it has moved what it listed it lists the worker again (RELIST_PASSES), so
a sandbox that reached it meanwhile moves too. On shared records (several servers) the last list
waits until every server has read the cordon (CORDON_KNOWN_S), and each move holds the sandbox's
`move/<id>` lease (controlplane.leases): the server a worker moved to mid-evacuation waits for a
move the other still runs instead of moving that sandbox a second time.

The progress is durable: `Evacuation.record()` is written to the worker's record (`workers.evacuation`)
when the evacuation starts and after every sandbox's verdict. A server that stops lets the moves
under way finish (CLOSE_WAIT_S) and leaves the rest `pending`; when the worker is adopted again in
the `draining` state (after a server restart, or after it was lost meanwhile), the manager's
`worker_ready` calls `Evacuator.resume`, which goes on with what is pending (`resumed_at`). Called
by controlplane.routes_workers and controlplane.lifecycle; the SandboxManager owns one `Evacuator`.
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
from atoll.controlplane import leases
from atoll.controlplane.workers import OTHERS_EVERY_S
from atoll.core import errors
from atoll.core.lifecycle import State, Tier

if typing.TYPE_CHECKING:
    from atoll.controlplane.manager_view import Manager
    from atoll.controlplane.workers import WorkerHandle

log = logging.getLogger(__name__)

CONCURRENCY = 4
"""Sandboxes moved at once (each is a checkpoint, an upload, a download and a restore)."""
BUSY_WAIT_S = 30.0
"""How long a sandbox with exec/file calls in flight is waited for before it is reported."""
CLOSE_WAIT_S = 10.0
"""How long a stopping server lets the moves under way finish (the rest stays pending)."""
RELIST_PASSES = 5
"""How many times an evacuation lists its worker's sandboxes again once it moved what it listed: a
sandbox created or moved onto the worker meanwhile (through a server that had not learnt of the
cordon yet) moves too. It ends when a list finds nothing new (or after this many)."""
CORDON_KNOWN_S = OTHERS_EVERY_S + 2.0
"""On shared records: how long after the cordon every other server has learnt of it (each reads
the workers' rows every OTHERS_EVERY_S) and places nothing more there; the evacuation's last list
is taken no earlier."""
MOVE_LEASE_S = 60.0
"""On shared records, each move holds the sandbox's `move/<id>` lease (controlplane.leases), renewed
every third of this: a server that takes the worker over mid-evacuation (and resumes it) waits for
a move the other still runs instead of moving the sandbox a second time; one that dies mid-move
frees it after this long."""
RESUME_SETTLE_S = 15.0
"""How long a resumed evacuation waits for another worker to be ready (after a server restart the
workers register again one by one; the drained one may come back first)."""


@dataclass
class Evacuation:
    """One drain's progress on one worker (shown as `evacuation` by GET /v1/workers/{id}, kept in
    the worker's record as `record()`)."""

    worker_id: str
    state: str = "running"  # running | done | stopped
    pending: list[str] = field(default_factory=list)
    """Sandboxes whose turn has not come (or whose move a server stop cut short), in order."""
    moved: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    """Sandboxes that stay on the worker -> why."""
    was_running: list[str] = field(default_factory=list)
    """Sandboxes running when the evacuation started: a move cut short by a server stop leaves one
    archived on its old worker; the resumed evacuation resumes it on its new worker."""
    pool_members_dropped: int = 0
    started_at: float = field(default_factory=time.time)
    resumed_at: float | None = None
    finished_at: float | None = None
    stop: bool = False
    """Undrained: no further sandbox starts moving; the evacuation ends `stopped`."""
    closing: bool = False
    """This server stops: no further sandbox starts moving; the evacuation stays `running`."""
    halted: str | None = None
    """Why it paused without finishing (its worker not draining any more, e.g. lost)."""
    to_wake: list[str] = field(default_factory=list)
    """Resumed run: sandboxes moved before the stop but not resumed on their new worker yet."""
    task: asyncio.Task | None = None

    @property
    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    def view(self) -> dict:
        return {
            "state": self.state,
            "moved": len(self.moved),
            "pending": len(self.pending),
            "left": [{"id": sid, "reason": why} for sid, why in self.left.items()],
            "pool_members_dropped": self.pool_members_dropped,
            "started_at": _iso(self.started_at),
            "resumed_at": _iso(self.resumed_at),
            "finished_at": _iso(self.finished_at),
        }

    def record(self) -> dict:
        """What the worker's record keeps (JSON; `from_record` reads it back)."""
        return {
            "state": self.state,
            "pending": list(self.pending),
            "moved": list(self.moved),
            "left": dict(self.left),
            "was_running": list(self.was_running),
            "pool_members_dropped": self.pool_members_dropped,
            "started_at": _iso(self.started_at),
            "resumed_at": _iso(self.resumed_at),
            "finished_at": _iso(self.finished_at),
        }

    @classmethod
    def from_record(cls, worker_id: str, rec: object) -> Evacuation | None:
        """The evacuation a worker's record keeps (None: none, or a value this server cannot read,
        which is logged and ignored: a drain again starts afresh)."""
        if rec is None:
            return None
        try:
            if not isinstance(rec, dict) or rec.get("state") not in ("running", "done", "stopped"):
                raise ValueError(f"state {rec.get('state') if isinstance(rec, dict) else rec!r}")
            started = _parse(rec.get("started_at"))
            return cls(
                worker_id,
                state=rec["state"],
                pending=[str(x) for x in rec.get("pending") or ()],
                moved=[str(x) for x in rec.get("moved") or ()],
                left={str(k): str(v) for k, v in (rec.get("left") or {}).items()},
                was_running=[str(x) for x in rec.get("was_running") or ()],
                pool_members_dropped=int(rec.get("pool_members_dropped") or 0),
                started_at=started if started is not None else time.time(),
                resumed_at=_parse(rec.get("resumed_at")),
                finished_at=_parse(rec.get("finished_at")),
            )
        except (TypeError, ValueError, AttributeError) as e:
            log.warning("worker %s: its evacuation record is unreadable (%s); ignored", worker_id, e)
            return None


class Evacuator:
    def __init__(self, manager: Manager):
        self.m = manager
        self.runs: dict[str, Evacuation] = {}

    def get(self, worker_id: str) -> Evacuation | None:
        """This server's evacuation of the worker, else the one its record keeps."""
        ev = self.runs.get(worker_id)
        if ev is not None:
            return ev
        h = self.m.workers.handles.get(worker_id)
        return None if h is None else Evacuation.from_record(worker_id, h.record.evacuation)

    def start(self, h: WorkerHandle) -> Evacuation:
        """Evacuate `h` (draining) in the background; one already running goes on."""
        cur = self.runs.get(h.id)
        if cur is not None and cur.active and not cur.stop:
            return cur
        ev = Evacuation(h.id)
        recs = self._on(h)
        ev.pending = [r.id for r in recs]
        ev.was_running = [r.id for r in recs if r.state == State.RUNNING]
        return self._launch(ev, h, recs)

    def resume(self, h: WorkerHandle) -> Evacuation | None:
        """Go on with the unfinished evacuation of `h` (draining, adopted again: after a server
        restart or its loss); None when there is none (or it runs)."""
        cur = self.runs.get(h.id)
        if cur is not None and cur.active:
            return None
        ev = cur if cur is not None else Evacuation.from_record(h.id, h.record.evacuation)
        if ev is None or ev.state != "running":
            return None
        ev.stop = ev.closing = False
        ev.halted = None
        ev.resumed_at = time.time()
        live = {r.id: r for r in self.m.ledger.live()}
        todo: list[dbm.SandboxRecord] = []
        for sid in ev.pending:
            rec = live.get(sid)
            if rec is None:
                continue  # deleted meanwhile
            if rec.worker_id != h.id:  # its move was cut short after the adoption: it moved
                if sid not in ev.moved:
                    ev.moved.append(sid)
                if sid in ev.was_running and (rec.state, rec.standby_tier) == (State.STANDBY, Tier.ARCHIVE):
                    ev.to_wake.append(sid)  # ... but was not resumed on its new worker
                continue
            todo.append(rec)
        known = {*ev.pending, *ev.moved, *ev.left}
        todo += [r for r in self._on(h) if r.id not in known]
        todo.sort(key=lambda r: r.state != State.RUNNING)
        ev.pending = [r.id for r in todo]
        log.info(
            "worker.evacuate.resumed: %d pending, %d moved, %d left before",
            len(ev.pending),
            len(ev.moved),
            len(ev.left),
            extra={"worker": h.name, "worker_id": h.id},
        )
        return self._launch(ev, h, todo, resumed=True)

    def stop(self, worker_id: str) -> None:
        """Undrained: no further sandbox starts moving (one moving now finishes its move)."""
        ev = self.get(worker_id)
        if ev is None or ev.state != "running":
            return
        ev.stop = True
        if not ev.active:  # none under way here (a record left by an earlier server): ends now
            h = self.m.workers.handles.get(worker_id)
            ev.state, ev.finished_at = "stopped", time.time()
            self.runs[worker_id] = ev
            if h is not None:
                self._save(ev, h)

    async def aclose(self) -> None:
        """The server stops: the moves under way get CLOSE_WAIT_S to finish; what has not moved
        stays pending in the worker's record (the next server resumes it)."""
        for ev in self.runs.values():
            ev.closing = True
        tasks = [ev.task for ev in self.runs.values() if ev.active]
        if tasks:
            await asyncio.wait(typing.cast(list, tasks), timeout=CLOSE_WAIT_S)
        for t in tasks:
            if t is not None and not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t

    def _on(self, h: WorkerHandle) -> list[dbm.SandboxRecord]:
        # running ones first: their pause is what users notice; standby ones wait unnoticed
        return sorted(
            (r for r in self.m.ledger.live() if r.worker_id == h.id),
            key=lambda r: r.state != State.RUNNING,
        )

    def _launch(
        self, ev: Evacuation, h: WorkerHandle, recs: list[dbm.SandboxRecord], *, resumed: bool = False
    ) -> Evacuation:
        self.runs[h.id] = ev
        self._save(ev, h)
        ev.task = asyncio.ensure_future(self._run(ev, h, recs, resumed))
        return ev

    def _save(self, ev: Evacuation, h: WorkerHandle) -> None:
        """The progress into the worker's record (not for a worker forgotten meanwhile, nor from
        an evacuation a newer one of the same worker replaced, nor for a worker another server
        sharing the records holds now: the row, and the evacuation, are that server's)."""
        if self.m.workers.handles.get(h.id) is not h or self.runs.get(h.id) is not ev:
            return
        try:
            if not self.m.workers.owns_record(h):
                return
            h.record.evacuation = ev.record()
            # that column only: another server may have drained or undrained it through the row
            # since (`draining`), which this server has not read yet (controlplane.workers `follow`)
            self.m.db.set_worker_columns(h.id, evacuation=h.record.evacuation)
        except Exception:  # the next verdict writes it again; the moves go on
            log.exception("saving the evacuation of worker %s failed", h.name)

    async def _wake(self, ev: Evacuation) -> None:
        """Resume on their new worker the running sandboxes whose move a stop cut short after the
        adoption (else they would wait there for their next call)."""
        for sid in ev.to_wake:
            async with self.m.ledger.lock(sid):
                with contextlib.suppress(errors.SandboxNotFound):
                    rec = self.m.get(sid)
                    if rec.state == State.STANDBY and rec.standby_tier == Tier.ARCHIVE:
                        await self._resume_here(rec)
        ev.to_wake = []

    async def _settle(self, ev: Evacuation, h: WorkerHandle) -> None:
        """A resumed evacuation waits (up to RESUME_SETTLE_S) for another worker to be ready."""
        deadline = time.monotonic() + RESUME_SETTLE_S
        while time.monotonic() < deadline and not (ev.stop or ev.closing):
            if any(o.state == "ready" and o.usable for o in self.m.workers.handles.values() if o is not h):
                return
            await asyncio.sleep(0.1)

    async def _run(
        self, ev: Evacuation, h: WorkerHandle, recs: list[dbm.SandboxRecord], resumed: bool
    ) -> None:
        log.info("worker.evacuate.started", extra={"worker": h.name, "worker_id": h.id})
        t0 = time.perf_counter()
        limit = asyncio.Semaphore(CONCURRENCY)

        async def one(rec: dbm.SandboxRecord) -> None:
            async with limit:
                if ev.stop or ev.closing or ev.halted:
                    return  # stays pending
                if h.borrowed is not None:  # it moved to another server: the evacuation is its
                    ev.halted = "its worker is held by another server sharing the records now"
                    return
                if h.state != "draining":
                    if h.state == "ready":
                        ev.stop = True
                    else:
                        ev.halted = f"its worker is {h.state}"
                    return
                try:
                    why = await self._one(ev, rec, h)
                except Exception as e:  # one sandbox's trouble must not stop the others
                    log.exception("evacuating a sandbox failed", extra={"sandbox_id": rec.id})
                    why = f"moving it failed: {e!r}"[:500]
                if why == INTERRUPTED:
                    return  # stays pending
                with contextlib.suppress(ValueError):
                    ev.pending.remove(rec.id)
                if why is None:
                    ev.moved.append(rec.id)
                elif why == POOL_DROPPED:
                    ev.pool_members_dropped += 1
                else:
                    ev.left[rec.id] = why
                self._save(ev, h)

        try:
            if resumed:
                await self._settle(ev, h)
                await self._wake(ev)
            await asyncio.gather(*(one(r) for r in recs))
            for _ in range(RELIST_PASSES):  # what reached the worker after the list was taken
                recs = await self._relist(ev, h)
                if not recs:
                    break
                ev.pending += [r.id for r in recs]
                ev.was_running += [r.id for r in recs if r.state == State.RUNNING]
                self._save(ev, h)
                await asyncio.gather(*(one(r) for r in recs))
        finally:
            if ev.stop:
                ev.state, ev.finished_at = "stopped", time.time()
            elif not (ev.closing or ev.halted) or not ev.pending:
                ev.state, ev.finished_at = "done", time.time()
            # else: still running: this server stops, or its worker is gone; resumed when it is
            # adopted again while draining
            self._save(ev, h)
            log.info(
                "worker.evacuate.%s: %d moved, %d left, %d pending, %d pool member(s) dropped in %.1f s%s",
                ev.state if ev.finished_at is not None else "interrupted",
                len(ev.moved),
                len(ev.left),
                len(ev.pending),
                ev.pool_members_dropped,
                time.perf_counter() - t0,
                f" ({ev.halted})" if ev.halted else "",
                extra={"worker": h.name, "worker_id": h.id},
            )
            self.m.pools.wake()  # refill on the ready workers

    async def _relist(self, ev: Evacuation, h: WorkerHandle) -> list[dbm.SandboxRecord]:
        """The sandboxes on `h` this evacuation has not moved nor left: created or moved there
        after its list was taken. On shared records not before every server learnt of the cordon
        (CORDON_KNOWN_S), and with the records read again (another server's creates). Empty when
        the evacuation stops, closes or halts meanwhile."""
        if self.m.ledger.shared:
            until = h.cordoned_at + CORDON_KNOWN_S
            while time.monotonic() < until and not (ev.stop or ev.closing or ev.halted):
                await asyncio.sleep(min(0.2, max(0.0, until - time.monotonic())))
        if ev.stop or ev.closing or ev.halted or h.state != "draining" or h.borrowed is not None:
            return []
        if self.m.ledger.shared:
            try:
                self.m.ledger.refresh()
            except dbm.UNAVAILABLE as e:  # the records cannot be read now: what is known is listed
                log.warning("worker.evacuate: the records could not be read again: %s", dbm.cause(e))
        done = {*ev.moved, *ev.left}
        return [r for r in self._on(h) if r.id not in done]

    async def _one(self, ev: Evacuation, rec: dbm.SandboxRecord, h: WorkerHandle) -> str | None:
        """Move one sandbox off `h`: None when it moved, POOL_DROPPED, INTERRUPTED (the server
        stops while it waits), else why it stays."""
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
            async with m.ledger.lock(sid), self._moving(sid) as other:
                if other is None:
                    rec = m.get(sid)
                    if rec.state == State.DELETED:
                        return "deleted meanwhile"
                    if rec.worker_id != h.id:  # it moved meanwhile (a move cut short by a server
                        # stop, finished by its new worker's reconciliation): running again if it was
                        if self._cut_short(ev, rec):
                            await self._resume_here(rec)
                        return None
                    # one being created through another server holds no lock here: waited for too
                    creating = m.ledger.shared and rec.state == State.CREATING and time.monotonic() < deadline
                    if not m.ledger.inflight.get(sid) and not creating:
                        why = await self._move_locked(ev, rec, h)
                        break
            if ev.closing:
                return INTERRUPTED
            if other is not None:  # another server moves it now (however long): waited for
                log.info("sandbox.evacuate: %s moves it now; waiting", other, extra={"sandbox_id": sid})
                deadline = time.monotonic() + BUSY_WAIT_S
            elif time.monotonic() >= deadline and m.ledger.inflight.get(sid):
                n = m.ledger.inflight.get(sid, 0)
                return (
                    f"busy: {n} exec/file call(s) in progress for {BUSY_WAIT_S:.0f} s; it stays "
                    "(drain again once they end)"
                )
            await asyncio.sleep(0.5)
        if why is None:
            await self._drop_old_copy(h, sid)
        return why

    @contextlib.asynccontextmanager
    async def _moving(self, sid: str):
        """On shared records, the sandbox's move lease for the block: None while this server holds
        it, else the server that does (another evacuation of the same worker, on the server it held
        it before or after a move between servers). On SQLite (one server) always None."""
        if not self.m.ledger.shared:
            yield None
            return
        leader = self.m.leader
        async with leases.holding(
            leader.leases, leases.move_lease(sid), leader.server_id, MOVE_LEASE_S
        ) as other:
            yield other

    async def _drop_old_copy(self, h: WorkerHandle, sid: str) -> None:
        """The drained worker drops its copy of a sandbox that moved (outside the sandbox's lock:
        the new holder owns the archive, and the drained worker takes no new sandboxes)."""
        if h.worker is None:
            return
        try:
            await h.worker.delete(sid)
        except errors.AtollError as e:
            log.warning(
                "sandbox.evacuate: the old copy stays on %s until its reconciliation: %s",
                h.name,
                e.message,
                extra={"sandbox_id": sid},
            )

    async def _move_locked(self, ev: Evacuation, rec: dbm.SandboxRecord, h: WorkerHandle) -> str | None:
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
        # archived by a move a server stop cut short: it runs again once moved
        was_running = rec.state == State.RUNNING or self._cut_short(ev, rec)
        if rec.standby_tier != Tier.ARCHIVE:
            try:
                rec = await m.pause_locked(rec, Tier.ARCHIVE, False)
            except errors.SandboxBusy as e:
                return f"busy: {e.message}"
            except errors.Unavailable as e:
                if isinstance(e, errors.DatabaseUnavailable) or rec.state == State.FAILED:
                    return f"it could not be archived: {e.message}"
                # its own worker stopped answering (killed mid-drain, before the server marked it
                # lost): no verdict on the sandbox; it stays pending and the evacuation goes on
                # when the worker is adopted again (`resume`)
                ev.halted = f"its worker stopped answering: {e.message}"[:500]
                return INTERRUPTED
            except errors.AtollError as e:
                if rec.state == State.FAILED:
                    return f"it failed while being archived: {e.message}"
                return f"it could not be archived: {e.message}"
            if rec.standby_tier != Tier.ARCHIVE:
                stayed = rec.standby_reason or f"it stayed in the {rec.standby_tier or 'running'} state"
                if was_running and rec.state == State.STANDBY:
                    await self._resume_here(rec)
                return stayed
        refused = await m.move_archived_locked(rec, h.name, avoid=h.id)
        if refused is not None:
            if was_running:
                await self._resume_here(rec)
            return f"no other worker adopted it from the object store: {refused}"
        # the new holder owns the archive now; the drained worker drops its copy after (`_one`)
        if was_running:
            try:
                await m.resume_locked(rec)
            except errors.AtollError as e:  # it resumes on its next call (or says why it cannot)
                log.warning(
                    "sandbox.evacuate: moved, not resumed yet: %s", e.message, extra={"sandbox_id": sid}
                )
        return None

    @staticmethod
    def _cut_short(ev: Evacuation, rec: dbm.SandboxRecord) -> bool:
        """A running sandbox this resumed evacuation archived before a server stop cut its move short."""
        return (
            ev.resumed_at is not None
            and rec.id in ev.was_running
            and rec.state == State.STANDBY
            and rec.standby_tier == Tier.ARCHIVE
        )

    async def _resume_here(self, rec: dbm.SandboxRecord) -> None:
        """A running sandbox that could not move runs again where it is."""
        try:
            await self.m.resume_locked(rec)
        except errors.AtollError as e:
            log.warning(
                "sandbox.evacuate: not resumed on its worker: %s", e.message, extra={"sandbox_id": rec.id}
            )


POOL_DROPPED = "\x00pool"
INTERRUPTED = "\x00interrupted"


def _iso(t: float | None) -> str | None:
    return None if t is None else dt.datetime.fromtimestamp(t, dt.UTC).isoformat()


def _parse(text: object) -> float | None:
    return None if text is None else dt.datetime.fromisoformat(str(text)).timestamp()
