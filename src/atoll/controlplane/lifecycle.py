"""Sandbox lifecycle: the core state machine walked against the workers, persisted first.

`SandboxManager` owns the records and, per sandbox, one lock for lifecycle steps (create, pause,
resume, delete: a delete during a pause waits for it, concurrent callers share one resume), the
count of calls in flight (a long-running command is activity) and the last activity time. It talks
to each sandbox's worker only through the seam (core.worker_api), which says what a step reached;
every record change goes through `check_transition` — steps, worker events and reconciliation
alike. Reconciliation (`worker_joined`, at each worker's adoption and periodically) makes the
records follow what the worker really holds: a record whose runtime vanished becomes failed, a
runtime no live record owns is deleted, an unacknowledged create is adopted or dropped.
Every step is logged as `sandbox.<verb>.started/complete/failed` with its duration.
Called by the API routers and controlplane.policy; it is the listener of controlplane.workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import typing

from atoll.controlplane import db as dbm
from atoll.controlplane import lifetime, metrics, schemas
from atoll.controlplane.authority import Authority
from atoll.controlplane.pools import Pools
from atoll.controlplane.secrets import SecretStore
from atoll.controlplane.templates import TemplateService
from atoll.controlplane.workers import WorkerHandle, WorkerRegistry
from atoll.core import errors, ids, netpolicy, placement, preview
from atoll.core import worker_api as api
from atoll.core.lifecycle import (
    FAILED,
    PUBLIC_STATUS,
    TIER_ORDER,
    Phase,
    State,
    Status,
    Tier,
    Verb,
    check_transition,
    path_to,
    status,
)

log = logging.getLogger(__name__)

RESUME_STEP = {Tier.MEMORY: "resume_memory", Tier.DISK: "resume_disk"}
MAX_RESUME_FAILURES = 3
"""Failed resumes from the disk tier in a row after which a sandbox is failed (its files kept)."""


class SandboxManager:
    def __init__(
        self,
        database: dbm.Database,
        m: metrics.Metrics,
        *,
        lost_after_s: float = 15.0,
        reconcile_s: float = 30.0,
        default_network: dict | None = None,
        secrets: SecretStore | None = None,
        authority: Authority | None = None,
    ):
        self.db = database
        self.secrets = secrets
        """The secret store (None: this manager takes no secrets, as in some tests)."""
        self.authority = authority
        """The installation's CA (None: sandboxes get no CA and no HTTPS interception)."""
        self.m = m
        self.default_network = netpolicy.parse(default_network).to_wire()
        """The installation's egress policy for a sandbox created without one."""
        self.workers = WorkerRegistry(database, self, lost_after_s=lost_after_s, reconcile_s=reconcile_s)
        self._locks: dict[str, asyncio.Lock] = {}
        self._inflight: dict[str, int] = {}
        self._activity: dict[str, float] = {}
        self._cache: dict[str, dbm.SandboxRecord] = {}
        self.usage: dict[str, api.Usage] = {}
        self._reaps: set[asyncio.Task] = set()
        self.templates = TemplateService(self, schemas.DEFAULT_MEMORY_MB)
        """User templates and their builds."""
        self.pools = Pools(self, self.templates, schemas.DEFAULT_MEMORY_MB)
        """Warm pools a create claims from."""
        self.templates.on_ready = self.pools.wake

    # ---- records -------------------------------------------------------------------------------
    def _lock(self, sid: str) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    def get(self, sid: str) -> dbm.SandboxRecord:
        if not ids.is_sandbox_id(sid):
            raise errors.InvalidRequest(
                f"malformed sandbox id {sid!r}: ids look like 'sb-' followed by 16 lower-case letters/digits"
            )
        rec = self._cache.get(sid) or self.db.get(sid)
        if rec is None or rec.state == State.DELETED:
            raise errors.SandboxNotFound(
                f"sandbox {sid} does not exist (or was deleted); list yours with GET /v1/sandboxes"
            )
        self._cache[sid] = rec
        return rec

    def list(self, state: str | None, metadata: dict[str, str]) -> list[dbm.SandboxRecord]:
        if state is not None and state not in {s.value for s in State}:
            raise errors.InvalidRequest(
                f"unknown state filter {state!r}; use one of: {', '.join(s.value for s in State)}"
            )
        recs = self.db.list(tenant_id=ids.DEFAULT_TENANT, state=state)
        return [r for r in recs if not r.pooled and all(r.metadata_.get(k) == v for k, v in metadata.items())]

    def live(self) -> list[dbm.SandboxRecord]:
        return list(self._cache.values())

    def _persist(self, rec: dbm.SandboxRecord, verb: Verb, **changes: typing.Any) -> None:
        new = check_transition(status(rec.state, rec.standby_tier), verb)
        rec.state = new.state.value
        rec.standby_tier = new.tier.value if new.tier else None
        if new.state != State.STANDBY:
            rec.standby_reason, rec.standby_since = None, None
        for k, v in changes.items():
            setattr(rec, k, v)
        fields = ["state", "standby_tier", "standby_reason", "standby_since", *changes]
        # a delete must survive a power loss once acknowledged (the next start finishes it)
        self.db.save(rec, fields=list(dict.fromkeys(fields)), durable=verb == Verb.DELETE)
        if new.state == State.DELETED:
            self._forget(rec.id)
        else:
            self._cache[rec.id] = rec

    def _forget(self, sid: str) -> None:
        self._cache.pop(sid, None)
        self._activity.pop(sid, None)
        self.usage.pop(sid, None)

    @contextlib.asynccontextmanager
    async def _step(self, verb: str, sid: str):
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
            self.m.lifecycle.labels(verb=verb, outcome="failed").observe(dur)
            raise
        dur = time.perf_counter() - t0
        log.info(
            "sandbox.%s.complete",
            verb,
            extra={"sandbox_id": sid, "duration_ms": round(dur * 1000, 2), **fields},
        )
        self.m.lifecycle.labels(verb=verb, outcome="complete").observe(dur)

    def _fail(self, rec: dbm.SandboxRecord, cause: str, detail: str | None = None) -> None:
        """Mark the sandbox failed: `cause` goes on the record (callers see it), `detail` (runsc log
        lines, host paths) only to the log."""
        if rec.state in (State.DELETED, State.FAILED):
            return
        log.warning("sandbox.fail", extra={"sandbox_id": rec.id, "reason": cause, "detail": detail})
        self._persist(rec, Verb.FAIL, failure_reason=cause)

    def fail_lost(self, rec: dbm.SandboxRecord, cause: str) -> None:
        """A sandbox whose worker is gone for good."""
        self._fail(rec, cause)

    def worker(self, rec: dbm.SandboxRecord) -> api.WorkerAPI:
        return self.workers.api_for(rec.worker_id)

    def allocated(self, worker_id: str) -> dict[str, float]:
        """What the live records on a worker hold: memory of those in RAM (running, memory tier,
        being created), CPUs of those running, disk of all."""
        mem = cpus = disk = 0.0
        count = 0
        for rec in self._cache.values():
            if rec.worker_id != worker_id:
                continue
            count += 1
            disk += rec.disk_mb
            if rec.state in (State.CREATING, State.RUNNING) or rec.standby_tier == Tier.MEMORY:
                mem += rec.memory_mb
            if rec.state in (State.CREATING, State.RUNNING):
                cpus += rec.cpus
        return {"memory_mb": int(mem), "cpus": round(cpus, 3), "disk_mb": int(disk), "sandboxes": count}

    # ---- start / stop --------------------------------------------------------------------------
    async def start(self) -> None:
        for rec in self.db.list(include_deleted=False):
            self._cache[rec.id] = rec
            self._activity[rec.id] = time.monotonic()
        self.workers.load()
        self.pools.start()

    async def stop(self) -> None:
        """Let go of the workers; sandboxes keep running. Deletions in flight get a few seconds
        (the worker, or the next reconciliation, finishes the rest)."""
        await self.pools.aclose()
        if self._reaps:
            await asyncio.wait(list(self._reaps), timeout=10)
        await self.workers.aclose()

    # ---- create / delete -----------------------------------------------------------------------
    async def create(self, req: typing.Any, *, pooled: bool = False) -> dbm.SandboxRecord:
        """A new sandbox: from a warm pool when the template has one ready (claimed: the caller's
        settings applied after the restore), else restored from its template's snapshot on a
        worker placement picks. `pooled`: made for the pool (not listed until claimed)."""
        build = self.templates.serving(req.template)
        if build is not None and not pooled:
            claimed = await self.pools.claim(req, build)
            if claimed is not None:
                return claimed
        network = (
            netpolicy.parse(req.network.model_dump()).to_wire() if req.network else dict(self.default_network)
        )
        requested = getattr(req, "secrets", None)
        if requested and self.secrets is None:
            raise errors.InvalidRequest("this server keeps no secrets; create the sandbox without `secrets`")
        bound = (
            self.secrets.placeholders(ids.DEFAULT_TENANT, requested, dict(req.env)) if self.secrets else {}
        )
        handle = self._place(build.id if build is not None else req.template, req.memory_mb)
        assert handle.info is not None
        sid = ids.new_sandbox_id()
        now = dbm.utcnow()
        rec = dbm.SandboxRecord(
            id=sid,
            tenant_id=ids.DEFAULT_TENANT,
            worker_id=handle.id,
            state=State.CREATING.value,
            template=req.template,
            metadata_=dict(req.metadata),
            env=dict(req.env),
            user=req.user or ((build.info or {}).get("user") if build is not None else None),
            shell=getattr(req, "shell", None),
            network=network,
            secrets=bound or None,
            memory_mb=req.memory_mb,
            cpus=req.cpus,
            disk_mb=req.disk_mb or handle.info.default_disk_mb,
            idle_timeout_s=req.idle_timeout_s,
            disk_after_s=req.disk_after_s,
            created_at=now,
            updated_at=now,
            last_activity_at=now,
            build_id=build.id if build is not None else None,
            workdir=(build.info or {}).get("workdir") if build is not None else None,
            pooled=pooled,
            expires_at=None if pooled else lifetime.deadline(getattr(req, "timeout_s", None), now),
            on_timeout=getattr(req, "on_timeout", "pause"),
        )
        spec = api.SandboxSpec(
            sandbox_id=sid,
            template=req.template,
            memory_mb=req.memory_mb,
            cpus=req.cpus,
            disk_mb=rec.disk_mb,
            env={**req.env, **{var: b["placeholder"] for var, b in bound.items()}},
            user=req.user,
            network=network,
            secrets=self.secrets.bindings(ids.DEFAULT_TENANT, bound) if self.secrets and bound else (),
            trust_pem=self.authority.root_pem.decode() if self.authority else "",
            build_id=build.id if build is not None else "",
        )
        async with self._lock(sid), self._step("create", sid):
            self.db.add(rec)  # the record exists before the runtime does (placement is recorded)
            self._cache[sid] = rec
            try:
                await self.workers.api_for(handle.id).create(spec)
            except errors.Unavailable as e:
                self._fail(rec, f"its worker {handle.name!r} became unreachable during the create")
                raise errors.Unavailable(f"sandbox {sid} could not be created: {e.message}") from None
            except errors.AtollError as e:
                self._fail(rec, e.message, e.detail)
                if isinstance(e, errors.NotFound | errors.InvalidRequest):
                    raise
                raise errors.RuntimeFailure(f"sandbox {sid} could not be started: {e.message}") from None
            self._persist(rec, Verb.START)
            self._activity[sid] = time.monotonic()
        return rec

    async def set_network(self, sid: str, body: object) -> dict:
        """Replace a sandbox's egress policy, live (its worker's gateway applies it to new
        connections and DNS questions at once; no resume needed)."""
        network = netpolicy.parse(body).to_wire()
        async with self._lock(sid):
            rec = self.get(sid)
            if rec.state in (State.FAILED, State.DELETED, State.CREATING):
                raise errors.Conflict(
                    f"sandbox {sid} is {rec.state}; its network can change while it runs or is in standby",
                    code="invalid_state",
                )
            stored = await self.worker(rec).set_network(sid, network)
            rec.network = stored
            self.db.save(rec, fields=["network"])
        log.info("sandbox.network.updated", extra={"sandbox_id": sid, **stored})
        return stored

    async def secret_changed(self, name: str) -> None:
        """A secret was replaced or deleted: every live sandbox bound to it gets its bindings
        again (a worker that cannot be reached now gets them when it is adopted again)."""
        if self.secrets is None:
            return
        for rec in self.live():
            if not rec.secrets or not any(b.get("secret") == name for b in rec.secrets.values()):
                continue
            try:
                await self.worker(rec).set_secrets(rec.id, self.secrets.bindings(rec.tenant_id, rec.secrets))
            except errors.AtollError as e:
                log.warning(
                    "secret change not delivered to its sandbox (it is delivered when its worker is adopted again): %s",
                    e.message,
                    extra={"sandbox_id": rec.id, "secret": name},
                )

    async def configure_worker(self, handle: WorkerHandle, worker: api.WorkerAPI) -> None:
        """At adoption: the worker's CA (an intermediate of the installation's) and the secret
        bindings of its live sandboxes (a worker keeps them in memory only)."""
        if self.authority is not None:
            await worker.set_authority(self.authority.for_worker(handle.name))
        if self.secrets is None:
            return
        for rec in self.live():
            if rec.worker_id == handle.id and rec.secrets and rec.state != State.CREATING:
                try:
                    await worker.set_secrets(rec.id, self.secrets.bindings(rec.tenant_id, rec.secrets))
                except errors.AtollError as e:
                    log.warning("secret bindings not delivered: %s", e.message, extra={"sandbox_id": rec.id})

    def set_preview(self, sid: str, port: int, public: bool) -> dbm.SandboxRecord:
        try:
            preview.check_port(port)
        except preview.BadTarget as e:
            raise errors.InvalidRequest(str(e)) from None
        rec = self.get(sid)
        if rec.state in (State.DELETED,):
            raise errors.SandboxNotFound(f"sandbox {sid} was deleted")
        ports = set((rec.previews or {}).get("public", []))
        (ports.add if public else ports.discard)(port)
        rec.previews = {"public": sorted(ports)}
        self.db.save(rec, fields=["previews"])
        log.info("sandbox.preview.updated", extra={"sandbox_id": sid, "port": port, "public": public})
        return rec

    def _place(self, template: str, memory_mb: int) -> WorkerHandle:
        candidates = []
        for h in self.workers.ready():
            assert h.info is not None
            candidates.append(
                placement.Candidate(
                    worker_id=h.id,
                    name=h.name,
                    memory_mb=h.info.capacity.memory_mb,
                    allocated_memory_mb=int(self.allocated(h.id)["memory_mb"]),
                    templates=frozenset(h.templates)
                    | {b.build_id for b in h.builds.values() if b.status == "ready"},
                )
            )
        choice = placement.choose(candidates, memory_mb=memory_mb, template=template)
        return self.workers.get(choice.worker_id)

    async def delete(self, sid: str) -> None:
        rec = self.get(sid)
        async with self._lock(sid), self._step("delete", sid):
            rec = self.get(sid)
            worker_id = rec.worker_id
            self._persist(rec, Verb.DELETE, deleted_at=dbm.utcnow())
        # runsc delete takes 1.5–2 s; the record is already gone for the caller.
        t = asyncio.ensure_future(self._reap(sid, worker_id))
        self._reaps.add(t)
        t.add_done_callback(self._reaps.discard)

    async def _reap(self, sid: str, worker_id: str) -> None:
        try:
            await self.workers.api_for(worker_id).delete(sid)
        except errors.Unavailable as e:
            log.info("sandbox.reap.deferred: %s", e.message, extra={"sandbox_id": sid})
        except Exception:
            log.exception("sandbox.reap.failed", extra={"sandbox_id": sid})
        if not self._lock(sid).locked():
            self._locks.pop(sid, None)
        self._inflight.pop(sid, None)

    # ---- standby -------------------------------------------------------------------------------
    async def pause(self, sid: str, tier: Tier, *, only_if_idle: bool = False) -> dbm.SandboxRecord:
        self.get(sid)
        async with self._lock(sid):
            return await self._pause_locked(self.get(sid), tier, only_if_idle)

    async def _pause_locked(
        self, rec: dbm.SandboxRecord, tier: Tier, only_if_idle: bool
    ) -> dbm.SandboxRecord:
        sid = rec.id
        cur = status(rec.state, rec.standby_tier)
        if cur.state == State.STANDBY:
            assert cur.tier is not None
            if cur.tier == tier:
                return rec
            if TIER_ORDER[tier] < TIER_ORDER[cur.tier]:
                raise errors.Conflict(
                    f"sandbox {sid} is in the {cur.tier.value} tier; pausing to {tier.value} would need a "
                    f"resume first — call POST /v1/sandboxes/{sid}/resume, then pause",
                    code="invalid_state",
                )
        else:
            check_transition(cur, Verb.FREEZE if tier == Tier.MEMORY else Verb.CHECKPOINT)
            if self._inflight.get(sid):
                raise errors.SandboxBusy(
                    f"sandbox {sid} has {self._inflight[sid]} exec/file call(s) in progress; "
                    "wait for them to finish (or kill the process) and retry the pause"
                )
        async with self._step(f"pause_{tier.value}", sid):
            outcome = await self._guard(rec, self.worker(rec).pause(sid, tier, only_if_idle=only_if_idle))
            self._apply_pause(rec, cur, outcome)
        if outcome.busy:
            raise errors.SandboxBusy(outcome.reason or f"sandbox {sid} could not be paused now; retry")
        return rec

    def _apply_pause(self, rec: dbm.SandboxRecord, before: Status, outcome: api.PauseOutcome) -> None:
        now = dbm.utcnow()
        if outcome.tier is None:
            if before.state == State.STANDBY:  # thawed for the gate and not frozen again: it runs
                self._persist(rec, Verb.RESUME)
            if not outcome.busy:  # declined: it is active (open connections)
                self._activity[rec.id] = time.monotonic()
            return
        since = rec.standby_since if before.state == State.STANDBY else now
        if before == status(State.STANDBY, outcome.tier):  # stayed (a gated disk pause from memory)
            rec.standby_reason = outcome.reason
            self.db.save(rec, fields=["standby_reason"])
            return
        self._persist(
            rec,
            Verb.FREEZE if outcome.tier == Tier.MEMORY else Verb.CHECKPOINT,
            standby_reason=outcome.reason,
            standby_since=since,
        )

    async def _guard(self, rec: dbm.SandboxRecord, aw: typing.Awaitable) -> typing.Any:
        """Run a worker step; a runtime failure marks the sandbox failed with its cause (an
        unreachable worker does not: nothing is known about the sandbox then)."""
        try:
            return await aw
        except (errors.RuntimeFailure, errors.SandboxDied) as e:
            self._fail(rec, e.message, e.detail)
            raise

    async def resume(self, sid: str) -> dbm.SandboxRecord:
        rec = self.get(sid)
        if rec.state == State.RUNNING and not self._lock(sid).locked():
            self._activity[sid] = time.monotonic()
            return rec
        async with self._lock(sid):
            rec = self.get(sid)
            if rec.state == State.RUNNING:  # someone else resumed it while we waited: share it
                return rec
            cur = status(rec.state, rec.standby_tier)
            check_transition(cur, Verb.RESUME)
            assert cur.tier is not None
            async with self._step(RESUME_STEP[cur.tier], sid) as fields:
                call = asyncio.ensure_future(self.worker(rec).resume(sid))
                if cur.tier == Tier.MEMORY:
                    # the record is written while the thawed sandbox wakes and answers: a runtime
                    # failure then marks it failed from running; any other error puts it back.
                    # Two turns of the loop let the call get that far first: an in-process worker
                    # sends its health ping (one turn) and thaws (the next), a remote one's request
                    # is on the wire. Writing before the thaw instead cost ~1 ms per resume.
                    for _ in range(2):
                        await asyncio.sleep(0)
                    since, reason = rec.standby_since, rec.standby_reason
                    self._persist(rec, Verb.RESUME)
                    try:
                        outcome = await self._guard(rec, call)
                    except errors.AtollError as e:
                        if rec.state == State.RUNNING and not isinstance(
                            e, errors.RuntimeFailure | errors.SandboxDied
                        ):
                            self._persist(rec, Verb.FREEZE, standby_since=since, standby_reason=reason)
                        raise
                else:
                    try:
                        outcome = await self._guard(rec, call)
                    except errors.ResumeFailed as e:
                        raise self.resume_failed(rec, e.message, e.detail) from None
                    self._persist(rec, Verb.RESUME, resume_error=None, resume_failures=0)
                fields["worker_ms"] = outcome.duration_ms  # the worker's own part of the resume
            self._activity[sid] = time.monotonic()
        return rec

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
            self._persist(rec, Verb.FAIL, failure_reason=reason, resume_error=cause, resume_failures=tries)
            return errors.SandboxDied(reason)
        rec.resume_error, rec.resume_failures = cause, tries
        self.db.save(rec, fields=["resume_error", "resume_failures"])
        return errors.ResumeFailed(
            f"sandbox {rec.id} could not be resumed from disk (try {tries} of {MAX_RESUME_FAILURES}): "
            f"{cause}; it stays in standby with its files and memory image — call again to retry"
        )

    @contextlib.asynccontextmanager
    async def activity(self, sid: str):
        """Wrap an exec/file call: resume if in standby, count it as activity while it runs."""
        rec = self.get(sid)
        if rec.state == State.FAILED:
            raise errors.Conflict(
                f"sandbox {sid} has failed ({rec.failure_reason}); delete it and create a new one",
                code="invalid_state",
            )
        self._inflight[sid] = self._inflight.get(sid, 0) + 1
        try:
            # A pause (or another step) in flight holds the lock: wait for it, then resume if needed,
            # so a call never reaches a sandbox that is being checkpointed under it.
            if rec.state != State.RUNNING or self._lock(sid).locked():
                rec = await self.resume(sid)
            self._activity[sid] = time.monotonic()
            yield self.worker(rec)
        except errors.SandboxDied as e:
            self._fail(rec, e.message)
            raise
        finally:
            self._inflight[sid] = self._inflight.get(sid, 1) - 1
            self._activity[sid] = time.monotonic()

    def idle_for(self, sid: str, now: float) -> float:
        return now - self._activity.get(sid, now)

    def busy(self, sid: str) -> bool:
        return bool(self._inflight.get(sid)) or self._lock(sid).locked()

    # ---- reconciliation and worker events ------------------------------------------------------
    async def worker_joined(self, handle: WorkerHandle, inventory: api.Inventory, started: float) -> None:
        """Make the records of `handle`'s sandboxes follow its inventory (taken at `started`, a
        UTC timestamp): records changed since are left for the next pass."""
        for b in list(handle.builds.values()):  # builds that moved while nobody listened
            self.templates.on_build(handle.id, b)
        held = {r.sandbox_id: r for r in inventory.runtimes}
        for rec in [r for r in self._cache.values() if r.worker_id == handle.id]:
            report = held.pop(rec.id, None)
            if self._lock(rec.id).locked() or _changed_since(rec, started):
                continue
            if report is None:
                self._vanished(rec, handle)
            elif not report.busy:
                self._follow(rec, report, handle)
        orphans = [r for r in held.values() if not r.busy and self._orphan(r.sandbox_id)]
        for r in orphans:
            log.info(
                "reconcile: deleting a runtime no live record owns",
                extra={"sandbox_id": r.sandbox_id, "worker": handle.name, "phase": r.phase.value},
            )
        if orphans and handle.worker is not None:
            worker = handle.worker
            results = await asyncio.gather(
                *(worker.delete(r.sandbox_id) for r in orphans), return_exceptions=True
            )
            for r, res in zip(orphans, results, strict=True):
                if isinstance(res, BaseException):
                    log.warning("reconcile: deleting %s failed: %r", r.sandbox_id, res)

    def _orphan(self, sid: str) -> bool:
        if sid in self._cache or self._lock(sid).locked():
            return False
        rec = self.db.get(sid)
        return rec is None or rec.state == State.DELETED

    def _vanished(self, rec: dbm.SandboxRecord, handle: WorkerHandle) -> None:
        if rec.state == State.FAILED:
            return
        if rec.state == State.CREATING:
            # a create whose worker never made the runtime (the server stopped before it asked):
            # it was never acknowledged, so nothing of it is kept
            log.info(
                "reconcile: dropping an unfinished create",
                extra={"sandbox_id": rec.id, "worker": handle.name},
            )
            self._persist(
                rec,
                Verb.DELETE,
                deleted_at=dbm.utcnow(),
                failure_reason="the create was interrupted before the worker made the sandbox",
            )
            return
        self._fail(
            rec,
            f"its runtime is gone from worker {handle.name!r} (found by reconciliation); "
            "delete it and create a new one",
        )

    def _follow(self, rec: dbm.SandboxRecord, report: api.RuntimeReport, handle: WorkerHandle) -> None:
        observed = PUBLIC_STATUS[report.phase]
        current = status(rec.state, rec.standby_tier)
        if current == FAILED or observed == current:
            return
        if observed == FAILED:
            self._fail(rec, report.failure or f"its runtime failed on worker {handle.name!r}")
            return
        try:
            verbs = path_to(current, observed)
        except errors.Conflict:
            log.warning(
                "reconcile: no transition from %s to %s", current, observed, extra={"sandbox_id": rec.id}
            )
            return
        log.info(
            "reconcile: %s -> %s", current, observed, extra={"sandbox_id": rec.id, "worker": handle.name}
        )
        for verb in verbs:
            changes = {"standby_since": dbm.utcnow()} if verb in (Verb.FREEZE, Verb.CHECKPOINT) else {}
            self._persist(rec, verb, **changes)
        self._activity[rec.id] = time.monotonic()

    async def worker_event(self, handle: WorkerHandle, ev: api.WorkerEvent) -> None:
        if isinstance(ev, api.BuildChanged):
            self.templates.on_build(handle.id, ev.build)
            return
        if isinstance(ev, api.UsageReport):
            for u in ev.items:
                if u.sandbox_id in self._cache:
                    self.usage[u.sandbox_id] = u
            return
        sid = getattr(ev, "sandbox_id", None)
        rec = self._cache.get(sid) if sid else None
        if rec is None or rec.worker_id != handle.id:
            return
        if isinstance(ev, api.SandboxDied):
            self._fail(rec, ev.cause)
        elif isinstance(ev, api.SandboxActivity):
            self._activity[rec.id] = time.monotonic()
        elif isinstance(ev, api.RuntimeChanged) and not self._lock(rec.id).locked():
            self._follow(rec, api.RuntimeReport(rec.id, ev.phase, 0), handle)
            if ev.phase == Phase.CHECKPOINTED and ev.reason and rec.standby_tier == Tier.DISK:
                self.resume_failed(rec, ev.reason)  # a restore of the worker's own (a compaction)

    def counts(self) -> dict[str, int]:
        return self.db.count_by_state()


def _changed_since(rec: dbm.SandboxRecord, started: float) -> bool:
    t = rec.updated_at
    if t is None:
        return False
    if t.tzinfo is None:  # SQLite hands datetimes back naive; they are UTC
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp() > started
