"""The control plane's per-sandbox bookkeeping, one object every step goes through: the ledger.

What pools, templates, forks, lifetimes and the manager itself need of a sandbox's record lives
here, public and named, instead of in `SandboxManager`'s private parts: the records (a cache over
the database), one lock per sandbox for its lifecycle steps (the control plane owns it: a worker
has its own for what it does on the host), the count of calls in flight, the activity clock, the
last usage a worker reported (per sandbox, and per worker for the bytes of what it retains),
persisting a change through the core state table, the step log
(`sandbox.<verb>.started/complete/failed`), failing a sandbox, guarding a worker step, placement,
the background deletions in flight, and what several servers on one database exchange through it
(`refresh`: the lease holder reads what others made or changed; `share_activity`: every server
writes when its sandboxes were last used). `Steps` is what those modules ask of the manager's own
verbs (create, delete, pause, resume), so none of them imports it.
Made by controlplane.lifecycle (SandboxManager); handed to controlplane.pools, templates, forking
and lifetime.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import typing

from atoll.controlplane import auth, metrics
from atoll.controlplane import db as dbm
from atoll.controlplane.quotas import Quotas
from atoll.controlplane.workers import WorkerHandle, WorkerRegistry
from atoll.core import errors, ids, placement
from atoll.core import worker_api as api
from atoll.core.lifecycle import State, Tier, Verb, check_transition, status

log = logging.getLogger(__name__)
MAX_RESUME_FAILURES = 3
"""Failed resumes from the disk tier in a row after which a sandbox is failed (its files kept)."""


def _epoch(t: typing.Any) -> float:
    """A stored time as Unix seconds (SQLite hands datetimes back naive; they are UTC)."""
    return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp()


class Steps(typing.Protocol):
    """The manager's verbs, as pools, templates and forks call them."""

    async def create(self, req: typing.Any, *, pooled: bool = False) -> dbm.SandboxRecord: ...

    async def delete(self, sid: str) -> None: ...

    async def pause(self, sid: str, tier: Tier, *, only_if_idle: bool = False) -> dbm.SandboxRecord: ...

    async def resume(self, sid: str) -> dbm.SandboxRecord: ...


class RecordCache(dict[str, dbm.SandboxRecord]):
    """The ledger's records by sandbox id, plus an index of warm-pool members by template, kept up
    to date by every write of the dict: a record is put back (`cache[id] = rec`) after each change
    (`Ledger.persist`: create, claim, fail) and popped when deleted or stale, so a claim reads its
    template's few members (`pooled`) instead of every live record."""

    def __init__(self) -> None:
        super().__init__()
        self._pooled: dict[str, dict[str, dbm.SandboxRecord]] = {}

    def __setitem__(self, sid: str, rec: dbm.SandboxRecord) -> None:
        self._unindex(sid)
        super().__setitem__(sid, rec)
        if rec.pooled:
            self._pooled.setdefault(rec.template, {})[sid] = rec

    def __delitem__(self, sid: str) -> None:
        self._unindex(sid)
        super().__delitem__(sid)

    def pop(self, sid: str, *default: typing.Any) -> typing.Any:  # type: ignore[override]
        self._unindex(sid)
        return super().pop(sid, *default)

    def clear(self) -> None:
        super().clear()
        self._pooled.clear()

    def update(self, *args: typing.Any, **kwargs: typing.Any) -> None:  # type: ignore[override]
        for sid, rec in dict(*args, **kwargs).items():
            self[sid] = rec

    def setdefault(self, sid: str, rec: dbm.SandboxRecord) -> dbm.SandboxRecord:  # type: ignore[override]
        if sid not in self:
            self[sid] = rec
        return self[sid]

    def _unindex(self, sid: str) -> None:
        old = self.get(sid)
        if old is not None and (members := self._pooled.get(old.template)) is not None:
            members.pop(sid, None)
            if not members:
                del self._pooled[old.template]

    def pooled(self, template: str) -> list[dbm.SandboxRecord]:
        """The records of `template` that were pool members when last put in the cache (a caller
        checks `pooled` again: a record changed in place and not yet put back is still listed)."""
        return list(self._pooled.get(template, {}).values())


class Ledger:
    def __init__(
        self,
        database: dbm.Database,
        m: metrics.Metrics,
        workers: WorkerRegistry,
        *,
        secrets: typing.Any = None,
        default_network: dict | None = None,
    ):
        self.db = database
        self.metrics = m
        self.workers = workers
        self.secrets = secrets
        """The secret store (None: no secrets, as in some tests)."""
        self.default_network = default_network or {}
        """The installation's egress policy for a sandbox created without one (wire form)."""
        self.locks: dict[str, asyncio.Lock] = {}
        self.inflight: dict[str, int] = {}
        self.activity: dict[str, float] = {}
        """When each sandbox last had an API call, a worker-reported activity or a step (monotonic)."""
        self.resuming: dict[str, str] = {}
        """Sandboxes being resumed from the disk or archive tier -> the worker taking them: a slot
        each there until their record says running (two resumes never share a worker's last slot)."""
        self.cache = RecordCache()
        self.shared = database.dialect != "sqlite"
        """Whether other servers may write the records too (PostgreSQL): then `get` checks the
        cached copy's version against the database's (one indexed read) and reads a stale one
        again. On SQLite one server owns the file; a second one's writes are still refused, not
        lost (`sandbox_changed`), by the version every write checks."""
        self.usage: dict[str, api.Usage] = {}
        self.retained: dict[str, api.UsageReport] = {}
        """worker id -> its last usage report, for the bytes of standby images and stores it
        measured (controlplane.metering reads `snapshots` and `stores`)."""
        self.quotas = Quotas(database)
        """Tenant quotas (controlplane.quotas), for the lifecycle, pools, stores and templates."""
        self.reaps: set[asyncio.Task] = set()
        """Deletions of runtimes on their workers, in flight."""
        self._shared: dict[str, float] = {}
        """sid -> the activity time (monotonic) last written or read as `last_activity_at`."""

    # ---- records -------------------------------------------------------------------------------
    def get(self, sid: str) -> dbm.SandboxRecord:
        if not ids.is_sandbox_id(sid):
            raise errors.InvalidRequest(
                f"malformed sandbox id {errors.shown(sid)}: ids look like 'sb-' followed by 16 lower-case letters/digits"
            )
        rec = self.cache.get(sid)
        if rec is not None and self.shared and self.db.version(sid) != rec.version:
            rec = None  # another server wrote it since: read it again
        if rec is None:
            rec = self.db.get(sid)
        if rec is None or rec.state == State.DELETED or not auth.visible(rec.tenant_id):
            # another tenant's sandbox is as absent as one that never was: ids cannot be probed
            raise errors.SandboxNotFound(
                f"sandbox {sid} does not exist (or was deleted); list yours with GET /v1/sandboxes"
            )
        self.cache[sid] = rec
        return rec

    def live(self) -> list[dbm.SandboxRecord]:
        return list(self.cache.values())

    def refresh(self) -> int:
        """Bring the cache in line with the database: every live record, as read now, and the
        activity other servers saw (`share_activity`). The server holding the `leader` lease
        (controlplane.leases) calls it at each renewal, since its loops act on every sandbox, also
        those other servers made, changed or served calls of; alone on its database it finds
        nothing to read again (one indexed read of ids, versions and activity times). A sandbox
        under a step here is left as it is (the step holds its copy). The number of records read
        again or dropped."""
        marks = self.db.live_marks()
        mono, wall = time.monotonic(), self.db.now().timestamp()  # the database's clock (several servers)
        stale = []
        for sid, (version, at) in marks.items():
            rec = self.cache.get(sid)
            if (rec is None or rec.version != version) and not self.lock(sid).locked():
                stale.append(sid)
            if at is not None:  # used through another server: its idle clock restarts here too
                seen = mono - max(0.0, wall - _epoch(at))
                if seen > self.activity.get(sid, 0.0):
                    self.activity[sid] = self._shared[sid] = seen
        gone = [sid for sid in self.cache if sid not in marks and not self.lock(sid).locked()]
        for rec in self.db.get_many(stale):
            if rec.state != State.DELETED:
                self.cache[rec.id] = rec
                if rec.id not in self.activity:  # its idle clock starts when seen here (not a use)
                    self.activity[rec.id] = self._shared[rec.id] = mono
        for sid in gone:
            self.forget(sid)
        if stale or gone:
            log.info("records refreshed: %d read again, %d dropped", len(stale), len(gone))
        return len(stale) + len(gone)

    def share_activity(self) -> int:
        """Write, as `last_activity_at`, when each sandbox last had a call or a worker-reported
        activity on this server (since the last time), and "now" for those with calls in flight:
        the clock the lease holder's tier policy reads (`refresh`), so that a sandbox used
        through any server is not idle. Every server calls it at each lease renewal (TTL/3). How
        many were written."""
        mono, wall = time.monotonic(), self.db.now().timestamp()  # the database's clock (several servers)
        times = {}
        for sid, at in list(self.activity.items()):
            if self.inflight.get(sid):
                at = mono
            elif at <= self._shared.get(sid, 0.0):
                continue
            self._shared[sid] = at
            times[sid] = dt.datetime.fromtimestamp(wall - (mono - at), dt.UTC)
        for sid in [s for s in self._shared if s not in self.activity]:
            del self._shared[sid]
        self.db.note_activity(times)
        return len(times)

    def persist(self, rec: dbm.SandboxRecord, verb: Verb, **changes: typing.Any) -> None:
        """Walk the core state table by `verb`, with `changes`, and write it (a delete durably).

        On shared records another server may have written the record meanwhile — most often the
        server holding the worker, which follows the worker's own report of the step this server
        ran through it (a resume, a pause or a create asked through a borrower). The write is then
        tried once more on the record as read again: when that shows the state this step reached
        (only `changes` are written) or the state it started from (the step's write is made
        again). Anything else (deleted, failed, moved on) stays `sandbox_changed`."""
        before = status(rec.state, rec.standby_tier)
        try:
            self._persist(rec, verb, changes)
        except errors.SandboxChanged:
            fresh = self.db.get(rec.id) if self.shared else None
            if fresh is None or fresh.state == State.DELETED:
                raise
            now, reached = status(fresh.state, fresh.standby_tier), check_transition(before, verb)
            if now not in (before, reached):
                raise
            dbm.copy_record(fresh, rec)
            log.info(
                "record written again after another server's write",
                extra={"sandbox_id": rec.id, "verb": verb.value, "found": str(now)},
            )
            if now == before:
                self._persist(rec, verb, changes)
            else:
                for k, v in changes.items():
                    setattr(rec, k, v)
                if changes:
                    self.save(rec, list(changes), durable=verb == Verb.DELETE)
                self.cache[rec.id] = rec

    def _persist(self, rec: dbm.SandboxRecord, verb: Verb, changes: dict[str, typing.Any]) -> None:
        new = check_transition(status(rec.state, rec.standby_tier), verb)
        rec.state = new.state.value
        rec.standby_tier = new.tier.value if new.tier else None
        if new.state != State.STANDBY:
            rec.standby_reason, rec.standby_since = None, None
        for k, v in changes.items():
            setattr(rec, k, v)
        fields = ["state", "standby_tier", "standby_reason", "standby_since", *changes]
        # a delete must survive a power loss once acknowledged (the next start finishes it)
        self.save(rec, list(dict.fromkeys(fields)), durable=verb == Verb.DELETE)
        if new.state == State.DELETED:
            self.forget(rec.id)
        else:
            self.cache[rec.id] = rec

    def save(self, rec: dbm.SandboxRecord, fields: list[str], durable: bool = False) -> None:
        """Write `fields` of a record (Database.save). Every write of a sandbox's record goes
        through here: a write from a stale copy (another server wrote it since) is refused with
        `sandbox_changed` and the copy leaves the cache, so the next call reads the record again."""
        try:
            self.db.save(rec, fields=fields, durable=durable)
        except errors.SandboxChanged:
            self.cache.pop(rec.id, None)
            raise

    def seen(self, rec: dbm.SandboxRecord) -> None:
        """A record loaded at start: cached, its idle clock starting now (not a use to share)."""
        self.cache[rec.id] = rec
        self.activity[rec.id] = self._shared[rec.id] = time.monotonic()

    def forget(self, sid: str) -> None:
        self.cache.pop(sid, None)
        self._shared.pop(sid, None)
        self.activity.pop(sid, None)
        self.usage.pop(sid, None)

    def fail(self, rec: dbm.SandboxRecord, cause: str, detail: str | None = None) -> None:
        """Mark the sandbox failed: `cause` goes on the record (callers see it), `detail` (runsc log
        lines, host paths) only to the log."""
        if rec.state in (State.DELETED, State.FAILED):
            return
        log.warning("sandbox.fail", extra={"sandbox_id": rec.id, "reason": cause, "detail": detail})
        self.persist(rec, Verb.FAIL, failure_reason=cause)

    def resume_failed(
        self, rec: dbm.SandboxRecord, cause: str, detail: str | None = None
    ) -> errors.AtollError:
        """A resume from the disk tier did not complete and the worker kept the sandbox in standby
        (its image and writable layer): say why on the record, and fail it after
        MAX_RESUME_FAILURES tries in a row. Returns the error the caller gets."""
        tries = (rec.resume_failures or 0) + 1
        log.warning(
            "sandbox.resume_disk.kept",
            extra={"sandbox_id": rec.id, "tries": tries, "reason": cause, "detail": detail},
        )
        if tries >= MAX_RESUME_FAILURES:
            reason = (
                f"sandbox {rec.id} could not be resumed from disk in {tries} tries (the last: {cause}); "
                "its memory image and files are kept on its worker until you delete it"
            )
            self.persist(rec, Verb.FAIL, failure_reason=reason, resume_error=cause, resume_failures=tries)
            return errors.SandboxDied(reason)
        rec.resume_error, rec.resume_failures = cause, tries
        self.save(rec, ["resume_error", "resume_failures"])
        return errors.ResumeFailed(
            f"sandbox {rec.id} could not be resumed from disk (try {tries} of {MAX_RESUME_FAILURES}): "
            f"{cause}; it stays in standby with its files and memory image — call again to retry"
        )

    # ---- per-sandbox state ---------------------------------------------------------------------
    def lock(self, sid: str) -> asyncio.Lock:
        """The sandbox's lifecycle lock: its steps (create, pause, resume, delete, claim, fork) run
        one at a time; a call waits for a step in progress."""
        return self.locks.setdefault(sid, asyncio.Lock())

    def touch(self, sid: str) -> None:
        self.activity[sid] = time.monotonic()

    def busy(self, sid: str) -> bool:
        """Calls in flight, or a step running."""
        return bool(self.inflight.get(sid)) or self.lock(sid).locked()

    def refuse_if_failed(self, rec: dbm.SandboxRecord) -> None:
        if rec.state == State.FAILED:
            raise errors.Conflict(
                f"sandbox {rec.id} has failed ({rec.failure_reason}); delete it and create a new one",
                code="invalid_state",
            )

    def refuse_if_in_flight(self, sid: str, what: str) -> None:
        if self.inflight.get(sid):
            raise errors.SandboxBusy(
                f"sandbox {sid} has {self.inflight[sid]} exec/file call(s) in progress; {what}"
            )

    # ---- steps ---------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def step(self, verb: str, sid: str):
        """Log and time one lifecycle step; the caller may add fields to the `complete` line by
        putting them in the dict it gets (e.g. the worker's own share of the step)."""
        log.info("sandbox.%s.started", verb, extra={"sandbox_id": sid})
        t0 = time.perf_counter()
        fields: dict[str, typing.Any] = {}
        try:
            yield fields
        except BaseException as e:
            dur = time.perf_counter() - t0
            log.warning(
                "sandbox.%s.failed",
                verb,
                extra={"sandbox_id": sid, "duration_ms": round(dur * 1000, 2), "error": str(e)},
            )
            self.metrics.lifecycle.labels(verb=verb, outcome="failed").observe(dur)
            raise
        dur = time.perf_counter() - t0
        log.info(
            "sandbox.%s.complete",
            verb,
            extra={"sandbox_id": sid, "duration_ms": round(dur * 1000, 2), **fields},
        )
        self.metrics.lifecycle.labels(verb=verb, outcome="complete").observe(dur)

    async def guard(self, rec: dbm.SandboxRecord, aw: typing.Awaitable) -> typing.Any:
        """Run a worker step; a runtime failure marks the sandbox failed with its cause (an
        unreachable worker does not: nothing is known about the sandbox then)."""
        try:
            return await aw
        except (errors.RuntimeFailure, errors.SandboxDied) as e:
            self.fail(rec, e.message, e.detail)
            raise

    # ---- workers -------------------------------------------------------------------------------
    def worker(self, rec: dbm.SandboxRecord) -> api.WorkerAPI:
        return self.workers.api_for(rec.worker_id)

    def held(self) -> dict[str, placement.Commitment]:
        """What each worker's live records hold (core.placement.commitments), with a slot for
        each resume from the disk or archive tier in flight."""
        held = placement.commitments(self.cache.values())
        for wid, n in self._resuming_slots().items():
            held.setdefault(wid, placement.Commitment()).slots += n
        return held

    def _resuming_slots(self) -> dict[str, int]:
        """Per worker, the resumes from the disk or archive tier in flight whose record does not
        say running yet (once it does, commitments counts it)."""
        out: dict[str, int] = {}
        for sid, wid in self.resuming.items():
            rec = self.cache.get(sid)
            if rec is not None and rec.state == State.STANDBY and rec.standby_tier != Tier.MEMORY:
                out[wid] = out.get(wid, 0) + 1
        return out

    def allocated(self, worker_id: str) -> dict[str, float]:
        """What the live records on a worker hold: memory and slots of those in RAM (running,
        memory tier, being created or resumed), CPUs of those running, disk of all but the archived
        (core.placement)."""
        c = placement.commitments(r for r in self.cache.values() if r.worker_id == worker_id).get(
            worker_id, placement.Commitment()
        )
        return {
            "memory_mb": c.memory_mb,
            "cpus": round(c.cpus, 3),
            "disk_mb": c.disk_mb,
            "slots": c.slots + self._resuming_slots().get(worker_id, 0),
            "sandboxes": c.sandboxes,
        }

    def slot_shortage(self, worker_id: str, taking: int = 1) -> str | None:
        """Why `worker_id` cannot take `taking` sandboxes more into its slots, or None when it can
        (or has no limit)."""
        h = self.workers.handles.get(worker_id)
        limit = h.info.capacity.slots if h is not None and h.info is not None else 0
        if not limit:
            return None
        taken = int(self.allocated(worker_id)["slots"])
        if taken + taking <= limit:
            return None
        assert h is not None
        return f"worker {h.name} has {max(limit - taken, 0)} free slot(s) of {limit} and this needs {taking}"

    def slots_left(self, worker_id: str, taking: int = 1) -> None:
        """Refuse (503 no_worker) when `worker_id` has not `taking` free slots: a resume from the
        disk tier, which only its own worker can do, or forks, which land on their parent's."""
        short = self.slot_shortage(worker_id, taking)
        if short is not None:
            raise errors.Unavailable(f"{short}; {placement.SLOTS_FIX}", code="no_worker")

    def place(
        self,
        template: str | None,
        memory_mb: int,
        worker_id: str | None = None,
        *,
        cpus: float = 0.0,
        tenant: str | None = None,
        prefer: str | None = None,
        avoid: str | None = None,
        fetchable: bool = False,
        among: typing.Collection[str] | None = None,
        what: str = "a sandbox",
    ) -> WorkerHandle:
        """The worker a sandbox goes to (core.placement; the decision and its reason are logged);
        `worker_id`: only that one (the one keeping its volumes and drives); `template` None: any
        (an archived sandbox moving to another worker); `prefer`: the worker with affinity;
        `tenant`: whose sandbox (spread by tenant); `avoid`: never that one (the worker a drain
        moves the sandbox off); `fetchable`: `template` is a build in the object store, which every
        worker can fetch (worker.images.buildpack), so every worker counts as holding it; `among`:
        only these worker ids (a create from a stored snapshot: the workers reading its store)."""
        held = self.held()
        empty = placement.Commitment()
        candidates = []
        for h in self.workers.ready():
            assert h.info is not None
            if (worker_id is not None and h.id != worker_id) or h.id == avoid:
                continue
            if among is not None and h.id not in among:
                continue
            c = held.get(h.id, empty)
            candidates.append(
                placement.Candidate(
                    worker_id=h.id,
                    name=h.name,
                    memory_mb=h.info.capacity.memory_mb,
                    allocated_memory_mb=c.memory_mb,
                    templates=frozenset(h.templates)
                    | {b.build_id for b in h.builds.values() if b.status == "ready"}
                    | ({template} if fetchable and template else set()),
                    cpus=h.info.capacity.cpus,
                    allocated_cpus=c.cpus,
                    sandboxes=c.sandboxes,
                    tenant_sandboxes=c.by_tenant.get(tenant, 0) if tenant is not None else 0,
                    slots=h.info.capacity.slots,
                    allocated_slots=c.slots,
                )
            )
        if worker_id is not None and not candidates:
            raise errors.Unavailable(
                f"worker {worker_id}, which keeps this sandbox's volumes and drives, is not ready now; try again",
                code="no_worker",
            )
        decision = placement.decide(
            candidates, memory_mb=memory_mb, cpus=cpus, template=template, prefer=prefer
        )
        log.info(
            "placement: %s (%d MB, %s cpus, tenant %s) on %s: %s",
            what,
            memory_mb,
            cpus,
            tenant,
            decision.worker.name,
            decision.reason,
            extra={"worker": decision.worker.name, "candidates": len(candidates)},
        )
        return self.workers.get(decision.worker.worker_id)

    def track(self, task: asyncio.Task) -> None:
        """A deletion on a worker, in the background (`reaps`)."""
        self.reaps.add(task)
        task.add_done_callback(self.reaps.discard)
