"""Named snapshots (issue 22): a running sandbox's state kept on its worker, from which sandboxes
are created any number of times — the half of a fork that is kept instead of run
(worker.runtimes.forks).

`take` snapshots a sandbox (resumed first if it is in standby): its worker checkpoints and
restores it as a fork does (refused the same way: volumes or drives mounted, the checkpoint gate's
blockers → 409 checkpoint_refused, calls in flight → 409 sandbox_busy) and keeps the image (with
`memory`) and a copy of its writable layer; the record is written once the worker answers. Names
are unique per tenant (the database's unique index); several unnamed snapshots may exist.
`resolve` finds a tenant's snapshot by id or name for a create (controlplane.lifecycle).

With an object store the workers share (WorkerInfo.shared_store: S3 or ATOLL_ARCHIVE_DIR), the
snapshot is uploaded there in the background once its record is written (the seam's
store_snapshot, worker.runtimes.snapstore; measured: the first snapshot of a template also
publishes its layers, 17 s for `base`'s, against 2.5-4 s for the snapshot call, so `take` does not
wait for it) and the record says `stored` when the upload is
whole. A create from a stored snapshot goes to any ready worker reading that store, its own worker
preferred (another one downloads it, checks it and fetches its template layers, as adoption does);
an unstored one only to its worker: gone, lost or draining → 409 snapshot_unavailable (its record
can still be deleted). A delete removes the stored copy too (through its worker, or any worker with
the store when its worker is gone), and reconciliation removes stored snapshots no record names
(seen twice: `_reconcile_store`), marks stored the records whose copy is whole in the store, and
uploads again what a restarted server never saw stored.
Another tenant's snapshot is as absent as one that never was (404 snapshot_not_found).
Called by controlplane.routes_snapshots, controlplane.lifecycle and the E2B edge's routes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
import typing

import sqlalchemy as sa

from atoll.controlplane import auth, forking, quotas, schemas
from atoll.controlplane import db as dbm
from atoll.core import errors, ids
from atoll.core import worker_api as api
from atoll.core.lifecycle import State

if typing.TYPE_CHECKING:
    from atoll.controlplane.manager_view import Manager

log = logging.getLogger(__name__)

ORPHAN_GRACE_S = 600.0
"""A snapshot a worker keeps without a record is deleted by reconciliation once this old."""

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
"""A snapshot's name: 1-128 letters, digits and `._:/-`, not starting with punctuation."""


def check_name(name: object) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ids.is_snapshot_id(name):
        raise errors.InvalidRequest(
            f"snapshot name {errors.shown(str(name))} is not 1-128 letters, digits and '._:/-' starting "
            "with a letter or digit (and not shaped like a snapshot id)"
        )
    return name


def view(rec: dbm.SnapshotRecord, worker_name: str | None = None) -> dict:
    return {
        "id": rec.id,
        "name": rec.name,
        "names": [rec.name] if rec.name else [],
        "tenant_id": rec.tenant_id,
        "sandbox_id": rec.sandbox_id,
        "template": rec.template,
        "memory": rec.memory,
        "memory_mb": rec.memory_mb,
        "bytes": rec.bytes,
        "worker": worker_name,
        "stored": bool(rec.stored),
        "created_at": schemas.iso(rec.created_at),
    }


class Snapshots:
    """The snapshot records of every tenant, and the steps that make and remove them."""

    def __init__(self, manager: Manager):
        self.m = manager
        self.db = manager.db
        self._storing: dict[str, asyncio.Task] = {}
        """Uploads to the shared store in flight (snapshot id -> the task calling store_snapshot)."""
        self._unstorable: set[str] = set()
        """Snapshots whose worker refused the upload for good (409): not asked again."""
        self._unrecorded: set[str] = set()
        """Stored snapshots no record named at the last pass (removed if the next finds them too)."""
        self._copying: collections.Counter[str] = collections.Counter()
        """Creates from each snapshot in flight here, from `resolve` until their worker answered:
        a delete waits for them (its own worker sees only its own copies, not a download elsewhere)."""
        self._deleting: set[str] = set()
        """Snapshots being deleted here: a create from one is 404 before it reaches a worker."""

    # ---- reading --------------------------------------------------------------------------------
    def _not_found(self, ref: str) -> errors.AtollError:
        return errors.NotFound(
            f"snapshot {errors.shown(ref)} does not exist (or was deleted); list yours with GET /v1/snapshots",
            code="snapshot_not_found",
        )

    def get(self, ref: str) -> dbm.SnapshotRecord:
        """A snapshot the caller may see, by id (another tenant's: 404) or by name, resolved in
        the tenant the caller acts in (a tenant key's own; an admin's `?tenant_id=`, else
        `default`), as a create's `snapshot` is."""
        if ids.is_snapshot_id(ref):
            with self.db.session() as s:
                rec = s.get(dbm.SnapshotRecord, ref)
            if rec is None or not auth.visible(rec.tenant_id):
                raise self._not_found(ref)
            return rec
        if not NAME_RE.fullmatch(ref):
            raise errors.InvalidRequest(
                f"{errors.shown(ref)} is neither a snapshot id ('snp-' and 16 hex digits) nor a snapshot "
                "name (1-128 letters, digits and '._:/-' starting with a letter or digit)"
            )
        tenant = auth.acting_tenant()
        with self.db.session() as s:
            rec = s.scalars(
                sa.select(dbm.SnapshotRecord).where(
                    dbm.SnapshotRecord.tenant_id == tenant, dbm.SnapshotRecord.name == ref
                )
            ).first()
        if rec is None or not auth.visible(rec.tenant_id):
            p = auth.current()
            where = (
                f" in tenant {tenant!r} (add ?tenant_id= for another)" if p is not None and p.admin else ""
            )
            raise errors.NotFound(
                f"no snapshot is named {errors.shown(ref)}{where}; list yours with GET /v1/snapshots",
                code="snapshot_not_found",
            )
        return rec

    def resolve(self, ref: str, tenant: str) -> dbm.SnapshotRecord:
        """The tenant's snapshot named `ref` by id or by name (a create's `snapshot`)."""
        with self.db.session() as s:
            if ids.is_snapshot_id(ref):
                rec = s.get(dbm.SnapshotRecord, ref)
            else:
                rec = s.scalars(
                    sa.select(dbm.SnapshotRecord).where(
                        dbm.SnapshotRecord.tenant_id == tenant, dbm.SnapshotRecord.name == ref
                    )
                ).first()
        if rec is None or rec.tenant_id != tenant:
            raise self._not_found(ref)
        return rec

    @contextlib.contextmanager
    def copying(self, snap: dbm.SnapshotRecord) -> typing.Iterator[None]:
        """Hold `snap` for a create from it (controlplane.lifecycle): a delete meanwhile is 409
        invalid_state; one already under way makes the create 404, as if it were gone."""
        if snap.id in self._deleting:
            raise self._not_found(snap.name or snap.id)
        self._copying[snap.id] += 1
        try:
            yield
        finally:
            self._copying[snap.id] -= 1
            if self._copying[snap.id] <= 0:
                del self._copying[snap.id]

    def find(self, ref: str, tenant: str) -> dbm.SnapshotRecord | None:
        """`resolve`, or None (the E2B edge looks a create's templateID up as a snapshot first)."""
        try:
            return self.resolve(ref, tenant)
        except errors.NotFound:
            return None

    def worker_name(self, rec: dbm.SnapshotRecord) -> str | None:
        h = self.m.workers.handles.get(rec.worker_id)
        return h.name if h else None

    # ---- taking and removing ----------------------------------------------------------------------
    async def take(
        self, sid: str, name: str | None, memory: bool, replace: bool = False, end_streams: bool = False
    ) -> dbm.SnapshotRecord:
        """Snapshot sandbox `sid`. A `name` the tenant used already is 409 snapshot_exists, unless
        `replace`: then that snapshot is deleted once the new one is kept (E2B's create_snapshot
        with a used name points the name at the new state)."""
        m = self.m.ledger
        rec = m.get(sid)
        name = check_name(name)
        if name is not None and not replace and self.find(name, rec.tenant_id) is not None:
            raise errors.Conflict(
                f"the tenant has a snapshot named {name!r} already; delete it or choose another name",
                code="snapshot_exists",
            )
        if rec.state == State.FAILED:
            raise errors.Conflict(
                f"sandbox {sid} has failed ({rec.failure_reason}); it cannot be snapshotted",
                code="invalid_state",
            )
        replacing = name if replace else None
        with self.m.quotas.admitting_snapshot(rec.tenant_id, replacing) as ticket:
            snap, old = await self._take(sid, rec, name, memory, replacing, end_streams, ticket)
        if old is not None:
            await self._remove_files(old)
        self._store_later(snap.id, m.workers.handles.get(snap.worker_id))
        return snap

    async def _take(
        self,
        sid: str,
        rec: dbm.SandboxRecord,
        name: str | None,
        memory: bool,
        replacing: str | None,
        end_streams: bool,
        ticket: quotas.Ticket,
    ) -> tuple[dbm.SnapshotRecord, dbm.SnapshotRecord | None]:
        """The take once admitted: checkpoint, then the record (the quota counted again under
        the database's write lock), the replaced snapshot's record deleted in the same
        transaction; (the new record, the replaced one)."""
        m = self.m.ledger
        if rec.state != State.RUNNING:
            rec = await self.m.resume(sid)
        snapshot_id = ids.new_snapshot_id()
        async with m.lock(sid), m.step("snapshot", sid) as fields:
            rec = forking.running_idle(m, sid, "snapshot")
            worker = m.worker(rec)
            try:
                outcome = await worker.snapshot(sid, snapshot_id, memory, end_streams)
            except errors.AtollError as e:
                if isinstance(
                    e,
                    errors.RuntimeFailure
                    | errors.SandboxDied
                    | errors.InsufficientStorage
                    | errors.ResumeFailed,
                ):
                    await forking._parent_after_failure(m, rec, worker, e)
                raise
            fields["worker_ms"] = outcome.duration_ms
            fields["checkpoint_ms"] = outcome.checkpoint_ms
            m.activity[sid] = time.monotonic()  # as a fork: the idle clock starts again
            snap = dbm.SnapshotRecord(
                id=snapshot_id,
                tenant_id=rec.tenant_id,
                name=name,
                sandbox_id=sid,
                template=rec.template,
                build_id=rec.build_id,
                worker_id=rec.worker_id,
                bytes=outcome.bytes,
                memory=memory,
                memory_mb=outcome.memory_mb,
                source={
                    "user": rec.user,
                    "shell": rec.shell,
                    "workdir": rec.workdir,
                    "disk_mb": rec.disk_mb,
                    "memory_mb": rec.memory_mb,
                    "cpus": rec.cpus,
                },
                created_at=dbm.utcnow(),
            )
            old = None
            try:
                with self.db.session.begin() as s:
                    self.m.quotas.check_snapshot_locked(s, rec.tenant_id, replacing, ticket)
                    if replacing is not None:
                        old = s.scalars(
                            sa.select(dbm.SnapshotRecord).where(
                                dbm.SnapshotRecord.tenant_id == rec.tenant_id,
                                dbm.SnapshotRecord.name == replacing,
                            )
                        ).first()
                        if old is not None:
                            s.delete(old)
                            s.flush()
                    s.add(snap)
            except sa.exc.IntegrityError:
                with contextlib.suppress(errors.AtollError):  # a name taken meanwhile: nothing is kept
                    await worker.delete_snapshot(snapshot_id)
                raise errors.Conflict(
                    f"the tenant has a snapshot named {name!r} already; delete it or choose another name",
                    code="snapshot_exists",
                ) from None
            except BaseException:
                with contextlib.suppress(errors.AtollError):
                    await worker.delete_snapshot(snapshot_id)
                raise
        return snap, old

    # ---- the shared object store ------------------------------------------------------------------
    def _store_later(self, snapshot_id: str, h: typing.Any) -> None:
        """Upload the snapshot to the shared store in the background, if its worker `h` has one."""
        if (
            h is None
            or h.worker is None
            or h.info is None
            or not h.info.shared_store
            or snapshot_id in self._storing
            or snapshot_id in self._unstorable
        ):
            return
        task = asyncio.get_running_loop().create_task(self._store(snapshot_id, h), context=auth.detached())
        self._storing[snapshot_id] = task
        task.add_done_callback(lambda _t: self._storing.pop(snapshot_id, None))

    async def _store(self, snapshot_id: str, h: typing.Any) -> None:
        try:
            out = await h.worker.store_snapshot(snapshot_id)
        except errors.AtollError as e:
            if isinstance(e, errors.Conflict):
                self._unstorable.add(snapshot_id)
            log.warning(
                "snapshot %s stays on worker %s only for now: %s",
                snapshot_id,
                h.name,
                e.message,
                extra={"snapshot_id": snapshot_id, "worker": h.name},
            )
            return
        with self.db.session.begin() as s:
            s.execute(
                sa.update(dbm.SnapshotRecord).where(dbm.SnapshotRecord.id == snapshot_id).values(stored=True)
            )
        log.info(
            "snapshot.stored: %d bytes in %.0f ms",
            out.bytes,
            out.duration_ms,
            extra={"snapshot_id": snapshot_id, "worker": h.name},
        )

    def _store_worker(self, but: str | None = None) -> typing.Any:
        """A ready worker that reads the shared store (not `but`), or None."""
        return next(
            (h for h in self.m.workers.ready() if h.info is not None and h.info.shared_store and h.id != but),
            None,
        )

    async def _reconcile_store(self, handle: typing.Any, inventory: api.Inventory) -> None:
        """The shared store as `handle`'s worker sees it: stored snapshots that a worker of this
        control plane uploaded (the store may be shared beyond it) and no record names are removed
        once two passes found them so (a delete while the store failed, an upload that ended after
        its snapshot's delete: the upload starts only once the record is written), records whose
        copy is whole there are marked stored, and a snapshot this worker keeps that is not stored
        is uploaded (a server restarted during its upload)."""
        if handle.worker is None or handle.info is None or not handle.info.shared_store:
            return
        try:
            listed = await handle.worker.stored_snapshots()
        except errors.AtollError as e:
            log.info("reconcile: the stored snapshots could not be listed: %s", e.message)
            return
        stored = {k.snapshot_id for k in listed}
        R = dbm.SnapshotRecord
        kept = {k.snapshot_id for k in inventory.snapshots}
        with self.db.session() as s:
            # the installation ids of every worker registered here (also those away or held by
            # another server): only their uploads are this control plane's to remove
            ours = set(
                s.scalars(
                    sa.select(dbm.WorkerRecord.installation).where(dbm.WorkerRecord.installation.is_not(None))
                )
            )
            known = {i: bool(was) for i, was in s.execute(sa.select(R.id, R.stored).where(R.id.in_(stored)))}
            unstored = set(s.scalars(sa.select(R.id).where(R.worker_id == handle.id, R.stored == sa.false())))
        missing = {k.snapshot_id for k in listed if k.holder in ours} - set(known)
        doomed, self._unrecorded = missing & self._unrecorded, missing
        for snapshot_id in sorted(doomed):
            log.info(
                "reconcile: removing a stored snapshot no record names",
                extra={"snapshot_id": snapshot_id, "worker": handle.name},
            )
            try:
                await handle.worker.delete_snapshot(snapshot_id)
            except errors.AtollError as e:
                log.warning("reconcile: removing stored snapshot %s failed: %s", snapshot_id, e.message)
        found = [i for i, was in known.items() if not was]
        if found:
            with self.db.session.begin() as s:
                s.execute(sa.update(R).where(R.id.in_(found)).values(stored=True))
        for snapshot_id in sorted((unstored & kept) - stored):
            self._store_later(snapshot_id, handle)

    async def _remove_files(self, rec: dbm.SnapshotRecord) -> None:
        """Remove a replaced snapshot's files from its worker (best effort: one that cannot be
        reached now, or a create copying from it, leaves them to reconciliation; its record is
        gone)."""
        h = self.m.workers.handles.get(rec.worker_id)
        if self._copying[rec.id]:  # a create copies from it: reconciliation removes it later
            log.info("replaced snapshot %s stays until the creates copying from it are done", rec.id)
            return
        if h is not None and h.worker is not None:
            try:
                await self.m.workers.api_for(rec.worker_id).delete_snapshot(rec.id)
            except errors.AtollError as e:
                log.warning("replaced snapshot %s stays on worker %s: %s", rec.id, h.name, e.message)

    async def delete(self, ref: str) -> None:
        """Remove the snapshot `ref` names (its id, or its name: `get`) from its worker (its stored
        copy too), then its record. A worker that is gone (no longer known) keeps nothing to remove;
        one that is known but unreachable now refuses the delete (503) — unless the snapshot is
        stored: any worker with the store removes that copy."""
        rec = self.get(ref)
        snapshot_id = rec.id
        if self._copying[snapshot_id]:
            raise errors.Conflict(
                f"snapshot {snapshot_id} is being copied into {self._copying[snapshot_id]} new "
                "sandbox(es) right now; delete it when they have started",
                code="invalid_state",
            )
        if snapshot_id in self._deleting:
            raise errors.Conflict(f"snapshot {snapshot_id} is being deleted already", code="invalid_state")
        self._deleting.add(snapshot_id)
        try:
            await self._delete(rec)
        finally:
            self._deleting.discard(snapshot_id)

    async def _delete(self, rec: dbm.SnapshotRecord) -> None:
        snapshot_id = rec.id
        h = self.m.workers.handles.get(rec.worker_id)
        if h is not None and h.worker is not None and (h.usable or not rec.stored):
            await self.m.workers.api_for(rec.worker_id).delete_snapshot(snapshot_id)  # its stored copy too
        elif rec.stored:
            # its worker is away: another one removes the stored copy (the kept one goes when that
            # worker is reconciled again); none ready: the store's garbage collection removes it
            other = self._store_worker(but=rec.worker_id)
            if other is not None:
                await other.worker.delete_snapshot(snapshot_id)
            else:
                log.warning(
                    "snapshot %s: its stored copy is left to the store's garbage collection", snapshot_id
                )
        elif h is not None and h.state != "lost":
            raise errors.Unavailable(
                f"the worker {h.name!r} that keeps snapshot {snapshot_id} cannot be reached now; try again"
            )
        with self.db.session.begin() as s:
            s.execute(sa.delete(dbm.SnapshotRecord).where(dbm.SnapshotRecord.id == snapshot_id))

    async def reconcile(self, handle: typing.Any, inventory: api.Inventory) -> None:
        """Delete the snapshots `handle`'s worker keeps that no record names and that are older than
        ORPHAN_GRACE_S (younger ones may be a `take` whose record is about to be written, here or
        on another server): a snapshot call whose answer was lost, or a delete while the worker was
        unreachable."""
        await self._reconcile_store(handle, inventory)
        if not inventory.snapshots or handle.worker is None:
            return
        with self.db.session() as s:
            known = set(
                s.scalars(
                    sa.select(dbm.SnapshotRecord.id).where(
                        dbm.SnapshotRecord.id.in_([k.snapshot_id for k in inventory.snapshots])
                    )
                )
            )
        now = time.time()
        for k in inventory.snapshots:
            if k.snapshot_id in known or now - k.kept_at < ORPHAN_GRACE_S:
                continue
            log.info(
                "reconcile: deleting a snapshot no record names",
                extra={"snapshot_id": k.snapshot_id, "worker": handle.name},
            )
            try:
                await handle.worker.delete_snapshot(k.snapshot_id)
            except errors.AtollError as e:
                log.warning("reconcile: deleting snapshot %s failed: %s", k.snapshot_id, e.message)

    def workers_for_create(self, snap: dbm.SnapshotRecord) -> set[str] | None:
        """The workers a create from `snap` may go to: None for only its own (not stored, or no
        ready worker reads the store), else the ready workers reading the shared store (placement
        prefers its own). Refused early when it is only on a worker that is gone, lost or draining:
        409 snapshot_unavailable (one joining is left to placement's retryable 503)."""
        if snap.stored:
            shared = {h.id for h in self.m.workers.ready() if h.info is not None and h.info.shared_store}
            if shared:
                return shared
        h = self.m.workers.handles.get(snap.worker_id)
        if h is None or h.state in ("lost", "draining"):
            why = "is gone" if h is None else f"{h.name!r} is {h.state}"
            where = (
                "its copy in the object store has no ready worker reading that store now; try again"
                if snap.stored
                else "it is not in an object store the workers share (ATOLL_S3_* or ATOLL_ARCHIVE_DIR; "
                "it is uploaded there after it is taken), so sandboxes are created from it only there"
            )
            raise errors.Conflict(
                f"snapshot {snap.id} is kept on a worker that {why}, and {where}"
                + (
                    "; a lost worker that comes back serves it again"
                    if h is not None and h.state == "lost"
                    else ""
                ),
                code="snapshot_unavailable",
            )
        return None
