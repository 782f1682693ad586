"""Tenant quotas: admission of creates, claims, stores, pools and builds against a tenant's limits.

A tenant's quotas (controlplane.auth QUOTA_KEYS, on its record; a key left out is unlimited):
`max_running` and `max_memory_mb` (sandboxes running or being created, pooled ones not counted
until claimed), `max_standby_gb` (standby storage: the disk size of its sandboxes in the disk and
archive tiers — an upper bound of what they hold), `max_volume_gb` (volumes and drives, by size),
`creates_per_minute` (creates and claims in the last 60 s: 429 with Retry-After), `max_pool_slots`
(the `max` of its templates' pools, summed), `build_minutes_per_day` (its template builds since
00:00 UTC, running ones counted to now).

Admission is check-and-reserve in one step of the event loop: the use is counted from the
database plus the admissions in flight (reserved until their record is written), so two creates
racing for the last slot cannot both pass on this server. `insert` then writes the record in a
transaction that holds the database's write lock (SQLite `BEGIN IMMEDIATE`; on PostgreSQL a row
lock on the tenant) and counts again, so servers sharing a database cannot overshoot either. A
refusal names the quota by its key, its limit and the current use. Lowering a quota below the use
is allowed: new admissions are refused, nothing running is touched.
Called by controlplane.lifecycle (create), pools (claim, pool settings), stores and templates.
"""

from __future__ import annotations

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

        def release() -> None:
            pending.running -= 1
            pending.memory_mb -= memory_mb
            pending.creates -= 1
            if not (pending.running or pending.creates) and self._pending.get(tenant) is pending:
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
            conn = s.connection()
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                conn.execute(
                    sa.select(auth.TenantRecord.id)
                    .where(auth.TenantRecord.id == rec.tenant_id)
                    .with_for_update()
                )
            self._check_sandbox(limits, self._sandbox_use(conn, rec.tenant_id), others, rec.memory_mb)
            s.add(rec)
            s.commit()
        if ticket is not None:
            ticket.done()

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
        return {
            "running": u["running"],
            "memory_mb": u["memory_mb"],
            "standby_gb": round(u["standby_mb"] / 1024, 3),
            "volume_gb": round(stores / 1024, 3),
            "creates_last_minute": len(u["recent"]),
        }
