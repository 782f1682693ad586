"""Volumes and drives in the control plane: their records, which worker keeps each, and who holds
a volume.

A store lives on one worker (worker.host.stores: an ext4 image there); a sandbox that mounts it is
placed on that worker. A volume has at most one holder: `attach` takes it with one conditional
UPDATE (`attached_to IS NULL`), so of two concurrent creates exactly one wins and the other gets
409 volume_in_use naming the holder. A holder's DELETE marks the volume `detaching` and answers;
once its worker has removed the sandbox the volume is free (`release`), and a create that meets a
detaching volume waits for that (up to DETACH_WAIT_S) instead of answering 409. A drive has any
number of users (the live sandboxes whose `mounts` name it).

Called by controlplane.routes_stores (the public routes) and controlplane.lifecycle (create and
delete of sandboxes that mount stores).
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import time
import typing

import sqlalchemy as sa

from atoll.controlplane import auth
from atoll.controlplane import db as dbm
from atoll.controlplane.schemas import iso
from atoll.core import errors, mounts
from atoll.core import worker_api as api
from atoll.core.lifecycle import State

if typing.TYPE_CHECKING:
    from atoll.controlplane.ledger import Ledger
    from atoll.controlplane.quotas import Quotas

DETACH_WAIT_S = 30.0
IMPORT_HOLDER = "tar-import"
"""What `attached_to` says while a tar is being unpacked into a volume (no sandbox may take it)."""


def wname(rec: dbm.StoreRecord) -> str:
    """The store's name on its worker (core.mounts.worker_name)."""
    return mounts.worker_name(rec.tenant_id, rec.name)


def _not_found(kind: str, name: str) -> errors.AtollError:
    return errors.NotFound(
        f"no {kind} named {name!r} (GET /v1/{kind}s lists them; POST /v1/{kind}s makes one)",
        code=f"{kind}_not_found",
    )


def created_unix(rec: dbm.StoreRecord) -> int:
    """When the store was made, unix seconds (UTC; a naive time from SQLite is UTC too): what makes
    a drive token one drive's (core.grants.drive_token)."""
    return calendar.timegm(rec.created_at.utctimetuple())


class StoreService:
    def __init__(self, database: dbm.Database, ledger: Ledger, quotas: Quotas | None = None):
        self.quotas = quotas
        self.db = database
        self.ledger = ledger
        self._released = asyncio.Event()
        self._importing: set[tuple[str, str, str]] = set()  # (tenant, kind, name) of running tar imports

    # ---- records --------------------------------------------------------------------------------
    def record(self, kind: str, name: str, tenant: str | None = None) -> dbm.StoreRecord:
        """The caller's store `name` (`tenant`: whose, when not the caller's)."""
        mounts.check_name(kind, name)
        tenant = tenant or auth.acting_tenant()
        with self.db.session() as s:
            rec = s.get(dbm.StoreRecord, (tenant, kind, name))
        if rec is None:
            raise _not_found(kind, name)
        return rec

    def records(self, kind: str, tenant: str | None = None) -> list[dbm.StoreRecord]:
        """The stores of `kind` the caller may list (an admin: every tenant's, or its ?tenant_id=)."""
        tenant = tenant or auth.list_tenant()
        with self.db.session() as s:
            q = sa.select(dbm.StoreRecord).where(dbm.StoreRecord.kind == kind)
            if tenant is not None:
                q = q.where(dbm.StoreRecord.tenant_id == tenant)
            return list(s.scalars(q.order_by(dbm.StoreRecord.tenant_id, dbm.StoreRecord.name)))

    def users(self, kind: str, name: str, tenant: str | None = None) -> list[str]:
        """The live sandboxes (of the store's tenant) whose mounts name the store."""
        tenant = tenant or auth.acting_tenant()
        return [
            r.id
            for r in self.ledger.live()
            if r.state not in (State.DELETED, State.FAILED)  # a failed one's runtime is stopped
            and r.tenant_id == tenant
            and any(m["kind"] == kind and m["name"] == name for m in (r.mounts or []))
        ]

    def worker(self, rec: dbm.StoreRecord) -> api.WorkerAPI:
        return self.ledger.workers.api_for(rec.worker_id)

    async def view(self, rec: dbm.StoreRecord) -> dict:
        try:
            info = await self.worker(rec).get_store(rec.kind, wname(rec))
            used = info.used_mb
        except errors.Unavailable:
            used = None
        out = {
            "name": rec.name,
            "size_mb": rec.size_mb,
            "used_mb": used,
            "worker_id": rec.worker_id,
            "created_at": iso(rec.created_at),
        }
        if rec.kind == "volume":
            out["attached_to"] = rec.attached_to
        else:
            out["attached_to"] = self.users(rec.kind, rec.name, rec.tenant_id)
        return out

    # ---- create, clone, delete ------------------------------------------------------------------
    def _place(self) -> str:
        ready = self.ledger.workers.ready()
        if not ready:
            raise errors.Unavailable("no worker is ready to keep a new volume or drive", code="no_worker")
        # the worker keeping the fewest stores (one machine: the local worker)
        counts: dict[str, int] = {h.id: 0 for h in ready}
        with self.db.session() as s:
            for wid in s.scalars(sa.select(dbm.StoreRecord.worker_id)):
                if wid in counts:
                    counts[wid] += 1
        return min(counts, key=lambda w: (counts[w], w))

    async def create(self, kind: str, name: str, size_mb: object, tenant: str | None = None) -> dict:
        tenant = tenant or auth.acting_tenant()
        mounts.check_name(kind, name)
        size = mounts.check_size(kind, size_mb)
        if self.quotas is not None:
            self.quotas.check_store(tenant, size)
        worker_id = self._place()
        rec = dbm.StoreRecord(
            tenant_id=tenant, kind=kind, name=name, worker_id=worker_id, size_mb=size, created_at=dbm.utcnow()
        )
        try:
            with self.db.session.begin() as s:
                s.add(rec)
        except sa.exc.IntegrityError:
            raise errors.Conflict(f"a {kind} named {name!r} exists", code=f"{kind}_exists") from None
        try:
            info = await self.ledger.workers.api_for(worker_id).create_store(
                kind, mounts.worker_name(tenant, name), size
            )
        except BaseException:
            self._drop(rec)
            raise
        if info.backend != "local":
            rec.backend = info.backend
            with self.db.session.begin() as s:
                s.merge(rec)
        return await self.view(rec)

    def _drop(self, rec: dbm.StoreRecord) -> None:
        with self.db.session.begin() as s:
            s.execute(
                sa.delete(dbm.StoreRecord).where(
                    dbm.StoreRecord.tenant_id == rec.tenant_id,
                    dbm.StoreRecord.kind == rec.kind,
                    dbm.StoreRecord.name == rec.name,
                )
            )

    async def clone(self, kind: str, name: str, new_name: object, tenant: str | None = None) -> dict:
        tenant = tenant or auth.acting_tenant()
        src = self.record(kind, name, tenant)
        new = mounts.check_name(kind, new_name)
        if self.quotas is not None:
            self.quotas.check_store(tenant, src.size_mb)
        rec = dbm.StoreRecord(
            tenant_id=tenant,
            kind=kind,
            name=new,
            worker_id=src.worker_id,
            size_mb=src.size_mb,
            created_at=dbm.utcnow(),
        )
        try:
            with self.db.session.begin() as s:
                s.add(rec)
        except sa.exc.IntegrityError:
            raise errors.Conflict(f"a {kind} named {new!r} exists", code=f"{kind}_exists") from None
        try:
            await self.worker(src).clone_store(kind, wname(src), mounts.worker_name(tenant, new))
        except BaseException:
            self._drop(rec)
            raise
        return await self.view(rec)

    @contextlib.asynccontextmanager
    async def importing(
        self, kind: str, name: str, tenant: str | None = None
    ) -> typing.AsyncIterator[dbm.StoreRecord]:
        """Hold the store while a tar is unpacked into it: a volume is taken (no sandbox may mount
        it meanwhile), and neither may be deleted under the import."""
        rec = self.record(kind, name, tenant)
        tenant = rec.tenant_id
        key = (tenant, kind, name)
        if key in self._importing:
            raise errors.Conflict(
                f"a tar import into {kind} {name!r} is running; wait for it", code=f"{kind}_in_use"
            )
        if kind == "volume":
            await self._take(rec, IMPORT_HOLDER)
        self._importing.add(key)
        try:
            yield rec
        finally:
            self._importing.discard(key)
            if kind == "volume":
                self.release("volume", name, IMPORT_HOLDER, tenant)

    async def delete(self, kind: str, name: str, tenant: str | None = None) -> None:
        tenant = tenant or auth.acting_tenant()
        rec = self.record(kind, name, tenant)
        if (tenant, kind, name) in self._importing:
            raise errors.Conflict(
                f"a tar import into {kind} {name!r} is running; delete it when the import has answered",
                code=f"{kind}_in_use",
            )
        if kind == "volume":
            rec = await self._settled(rec)
            holders = [rec.attached_to] if rec.attached_to else []
        else:
            holders = self.users(kind, name)
        if holders:
            what = "sandbox " + holders[0] if kind == "volume" else "sandboxes " + ", ".join(holders)
            raise errors.Conflict(
                f"{kind} {name!r} is attached to {what}; delete "
                + ("it" if len(holders) == 1 else "them")
                + " first (its data stays until this delete)",
                code=f"{kind}_in_use",
            )
        await self._delete_on_worker(rec, tenant)
        if rec.backend == "filer":  # other workers may have mounted it for their sandboxes
            for h in self.ledger.workers.ready():
                if h.id != rec.worker_id and h.worker is not None:
                    with contextlib.suppress(errors.NotFound, errors.Unavailable):
                        await h.worker.delete_store(kind, name)
        self._drop(rec)

    async def _delete_on_worker(self, rec: dbm.StoreRecord, tenant: str) -> None:
        """Delete the store on its worker. The worker refuses while a runtime there mounts it; a
        sandbox whose DELETE has answered may still be being taken down, so while no live sandbox
        names the store here such a refusal is waited out (up to DETACH_WAIT_S), as a volume's
        detach is (E2B's kill-then-`Volume.destroy`)."""
        deadline = time.monotonic() + DETACH_WAIT_S
        while True:
            try:
                await self.worker(rec).delete_store(rec.kind, wname(rec))
                return
            except errors.Conflict as e:
                if e.code != f"{rec.kind}_in_use" or time.monotonic() > deadline:
                    raise
                if rec.kind == "drive" and self.users(rec.kind, rec.name, tenant):
                    raise
                await asyncio.sleep(0.1)

    # ---- a volume's holder ----------------------------------------------------------------------
    def sizes(self, want: typing.Sequence[mounts.Mount], tenant: str | None = None) -> dict[str, int]:
        """The size of each filer-backed drive among `want` (a worker that has not mounted one yet
        mounts it with that quota)."""
        out = {}
        for m in want:
            rec = self.record(m.kind, m.name, tenant)
            if rec.backend == "filer":
                out[m.name] = rec.size_mb
        return out

    async def attach(
        self, want: typing.Sequence[mounts.Mount], sid: str, tenant: str | None = None
    ) -> str | None:
        """Check every store exists, take each volume for `sid` (waiting for one still detaching),
        and return the worker they all live on (None: only filer-backed drives, any worker). On any
        refusal nothing stays taken."""
        tenant = tenant or auth.acting_tenant()
        recs = [self.record(m.kind, m.name, tenant) for m in want]
        workers = {r.worker_id for r in recs if r.backend == "local"}  # a filer's drive: any worker
        if len(workers) > 1:
            raise errors.Conflict(
                "the volumes and drives of this create live on different workers ("
                + ", ".join(f"{r.kind} {r.name} on {r.worker_id}" for r in recs)
                + "); a sandbox mounts only stores of one worker",
                code="invalid_state",
            )
        taken: list[str] = []
        try:
            for r in recs:
                if r.kind == "volume":
                    await self._take(r, sid)
                    taken.append(r.name)
        except BaseException:
            for name in taken:
                self.release("volume", name, sid, tenant)
            raise
        return workers.pop() if workers else None

    async def _take(self, rec: dbm.StoreRecord, sid: str) -> None:
        deadline = time.monotonic() + DETACH_WAIT_S
        t = dbm.StoreRecord
        while True:
            with self.db.session.begin() as s:
                done = s.execute(  # type: ignore[attr-defined]
                    sa.update(t)
                    .where(
                        t.tenant_id == rec.tenant_id,
                        t.kind == "volume",
                        t.name == rec.name,
                        t.attached_to.is_(None),
                    )
                    .values(attached_to=sid, detaching=False)
                ).rowcount
                cur = s.get(t, (rec.tenant_id, "volume", rec.name))
            if done == 1:
                return
            if cur is None:
                raise _not_found("volume", rec.name)
            if not cur.detaching or time.monotonic() >= deadline:
                holder = "a tar import" if cur.attached_to == IMPORT_HOLDER else f"sandbox {cur.attached_to}"
                raise errors.Conflict(
                    f"volume {rec.name!r} is attached to {holder}"
                    + (" (still detaching after its delete)" if cur.detaching else "")
                    + "; a volume has one holder at a time: delete that sandbox first, or clone the volume",
                    code="volume_in_use",
                )
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), timeout=min(0.5, deadline - time.monotonic()))
            except TimeoutError:
                pass

    async def _settled(self, rec: dbm.StoreRecord) -> dbm.StoreRecord:
        """The volume's record once no detach is in progress (waits up to DETACH_WAIT_S)."""
        deadline = time.monotonic() + DETACH_WAIT_S
        while rec.detaching and time.monotonic() < deadline:
            self._released.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), timeout=0.5)
            rec = self.record(rec.kind, rec.name, rec.tenant_id)
        return rec

    def detaching(self, sid: str, rec_mounts: list | None, tenant: str) -> None:
        """The holder's DELETE answered: its volumes are detaching until `release`."""
        t = dbm.StoreRecord
        for m in rec_mounts or []:
            if m["kind"] == "volume":
                with self.db.session.begin() as s:
                    s.execute(
                        sa.update(t)
                        .where(
                            t.tenant_id == tenant,
                            t.kind == "volume",
                            t.name == m["name"],
                            t.attached_to == sid,
                        )
                        .values(detaching=True)
                    )

    def release(self, kind: str, name: str, sid: str, tenant: str | None = None) -> None:
        tenant = tenant or auth.acting_tenant()
        t = dbm.StoreRecord
        with self.db.session.begin() as s:
            s.execute(
                sa.update(t)
                .where(t.tenant_id == tenant, t.kind == kind, t.name == name, t.attached_to == sid)
                .values(attached_to=None, detaching=False)
            )
        self._released.set()

    def release_all(self, sid: str, rec_mounts: list | None, tenant: str) -> None:
        for m in rec_mounts or []:
            if m["kind"] == "volume":
                self.release("volume", m["name"], sid, tenant)
