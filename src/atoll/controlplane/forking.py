"""`POST /v1/sandboxes/{id}/fork`: N copies of a running sandbox, made by its worker from one
checkpoint (WorkerAPI.fork); the parent keeps running.

The copies are recorded before the worker makes them (state creating, on the parent's worker, the
parent's template, build, limits, env, egress policy and secret placeholders — their bindings are
given to the worker right after), and become running when it answers; each copy's lock is held
meanwhile, so a reconciliation with the worker (whose inventory does not hold them yet) leaves them
alone. A fork the checkpoint gate
refuses answers 409 `checkpoint_refused` with the reason, and no record remains; a worker without
N free slots (`atoll worker --slots`) refuses it with 503 `no_worker`. Called by
controlplane.routes_sandboxes.
"""

from __future__ import annotations

import contextlib
import time
import typing

from atoll.controlplane import db as dbm
from atoll.core import errors, ids
from atoll.core.lifecycle import Phase, State, Verb

if typing.TYPE_CHECKING:
    from atoll.controlplane.ledger import Ledger, Steps

MAX_COUNT = 50


async def _parent_after_failure(m: Ledger, rec: dbm.SandboxRecord, worker, e: errors.AtollError) -> None:
    """A fork failed: the parent is failed only if its worker says so (a copy that could not
    start — a full disk, say — leaves the parent running, restored from its own image); a parent
    whose own restore failed stays checkpointed: in disk standby, its resume error noted."""
    try:
        inv = await worker.inventory()
    except errors.AtollError:
        return  # unknown: the next reconciliation decides
    report = next((r for r in inv.runtimes if r.sandbox_id == rec.id), None)
    if report is None or report.phase == Phase.FAILED:
        m.fail(rec, (report.failure if report is not None else None) or e.message, e.detail)
    elif report.phase == Phase.CHECKPOINTED and rec.state == State.RUNNING:
        m.persist(rec, Verb.CHECKPOINT, standby_since=dbm.utcnow())
        m.resume_failed(rec, e.message, e.detail)


def check_count(body: object) -> int:
    count = body.get("count", 1) if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) - {"count"}:
        raise errors.InvalidRequest('the fork body must be {"count": N} (N from 1 to 50)')
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise errors.InvalidRequest(f"count={count!r} must be an integer from 1 to {MAX_COUNT}")
    return count


def running_idle(m: Ledger, sid: str, verb: str) -> dbm.SandboxRecord:
    """Under the sandbox's lock, before a fork or a snapshot (`verb`): its record, refused (409)
    unless it runs with no exec/file call in progress."""
    rec = m.get(sid)
    if rec.state != State.RUNNING:
        raise errors.Conflict(f"sandbox {sid} is {rec.state}; {verb} it while it runs", code="invalid_state")
    if m.inflight.get(sid):
        raise errors.SandboxBusy(
            f"sandbox {sid} has {m.inflight[sid]} exec/file call(s) in progress; {verb} it when they finish"
        )
    return rec


async def fork(m: Ledger, steps: Steps, sid: str, count: int) -> list[dbm.SandboxRecord]:
    rec = m.get(sid)
    if rec.state == State.FAILED:
        raise errors.Conflict(
            f"sandbox {sid} has failed ({rec.failure_reason}); it cannot be forked", code="invalid_state"
        )
    if rec.state != State.RUNNING:
        rec = await steps.resume(sid)
    async with m.lock(sid), m.step("fork", sid) as fields:
        rec = running_idle(m, sid, "fork")
        m.slots_left(rec.worker_id, count)  # the copies start on the parent's worker, a slot each
        now = dbm.utcnow()
        copies = []
        for _ in range(count):
            c = dbm.SandboxRecord(
                id=ids.new_sandbox_id(),
                tenant_id=rec.tenant_id,
                worker_id=rec.worker_id,
                state=State.CREATING.value,
                template=rec.template,
                metadata_={**rec.metadata_, "atoll.forked_from": sid},
                env=dict(rec.env),
                user=rec.user,
                shell=rec.shell,
                network=rec.network,
                secrets=rec.secrets,
                memory_mb=rec.memory_mb,
                cpus=rec.cpus,
                disk_mb=rec.disk_mb,
                idle_timeout_s=rec.idle_timeout_s,
                disk_after_s=rec.disk_after_s,
                archive_after_s=rec.archive_after_s or 0.0,
                created_at=now,
                updated_at=now,
                last_activity_at=now,
                build_id=rec.build_id,
                workdir=rec.workdir,
                pooled=False,
                expires_at=rec.expires_at,  # a copy never outlives its parent's bound (lifetime)
                on_timeout=rec.on_timeout,
                on_worker_lost=rec.on_worker_lost,
                compat=dict(rec.compat) if rec.compat else None,
            )
            copies.append(c)
        async with contextlib.AsyncExitStack() as held:
            # each copy's lock until it is recorded running: a reconciliation with the worker
            # meanwhile (its inventory does not hold the copies yet) would drop them as creates
            # its worker never made
            for c in copies:
                await held.enter_async_context(m.lock(c.id))
                m.db.add(c)
                m.cache[c.id] = c
            return await _make(m, rec, copies, fields)


async def _make(
    m: Ledger, rec: dbm.SandboxRecord, copies: list[dbm.SandboxRecord], fields: dict
) -> list[dbm.SandboxRecord]:
    """Have the worker make the recorded `copies` of `rec`, and record them running."""
    sid = rec.id
    worker = m.worker(rec)
    try:
        outcome = await worker.fork(sid, [c.id for c in copies])
    except BaseException as e:
        for c in copies:
            m.persist(c, Verb.DELETE, deleted_at=dbm.utcnow(), failure_reason="the fork failed")
        if isinstance(
            e,
            errors.RuntimeFailure | errors.SandboxDied | errors.InsufficientStorage | errors.ResumeFailed,
        ):
            await _parent_after_failure(m, rec, worker, e)
        raise
    fields["worker_ms"] = outcome.duration_ms
    fields["checkpoint_ms"] = outcome.checkpoint_ms
    for c in copies:
        if c.state == State.CREATING:  # a RuntimeChanged event of the copy's restore may have come first
            m.persist(c, Verb.START)
        m.activity[c.id] = m.activity[sid] = time.monotonic()
        if c.secrets and m.secrets is not None:
            await worker.set_secrets(c.id, m.secrets.bindings(c.tenant_id, c.secrets))
    return copies
