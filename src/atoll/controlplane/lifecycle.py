"""Sandbox lifecycle orchestration: the core state machine walked against a worker, persisted first.

`SandboxManager` owns, per sandbox: one lock for lifecycle steps (create/pause/resume/delete; so a
delete during a pause waits for it, and concurrent callers share one resume), a count of in-flight
exec/file calls (a long-running command is activity) and the last activity time. `idle_loop` applies
the tier policy: running → memory after `idle_timeout_s`, memory → disk after `disk_after_s`.
Every transition is logged as `sandbox.<verb>.started/complete/failed` with its duration.
Called by controlplane.api; drives atoll.worker.service.Worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import time
import typing

from atoll.controlplane import db as dbm
from atoll.controlplane import metrics, schemas
from atoll.core import errors, ids
from atoll.core.lifecycle import TIER_ORDER, State, Tier, check_transition
from atoll.worker import service as workersvc

log = logging.getLogger(__name__)
WORKER_ID = "local"
POLICY_CONCURRENCY = 8  # idle-policy steps (gate, freeze, checkpoint) running at once
# Host task pressure (share of the sandbox's host pids limit, see Worker.task_pressure): past
# TASKS_COMPACT_AT an idle sandbox is checkpointed and restored in place (a fresh sentry sheds the
# leftover host tasks); past TASKS_KILL_AT its user processes are killed, busy or not, so that a
# fork bomb ends its processes rather than the sandbox.
TASKS_COMPACT_AT = 0.25  # one burst of 200 processes adds ~2,000 host tasks (a fifth of the limit)
TASKS_KILL_AT = 0.6  # above what ~512 live processes hold (~45%); a fork bomb adds ~900 a second
COMPACT_RETRY_S = 30.0
RELIEF_EVERY_S = 2.0  # the host tasks a kill leaves stay until a compaction: do not kill again at once


class SandboxManager:
    def __init__(self, database: dbm.Database, worker: workersvc.Worker, m: metrics.Metrics):
        self.db = database
        self.worker = worker
        self.m = m
        self._locks: dict[str, asyncio.Lock] = {}
        self._inflight: dict[str, int] = {}
        self._activity: dict[str, float] = {}
        self._cache: dict[str, dbm.SandboxRecord] = {}
        self._gate_retry: dict[str, float] = {}  # monotonic time before which a gated sandbox stays put
        self._tasks: set[asyncio.Task] = set()
        self._policy_steps: dict[str, asyncio.Task] = {}  # the idle policy's step running per sandbox
        self._policy_limit = asyncio.Semaphore(POLICY_CONCURRENCY)
        self._relief: dict[str, asyncio.Task] = {}  # user processes being killed (task pressure)
        self._compact_retry: dict[str, float] = {}  # monotonic time before which no compaction
        self._relieved_at: dict[str, float] = {}  # when the user processes were last killed
        self._compact_due: set[str] = set()  # relieved: compact before the next call starts
        self._compacting: dict[str, asyncio.Task] = {}
        self._reaps: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once the base template (layer and image) is prepared
        self.startup_error: str | None = None

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
        return [r for r in recs if all(r.metadata_.get(k) == v for k, v in metadata.items())]

    def _persist(self, rec: dbm.SandboxRecord, verb: str, **changes: typing.Any) -> None:
        new_state = check_transition(State(rec.state), verb)
        rec.state = new_state.value
        for k, v in changes.items():
            setattr(rec, k, v)
        # a delete must survive a power loss once acknowledged (the next start finishes it)
        self.db.save(rec, fields=["state", *changes], durable=verb == "delete")
        self._cache[rec.id] = rec

    @contextlib.asynccontextmanager
    async def _step(self, verb: str, sid: str):
        log.info("sandbox.%s.started", verb, extra={"sandbox_id": sid})
        t0 = time.perf_counter()
        try:
            yield
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
        log.info("sandbox.%s.complete", verb, extra={"sandbox_id": sid, "duration_ms": round(dur * 1000, 2)})
        self.m.lifecycle.labels(verb=verb, outcome="complete").observe(dur)

    def _fail(self, rec: dbm.SandboxRecord, cause: str, detail: str | None = None) -> None:
        """Mark the sandbox failed: `cause` goes on the record (callers see it), `detail` (runsc log
        lines, host paths) only to the log."""
        if rec.state in (State.DELETED, State.FAILED):
            return
        log.warning("sandbox.fail", extra={"sandbox_id": rec.id, "reason": cause, "detail": detail})
        self._persist(rec, "fail", failure_reason=cause, standby_tier=None)

    # ---- start / stop --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.worker.start()
        for rec in self.db.list(include_deleted=False):
            await self._reattach(rec)
        # Finish deletions a previous process did not complete and remove whatever of this
        # installation no live record owns (processes, runsc state, netns, cgroups, mounts, dirs),
        # before the API serves and before template images are built (they make unrecorded sandboxes).
        live = {r.id for r in self.db.list(include_deleted=False)}
        removed = await self.worker.sweep(live)
        if removed:
            log.info("start-up sweep removed %d runtime object(s) no live sandbox owns", len(removed))
        self._spawn(self._prebuild_templates())
        self._spawn(self.idle_loop())

    async def _prebuild_templates(self) -> None:
        try:
            await self.worker.prepare_template("base", schemas.DEFAULT_MEMORY_MB)
        except errors.AtollError as e:
            self.startup_error = e.message
        finally:
            self.ready.set()

    async def _reattach(self, rec: dbm.SandboxRecord) -> None:
        try:
            obs = await asyncio.wait_for(self.worker.reattach(rec.id), 180)
        except (errors.AtollError, TimeoutError, OSError) as e:
            obs = workersvc.Observed("failed", f"could not reattach after a restart: {e!r}")
        now = dbm.utcnow()
        self._cache[rec.id] = rec
        if rec.state == State.FAILED:
            pass  # failed is final until deleted, whatever the host still holds
        elif obs.phase == "running":
            if rec.state != State.RUNNING:
                rec.state, rec.standby_tier, rec.standby_reason = State.RUNNING.value, None, None
                self.db.save(rec)
            if obs.reason:
                log.info("sandbox.reattach.note", extra={"sandbox_id": rec.id, "note": obs.reason})
        elif obs.phase == "frozen":
            rec.state, rec.standby_tier = State.STANDBY.value, Tier.MEMORY.value
            rec.standby_since = rec.standby_since or now
            self.db.save(rec)
        elif obs.phase == "checkpointed":
            rec.state, rec.standby_tier = State.STANDBY.value, Tier.DISK.value
            rec.standby_since = rec.standby_since or now
            self.db.save(rec)
        elif rec.state != State.FAILED:
            rec.state, rec.standby_tier = State.FAILED.value, None
            rec.failure_reason = obs.reason or f"lost after a restart ({obs.phase})"
            self.db.save(rec)
        self._activity[rec.id] = time.monotonic()
        log.info(
            "sandbox.reattach.complete",
            extra={"sandbox_id": rec.id, "state": rec.state, "tier": rec.standby_tier},
        )

    async def stop(self) -> None:
        """Stop policy loops and let go of sandboxes; they keep running under runsc."""
        self._stopping.set()
        for t in [*self._tasks, *self._policy_steps.values()]:
            t.cancel()
        if self._reaps:  # deletions in flight get a few seconds; the next start finishes the rest
            await asyncio.wait(list(self._reaps), timeout=10)
        await self.worker.aclose()
        self.worker.remove_empty_cgroups()  # where no sandbox is left; running ones keep theirs

    def _spawn(self, coro: typing.Awaitable) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ---- create / delete -----------------------------------------------------------------------
    async def create(self, req: typing.Any) -> dbm.SandboxRecord:
        self.worker.templates.recipe(req.template)  # 404 template_not_found before any work
        sid = ids.new_sandbox_id()
        now = dbm.utcnow()
        rec = dbm.SandboxRecord(
            id=sid,
            tenant_id=ids.DEFAULT_TENANT,
            worker_id=WORKER_ID,
            state=State.CREATING.value,
            template=req.template,
            metadata_=dict(req.metadata),
            env=dict(req.env),
            user=req.user,
            memory_mb=req.memory_mb,
            cpus=req.cpus,
            disk_mb=req.disk_mb or self.worker.s.default_disk_mb,
            idle_timeout_s=req.idle_timeout_s,
            disk_after_s=req.disk_after_s,
            created_at=now,
            updated_at=now,
            last_activity_at=now,
        )
        self.db.add(rec)
        self._cache[sid] = rec
        env = dict(req.env)
        async with self._lock(sid), self._step("create", sid):
            try:
                await self.worker.create(
                    sid,
                    template=req.template,
                    env=env,
                    memory_mb=req.memory_mb,
                    cpus=req.cpus,
                    disk_mb=rec.disk_mb,
                )
            except errors.AtollError as e:
                self._fail(rec, e.message, e.detail)
                raise errors.RuntimeFailure(f"sandbox {sid} could not be started: {e.message}") from None
            self._persist(rec, "start")
            self._activity[sid] = time.monotonic()
        return rec

    async def delete(self, sid: str) -> None:
        rec = self.get(sid)
        async with self._lock(sid), self._step("delete", sid):
            rec = self.get(sid)
            self._persist(rec, "delete", deleted_at=dbm.utcnow(), standby_tier=None)
            self._cache.pop(sid, None)
            self._activity.pop(sid, None)
            for per_sandbox in (self._gate_retry, self._compact_retry, self._relieved_at):
                per_sandbox.pop(sid, None)
            self._compact_due.discard(sid)
        # runsc delete takes 1.5–2 s; the record is already gone for the caller.
        t = asyncio.ensure_future(self._reap(sid))
        self._reaps.add(t)
        t.add_done_callback(self._reaps.discard)

    async def _reap(self, sid: str) -> None:
        try:
            await self.worker.delete(sid)
        except Exception:
            log.exception("sandbox.reap.failed", extra={"sandbox_id": sid})
        self._locks.pop(sid, None)

    # ---- standby -------------------------------------------------------------------------------
    async def pause(self, sid: str, tier: Tier) -> dbm.SandboxRecord:
        self.get(sid)
        async with self._lock(sid):
            rec = self.get(sid)
            return await self._pause_locked(rec, tier)

    async def _pause_locked(self, rec: dbm.SandboxRecord, tier: Tier) -> dbm.SandboxRecord:
        sid = rec.id
        if rec.state == State.STANDBY:
            cur = Tier(rec.standby_tier)
            if cur == tier:
                return rec
            if TIER_ORDER[tier] < TIER_ORDER[cur]:
                raise errors.Conflict(
                    f"sandbox {sid} is in the {cur.value} tier; pausing to {tier.value} would need a resume "
                    f"first — call POST /v1/sandboxes/{sid}/resume, then pause",
                    code="invalid_state",
                )
        else:
            check_transition(State(rec.state), "pause")
            if self._inflight.get(sid):
                raise errors.SandboxBusy(
                    f"sandbox {sid} has {self._inflight[sid]} exec/file call(s) in progress; "
                    "wait for them to finish (or kill the process) and retry the pause"
                )
        if tier == Tier.MEMORY:
            async with self._step("pause_memory", sid):
                await self._guard(rec, self.worker.freeze(sid))
                self._persist(
                    rec,
                    "pause",
                    standby_tier=Tier.MEMORY.value,
                    standby_reason=None,
                    standby_since=dbm.utcnow(),
                )
            return rec
        # disk tier
        async with self._step("pause_disk", sid):
            was_frozen = rec.state == State.STANDBY
            if was_frozen:
                await self._guard(rec, self.worker.thaw(sid))
            gate = await self.worker.gate(sid)
            if not gate.ok:
                try:
                    await self._guard(rec, self.worker.freeze(sid))
                except errors.FreezeTimeout:
                    if was_frozen:  # thawed for the gate and could not be frozen again: it runs
                        self._persist(
                            rec, "resume", standby_tier=None, standby_reason=None, standby_since=None
                        )
                        self._activity[sid] = time.monotonic()
                    raise
                why = "kept in the memory tier: " + "; ".join(gate.blockers)
                self._persist(
                    rec,
                    "pause",
                    standby_tier=Tier.MEMORY.value,
                    standby_reason=why,
                    standby_since=rec.standby_since if was_frozen else dbm.utcnow(),
                )
                self._gate_retry[sid] = time.monotonic() + max(60.0, rec.disk_after_s)
                log.info("sandbox.pause_disk.gated", extra={"sandbox_id": sid, "reason": why})
                return rec
            await self._guard(rec, self.worker.checkpoint(sid))
            self._persist(
                rec, "pause", standby_tier=Tier.DISK.value, standby_reason=None, standby_since=dbm.utcnow()
            )
        return rec

    async def _guard(self, rec: dbm.SandboxRecord, aw: typing.Awaitable) -> typing.Any:
        """Run a worker step; an unexpected runtime failure marks the sandbox failed with its cause."""
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
            check_transition(State(rec.state), "resume")
            tier = Tier(rec.standby_tier)
            async with self._step(f"resume_{tier.value}", sid):
                done = functools.partial(
                    self._persist, rec, "resume", standby_tier=None, standby_reason=None, standby_since=None
                )
                if tier == Tier.MEMORY:
                    # the record is written while the thawed sandbox answers the health ping
                    await self._guard(rec, self.worker.thaw_and_ping(sid, timeout=10, while_waiting=done))
                else:
                    await self._guard(rec, self.worker.restore(sid))
                    done()
            self._activity[sid] = time.monotonic()
        return rec

    @contextlib.asynccontextmanager
    async def activity(self, sid: str):
        """Wrap an exec/file call: resume if in standby, count it as activity while it runs."""
        rec = self.get(sid)
        if rec.state == State.FAILED:
            raise errors.Conflict(
                f"sandbox {sid} has failed ({rec.failure_reason}); delete it and create a new one",
                code="invalid_state",
            )
        if sid in self._compact_due and not self._inflight.get(sid):
            # its user processes were just killed for host task pressure: shed the runtime's
            # leftover host tasks before anything runs again (a second fork bomb right after the
            # first would otherwise start from where the first left off)
            await self._compact_due_now(sid)
            rec = self.get(sid)
        self._inflight[sid] = self._inflight.get(sid, 0) + 1
        try:
            # A pause (or another step) in flight holds the lock: wait for it, then resume if needed,
            # so a call never reaches a sandbox that is being checkpointed under it.
            if rec.state != State.RUNNING or self._lock(sid).locked():
                await self.resume(sid)
            self._activity[sid] = time.monotonic()
            yield
        except errors.SandboxDied as e:
            self._fail(rec, e.message)
            raise
        finally:
            self._inflight[sid] -= 1
            self._activity[sid] = time.monotonic()

    # ---- policy loop ---------------------------------------------------------------------------
    async def idle_loop(self, interval: float = 0.5) -> None:
        while not self._stopping.is_set():
            try:
                await self._policy_pass()
            except Exception:
                log.exception("idle policy pass failed")
            await asyncio.sleep(interval)

    async def _policy_pass(self) -> None:
        """Decide, for every cached sandbox, whether a tier step is due, and run the due steps as
        tasks, at most POLICY_CONCURRENCY at once: one sandbox whose agent or runtime is slow (a
        stalled gate call) delays no other sandbox's standby. A sandbox with a step still running
        is skipped until that step ends."""
        now = time.monotonic()
        wall = dbm.utcnow()
        for sid, rec in list(self._cache.items()):
            pressure = self._task_pressure(sid) if rec.state == State.RUNNING else 0.0
            if (
                pressure >= TASKS_KILL_AT
                and sid not in self._relief
                and now - self._relieved_at.get(sid, -RELIEF_EVERY_S) >= RELIEF_EVERY_S
            ):
                self._relieved_at[sid] = now
                relief = asyncio.ensure_future(self._relieve(sid, pressure))
                self._relief[sid] = relief
                relief.add_done_callback(lambda _t, sid=sid: self._relief.pop(sid, None))
            if sid in self._policy_steps:
                continue
            lock = self._lock(sid)
            if lock.locked() or self._inflight.get(sid):
                continue
            if rec.state in (State.RUNNING, State.STANDBY) and not self._alive(sid):
                self._fail(rec, self.worker.death_cause(sid))
                log.warning("sandbox.died", extra={"sandbox_id": sid, "reason": rec.failure_reason})
                continue
            step: typing.Awaitable | None = None
            if (
                pressure >= TASKS_COMPACT_AT
                and sid not in self._relief
                and now >= self._compact_retry.get(sid, 0.0)
            ):
                step = self._compact(sid, pressure)
            elif rec.state == State.RUNNING and rec.idle_timeout_s > 0:
                idle_for = now - self._activity.get(sid, now)
                if idle_for >= rec.idle_timeout_s:
                    step = self._idle_to_memory(sid)
            elif (
                rec.state == State.STANDBY
                and rec.standby_tier == Tier.MEMORY
                and rec.disk_after_s > 0
                and rec.standby_since is not None
                and now >= self._gate_retry.get(sid, 0.0)  # a gated sandbox retries the gate later
            ):
                since = (
                    rec.standby_since
                    if rec.standby_since.tzinfo
                    else rec.standby_since.replace(tzinfo=dt.UTC)
                )
                if (wall - since).total_seconds() >= rec.disk_after_s:
                    step = self._policy_pause(sid, Tier.DISK)
            if step is not None:
                task = asyncio.ensure_future(self._policy_slot(step))
                self._policy_steps[sid] = task
                task.add_done_callback(lambda _t, sid=sid: self._policy_steps.pop(sid, None))

    async def _policy_slot(self, step: typing.Awaitable) -> None:
        async with self._policy_limit:
            try:
                await step
            except Exception:
                log.exception("idle policy step failed")

    async def _idle_to_memory(self, sid: str) -> None:
        gate = await self.worker.gate(sid)
        if gate.external_connections:
            self._activity[sid] = time.monotonic()  # an open connection is activity
            return
        await self._policy_pause(sid, Tier.MEMORY)

    async def _policy_pause(self, sid: str, tier: Tier) -> None:
        with contextlib.suppress(errors.AtollError):
            await self.pause(sid, tier)

    def _task_pressure(self, sid: str) -> float:
        try:
            return self.worker.task_pressure(sid)
        except errors.AtollError:
            return 0.0

    async def _relieve(self, sid: str, pressure: float) -> None:
        log.warning(
            "sandbox.tasks.relief",
            extra={"sandbox_id": sid, "reason": f"{pressure:.0%} of its host task limit in use"},
        )
        try:
            await self.worker.kill_user_processes(sid)
        except errors.AtollError as e:
            log.warning("sandbox.tasks.relief.failed", extra={"sandbox_id": sid, "error": e.message})
        self._compact_due.add(sid)

    async def _compact_due_now(self, sid: str) -> None:
        """One compaction, shared by the calls that arrive while it runs."""
        task = self._compacting.get(sid)
        if task is None:
            self._compact_due.discard(sid)
            task = asyncio.ensure_future(self._compact(sid, self._task_pressure(sid)))
            self._compacting[sid] = task
            task.add_done_callback(lambda _t: self._compacting.pop(sid, None))
        await asyncio.shield(task)

    async def _compact(self, sid: str, pressure: float) -> None:
        """Checkpoint and restore an idle sandbox in place to shed the host tasks its runtime kept
        (see Worker.task_pressure), when the gate allows it; its processes, memory and files go on."""
        if self.get(sid).state != State.RUNNING:  # failed or paused meanwhile
            return
        gate = await self.worker.gate(sid)
        if not gate.ok:
            self._compact_retry[sid] = time.monotonic() + COMPACT_RETRY_S
            log.info("sandbox.compact.gated", extra={"sandbox_id": sid, "reason": "; ".join(gate.blockers)})
            return
        log.info("sandbox.compact", extra={"sandbox_id": sid, "reason": f"{pressure:.0%} of its host tasks"})
        try:
            rec = await self.pause(sid, Tier.DISK)
            if rec.standby_tier != Tier.DISK:  # gated after all: it stays running, try later
                self._compact_retry[sid] = time.monotonic() + COMPACT_RETRY_S
        except errors.AtollError as e:
            self._compact_retry[sid] = time.monotonic() + COMPACT_RETRY_S
            log.info("sandbox.compact.skipped", extra={"sandbox_id": sid, "error": e.message})
        with contextlib.suppress(errors.AtollError):  # (a delete may have come in between)
            if self.get(sid).state == State.STANDBY:
                await self.resume(sid)

    def _alive(self, sid: str) -> bool:
        try:
            return self.worker.alive(sid)
        except errors.AtollError:
            return True  # no runtime yet (creating elsewhere); nothing to judge

    def counts(self) -> dict[str, int]:
        return self.db.count_by_state()
