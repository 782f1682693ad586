"""Tenant quotas: admission of creates, claims, stores, pools and builds against a tenant's limits.

A tenant's quotas (controlplane.auth QUOTA_KEYS, on its record; a key left out is unlimited):
`max_running` and `max_memory_mb` (sandboxes running or being created, pooled ones not counted
until claimed), `max_standby_gb` (standby storage: the disk size of its sandboxes in the disk and
archive tiers — an upper bound of what they hold), `max_volume_gb` (volumes and drives, by size),
`creates_per_minute` (creates and claims in the last 60 s: 429 with Retry-After), `max_pool_slots`
(the `max` of its templates' pools, summed), `build_minutes_per_day` (its template builds since
00:00 UTC, running ones counted to now), `max_snapshots` and `max_snapshot_gb` (its named snapshots,
by number and by the bytes their workers measured; a snapshot's size is known only once it is
taken, so a take is refused when those kept already reach `max_snapshot_gb`, and the takes admitted
below it — the last one, or several running at once — may pass it by their own sizes).

Admission is check-and-reserve in one step of the event loop: the use is counted from the
database plus the admissions in flight (reserved until their record is written), so two creates
racing for the last slot cannot both pass on this server. `insert` then writes the record in a
transaction that holds the database's write lock (SQLite `BEGIN IMMEDIATE`; on PostgreSQL a row
lock on the tenant) and counts again, so servers sharing a database cannot overshoot either. A
refusal names the quota by its key, its limit and the current use. Lowering a quota below the use
is allowed: new admissions are refused, nothing running is touched.
Snapshots are admitted the same way (`admitting_snapshot`, then `check_snapshot_locked` in the
transaction that writes the record): a take that replaces a snapshot of the same name does not
count that one, and takes in flight replacing one name count it once.
Called by controlplane.lifecycle (create), pools (claim, pool settings), stores, templates and
snapshots.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime as dt
import typing

import sqlalchemy as sa

from atoll.controlplane import auth
from atoll.controlplane import db as dbm
from atoll.core import errors

LIVE = ("creating", "running")
STANDBY_TIERS = ("disk", "archive")


class QuotaExceeded(errors.AtollError):
    status = 403
    code = "quota_exceeded"


class RateExceeded(QuotaExceeded):
    status = 429
    retryable = True

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


@dataclasses.dataclass
class _Pending:
    running: int = 0
    memory_mb: int = 0
    creates: int = 0
    snapshots: int = 0
    replacing: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Names that snapshot takes in flight replace (each ends as one snapshot, however many)."""

    def idle(self) -> bool:
        return not (self.running or self.creates or self.snapshots or +self.replacing)


class Ticket:
    """An admission in flight: its place is held until `done` (its record is written) or the
    admission's block ends."""

    def __init__(self, release: typing.Callable[[], None]):
        self._release: typing.Callable[[], None] | None = release

    def done(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _aware(t: dt.datetime) -> dt.datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)


class Quotas:
    def __init__(self, database: dbm.Database):
        self.db = database
        self._pending: dict[str, _Pending] = {}

    def limits(self, tenant: str) -> dict:
        with self.db.session() as s:
            rec = s.get(auth.TenantRecord, tenant)
        return dict(rec.quotas or {}) if rec is not None else {}

    # ---- sandboxes ----------------------------------------------------------------------------
    def _sandbox_use(self, conn: sa.Connection, tenant: str) -> dict:
        t = dbm.SandboxRecord.__table__
        live = (t.c.tenant_id == tenant) & t.c.state.in_(LIVE) & (t.c.pooled == sa.false())
        running, memory = conn.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(t.c.memory_mb), 0)).where(live)
        ).one()
        standby = conn.execute(
            sa.select(sa.func.coalesce(sa.func.sum(t.c.disk_mb), 0)).where(
                (t.c.tenant_id == tenant) & (t.c.state == "standby") & t.c.standby_tier.in_(STANDBY_TIERS)
            )
        ).scalar_one()
        since = _now() - dt.timedelta(seconds=60)
        recent = [
            _aware(x)
            for x in conn.execute(
                sa.select(t.c.created_at)
                .where((t.c.tenant_id == tenant) & (t.c.pooled == sa.false()) & (t.c.created_at >= since))
                .order_by(t.c.created_at)
            ).scalars()
        ]
        return {"running": running, "memory_mb": memory, "standby_mb": standby, "recent": recent}

    def _check_sandbox(self, limits: dict, use: dict, pending: _Pending, memory_mb: int) -> None:
        q = limits.get("max_running")
        running = use["running"] + pending.running
        if q is not None and running + 1 > q:
            raise QuotaExceeded(f"max_running {q} reached: {running} running; stop or pause one first")
        q = limits.get("max_memory_mb")
        mem = use["memory_mb"] + pending.memory_mb
        if q is not None and mem + memory_mb > q:
            raise QuotaExceeded(
                f"max_memory_mb {q} would be exceeded: {mem} MB running + {memory_mb} MB asked; "
                "ask for less memory or stop a sandbox"
            )
        q = limits.get("max_standby_gb")
        if q is not None and use["standby_mb"] / 1024 >= q:
            raise QuotaExceeded(
                f"max_standby_gb {q} reached: {use['standby_mb'] / 1024:.2f} GB in the disk and archive "
                "tiers; delete standby sandboxes first"
            )
        q = limits.get("creates_per_minute")
        n = len(use["recent"]) + pending.creates
        if q is not None and n + 1 > q:
            oldest = use["recent"][0] if use["recent"] else _now()
            wait = max(1.0, 60 - (_now() - oldest).total_seconds())
            raise RateExceeded(
                f"creates_per_minute {q} reached: {n} in the last minute; retry in {wait:.0f} s", wait
            )

    @contextlib.contextmanager
    def admitting(self, tenant: str, memory_mb: int) -> typing.Iterator[Ticket]:
        """Check a sandbox create (or claim) of `memory_mb` against the tenant's quotas and hold
        its place until the ticket is done or the block ends."""
        limits = self.limits(tenant)
        if not limits:
            yield Ticket(lambda: None)
            return
        pending = self._pending.setdefault(tenant, _Pending())
        with self.db.engine.connect() as conn:
            use = self._sandbox_use(conn, tenant)
        self._check_sandbox(limits, use, pending, memory_mb)
        pending.running += 1
        pending.memory_mb += memory_mb
        pending.creates += 1

        def undo() -> None:
            pending.running -= 1
            pending.memory_mb -= memory_mb
            pending.creates -= 1

        with self._holding(tenant, pending, undo) as ticket:
            yield ticket

    @contextlib.contextmanager
    def _holding(
        self, tenant: str, pending: _Pending, undo: typing.Callable[[], None]
    ) -> typing.Iterator[Ticket]:
        """A ticket for a place held in `pending` (the tenant's): done, it `undo`es the place and
        forgets `pending` once nothing is held in it; done at the latest when the block ends."""

        def release() -> None:
            undo()
            if pending.idle() and self._pending.get(tenant) is pending:
                del self._pending[tenant]

        ticket = Ticket(release)
        try:
            yield ticket
        finally:
            ticket.done()

    def insert(self, rec: dbm.SandboxRecord, ticket: Ticket | None = None) -> None:
        """Write a new sandbox record (its admission's `ticket` is then done), counting the
        tenant's use again under the database's write lock: another server sharing the database
        may have admitted one meanwhile."""
        limits = self.limits(rec.tenant_id)
        if not limits:
            self.db.add(rec)
            if ticket is not None:
                ticket.done()
            return
        mine = self._pending.get(rec.tenant_id, _Pending())
        held = 1 if ticket is not None and ticket._release is not None else 0
        others = _Pending(mine.running - held, mine.memory_mb - held * rec.memory_mb, mine.creates - held)
        with self.db.session() as s:
            conn = self.write_lock(s, rec.tenant_id)
            self._check_sandbox(limits, self._sandbox_use(conn, rec.tenant_id), others, rec.memory_mb)
            s.add(rec)
            s.commit()
        if ticket is not None:
            ticket.done()

    @staticmethod
    def write_lock(s: typing.Any, tenant: str) -> sa.Connection:
        """Take the database's write lock in session `s`'s transaction, before it writes anything
        (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: a row lock on the tenant), so that the use counted
        next is still the use when the transaction commits, whichever server writes."""
        conn = s.connection()
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.execute(
                sa.select(auth.TenantRecord.id).where(auth.TenantRecord.id == tenant).with_for_update()
            )
        return conn

    # ---- named snapshots ------------------------------------------------------------------------
    @staticmethod
    def _snapshot_use(
        conn: sa.Connection, tenant: str, leave_out: typing.Collection[str] = ()
    ) -> tuple[int, int]:
        """(number, bytes) of the tenant's snapshots, those named in `leave_out` left out."""
        t = dbm.SnapshotRecord.__table__
        where = t.c.tenant_id == tenant
        if leave_out:
            where = where & (t.c.name.is_(None) | t.c.name.not_in(sorted(leave_out)))
        count, used = conn.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(t.c.bytes), 0)).where(where)
        ).one()
        return int(count), int(used)

    def _check_snapshot(
        self,
        conn: sa.Connection,
        limits: dict,
        tenant: str,
        replacing: str | None,
        plain: int,
        names: set[str],
    ) -> None:
        """Refuse a take (replacing the snapshot named `replacing`, if any) when the tenant's
        snapshots once it and the other takes in flight are done (`plain` ones adding one each;
        those replacing `names` one per name, whatever is kept under it now) would pass
        max_snapshots, or when those kept (the replaced one left out) reach max_snapshot_gb."""
        q = limits.get("max_snapshots")
        if q is not None:
            named = names | ({replacing} if replacing is not None else set())
            count, _ = self._snapshot_use(conn, tenant, named)
            if count + plain + len(named) + (0 if replacing is not None else 1) > q:
                kept, _ = self._snapshot_use(conn, tenant)
                taking = plain + len(names)
                raise QuotaExceeded(
                    f"max_snapshots {q} reached: the tenant keeps {kept} snapshot{'' if kept == 1 else 's'}"
                    + (f" ({taking} more being taken)" if taking else "")
                    + "; delete one first (GET /v1/snapshots, DELETE /v1/snapshots/{id}) or ask an "
                    "admin to raise the quota"
                )
        q = limits.get("max_snapshot_gb")
        if q is None:
            return
        _, used = self._snapshot_use(conn, tenant, {replacing} if replacing is not None else ())
        if used / 1024**3 >= q:
            raise QuotaExceeded(
                f"max_snapshot_gb {q} reached: the tenant's snapshots take {used / 1024**3:.2f} GB; "
                "delete one first (GET /v1/snapshots, DELETE /v1/snapshots/{id}) or ask an admin to "
                "raise the quota"
            )

    @contextlib.contextmanager
    def admitting_snapshot(self, tenant: str, replacing: str | None = None) -> typing.Iterator[Ticket]:
        """Check a snapshot take against the tenant's `max_snapshots` / `max_snapshot_gb` (the
        snapshot named `replacing`, which the take deletes, not counted) and hold its place until
        the block ends: a refusal comes before the sandbox is checkpointed."""
        limits = self.limits(tenant)
        if "max_snapshots" not in limits and "max_snapshot_gb" not in limits:
            yield Ticket(lambda: None)
            return
        pending = self._pending.setdefault(tenant, _Pending())
        with self.db.engine.connect() as conn:
            self._check_snapshot(conn, limits, tenant, replacing, pending.snapshots, set(+pending.replacing))
        if replacing is not None:
            pending.replacing[replacing] += 1
        else:
            pending.snapshots += 1

        def undo() -> None:
            if replacing is not None:
                pending.replacing[replacing] -= 1
            else:
                pending.snapshots -= 1

        with self._holding(tenant, pending, undo) as ticket:
            yield ticket

    def check_snapshot_locked(
        self, s: typing.Any, tenant: str, replacing: str | None, ticket: Ticket
    ) -> None:
        """In the transaction (session `s`, nothing written yet) that records the snapshot admitted
        with `ticket`: take the write lock and count the tenant's snapshots again (another server
        sharing the database may have recorded one meanwhile); the other takes in flight here count
        as well."""
        limits = self.limits(tenant)
        if "max_snapshots" not in limits and "max_snapshot_gb" not in limits:
            return
        conn = self.write_lock(s, tenant)
        held = 1 if ticket._release is not None else 0
        pending = self._pending.get(tenant, _Pending())
        names = +pending.replacing
        plain = pending.snapshots
        if replacing is not None:
            names[replacing] -= held
        else:
            plain -= held
        self._check_snapshot(conn, limits, tenant, replacing, max(0, plain), set(+names))

    # ---- stores, pools, builds ----------------------------------------------------------------
    def check_store(self, tenant: str, add_mb: int) -> None:
        q = self.limits(tenant).get("max_volume_gb")
        if q is None:
            return
        with self.db.session() as s:
            used = s.scalar(
                sa.select(sa.func.coalesce(sa.func.sum(dbm.StoreRecord.size_mb), 0)).where(
                    dbm.StoreRecord.tenant_id == tenant
                )
            )
        if (used + add_mb) / 1024 > q:
            raise QuotaExceeded(
                f"max_volume_gb {q} would be exceeded: {used / 1024:.2f} GB of volumes and drives + "
                f"{add_mb / 1024:.2f} GB asked; delete or shrink one first"
            )

    def check_pool(self, tenant: str, template: str, new_max: int) -> None:
        q = self.limits(tenant).get("max_pool_slots")
        if q is None:
            return
        with self.db.session() as s:
            others = [
                (t.pool or {}).get("max", 0)
                for t in s.scalars(
                    sa.select(dbm.TemplateRecord).where(dbm.TemplateRecord.tenant_id == tenant)
                )
                if t.name != template
            ]
        if sum(others) + new_max > q:
            raise QuotaExceeded(
                f"max_pool_slots {q} would be exceeded: {sum(others)} slots in other pools + {new_max} asked"
            )

    def check_build(self, tenant: str) -> None:
        q = self.limits(tenant).get("build_minutes_per_day")
        if q is None:
            return
        now = _now()
        day = now.replace(hour=0, minute=0, second=0, microsecond=0)
        with self.db.session() as s:
            builds = list(
                s.scalars(
                    sa.select(dbm.BuildRecord).where(
                        (dbm.BuildRecord.tenant_id == tenant) & (dbm.BuildRecord.created_at >= day)
                    )
                )
            )
        minutes = sum(
            ((_aware(b.finished_at) if b.finished_at else now) - _aware(b.created_at)).total_seconds() / 60
            for b in builds
        )
        if minutes >= q:
            raise QuotaExceeded(
                f"build_minutes_per_day {q} reached: {minutes:.1f} minutes of builds today (UTC)"
            )

    def use(self, tenant: str) -> dict:
        """What the tenant uses now, by quota key (for GET /v1/tenants/{id})."""
        with self.db.engine.connect() as conn:
            u = self._sandbox_use(conn, tenant)
        with self.db.session() as s:
            stores = s.scalar(
                sa.select(sa.func.coalesce(sa.func.sum(dbm.StoreRecord.size_mb), 0)).where(
                    dbm.StoreRecord.tenant_id == tenant
                )
            )
        with self.db.engine.connect() as conn:
            snapshots, snapshot_bytes = self._snapshot_use(conn, tenant)
        return {
            "running": u["running"],
            "memory_mb": u["memory_mb"],
            "standby_gb": round(u["standby_mb"] / 1024, 3),
            "volume_gb": round(stores / 1024, 3),
            "creates_last_minute": len(u["recent"]),
            "snapshots": snapshots,
            "snapshot_gb": round(snapshot_bytes / 1024**3, 3),
        }
