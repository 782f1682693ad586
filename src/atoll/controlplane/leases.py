"""Leases: which of several `atoll server` processes on one database runs the installation's
background loops, so that each runs exactly once.

Every server serves requests; the loops that act on all sandboxes — the tier policy with
lifetimes (controlplane.policy), the warm pools' keeper (controlplane.pools), the settling of
sandboxes of lost workers (controlplane.lost_workers) and metering's accrual and flush
(controlplane.metering) — run only on the server that holds the `leader` lease. One lease for all
of them, not one per loop: they act on the same records (the keeper deletes pool members the
policy leaves alone, a lost worker's sandbox is one the policy would pause, the meter accrues
every state change the others make), so one holder sees one consistent picture and one takeover
moves them together; spreading them over servers would save little (they are cheap) and multiply
the windows where two holders overlap.

A lease is a row of `leases` (name, holder, acquired_at, renewed_at, expires_at). `Leases.acquire`
takes or renews it with one conditional upsert, the same on SQLite and PostgreSQL (`INSERT … ON
CONFLICT (name) DO UPDATE … WHERE holder = me OR expires_at < now`): the row is written only by
its holder or once it expired, and the database serializes two writers (SQLite's write lock,
PostgreSQL's row lock and re-check of the WHERE), so two servers never both get it. Times are the
database's clock on PostgreSQL (`clock_timestamp()`, one clock for every server) and the
server's on SQLite (one file, one machine).

`Leadership` is a server's side: a random server id (`server_id`, logged at start), a task that
renews every TTL/3 (ATOLL_LEASE_TTL_S, default 15 s) and, while another server holds it, tries to
take it at the same pace. `held` is true only until TTL after the start of the last successful
renewal on this server's monotonic clock (it stops before any other server can take over, even
when the database stops answering); a renewal refused (another holder) ends it at once. On a
change it calls its listeners (the manager: refresh the records on gain; metering: drop or reload
its state). A clean stop releases the lease (another server takes over at its next try); a server
that dies stops renewing and another takes over TTL after its last renewal, plus up to TTL/3 —
except a server restarted on the same machine after a crash, which takes its dead predecessor's
lease at once (`gone_here`: same host and boot, its PID gone), so `atoll up` restarted after a
SIGKILL does not wait out the TTL before its policy runs.
Metering's writes are fenced: they commit only in a transaction that finds this server still the
holder (`Leases.fence`), so a server stalled past its lease cannot write usage twice.
The same table holds short leases of one step (`holding`): a drain's evacuation holds a sandbox's
`move/<id>` while it moves it (controlplane.evacuation), renewed while the move runs and deleted
after, so two servers never move one sandbox at once.
Made by controlplane.lifecycle.SandboxManager; GET /v1/leases (routes_system) shows the holders.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import secrets
import socket
import time
import typing

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from atoll.controlplane import db as dbm

log = logging.getLogger(__name__)

LEADER = "leader"
"""The one lease of the installation's background loops (see the module docstring)."""
DEFAULT_TTL_S = 15.0


class LeaseRecord(dbm.Base):
    """Who holds a lease until when."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(sa.String(128))
    """The holding server's id (`server_id`)."""
    acquired_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True))
    """When this holder took it (kept across its renewals)."""
    renewed_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True))
    expires_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True))
    """After this, another server may take it."""


def _host() -> str:
    return (socket.gethostname() or "host").split(".")[0][:48]


def _boot() -> str:
    """This machine's boot (the kernel's random boot id, its first 8 characters)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:8] or "noboot"
    except OSError:
        return "noboot"


def server_id() -> str:
    """A new id for this server process: host name, boot id, process id and random bits (unique
    across restarts and machines, and telling an operator which process it is)."""
    return f"{_host()}-{_boot()}-{os.getpid()}-{secrets.token_hex(4)}"


def gone_here(holder: str) -> bool:
    """Whether `holder` was a server process on this machine, in this boot, that no longer runs
    (its PID is gone): a server restarted after a crash takes its own old lease at once instead
    of waiting out the TTL. Any doubt (another host or boot, a PID alive — maybe reused — or not
    ours to signal) is False: then the TTL decides."""
    parts = holder.rsplit("-", 3)
    if len(parts) != 4 or parts[0] != _host() or parts[1] != _boot() or not parts[2].isdigit():
        return False
    pid = int(parts[2])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _aware(t: dt.datetime) -> dt.datetime:
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


class Leases:
    """The `leases` table's queries. `clock`: the current UTC time (tests); default the
    database's clock on PostgreSQL and this machine's on SQLite."""

    def __init__(self, database: dbm.Database, clock: typing.Callable[[], dt.datetime] | None = None):
        self.db = database
        self.clock = clock
        t = typing.cast(sa.Table, LeaseRecord.__table__)
        self._table = t
        if database.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        ins = insert(t).values(
            name=sa.bindparam("name"),
            holder=sa.bindparam("holder"),
            acquired_at=sa.bindparam("now", type_=t.c.acquired_at.type),
            renewed_at=sa.bindparam("now", type_=t.c.renewed_at.type),
            expires_at=sa.bindparam("expires", type_=t.c.expires_at.type),
        )
        self._acquire = ins.on_conflict_do_update(
            index_elements=["name"],
            set_={
                "holder": ins.excluded.holder,
                "acquired_at": sa.case(
                    (t.c.holder == ins.excluded.holder, t.c.acquired_at), else_=ins.excluded.acquired_at
                ),
                "renewed_at": ins.excluded.renewed_at,
                "expires_at": ins.excluded.expires_at,
            },
            where=(t.c.holder == ins.excluded.holder) | (t.c.expires_at < ins.excluded.renewed_at),
        ).returning(t.c.holder)  # a row back: written (psycopg's rowcount of an upsert is -1)

    def now(self, conn: sa.Connection | None = None) -> dt.datetime:
        if self.clock is not None:
            return self.clock()
        if self.db.dialect != "postgresql":
            return dbm.utcnow()
        if conn is not None:
            return _aware(conn.execute(sa.select(sa.func.clock_timestamp())).scalar_one())
        with self.db.engine.connect() as c:
            return _aware(c.execute(sa.select(sa.func.clock_timestamp())).scalar_one())

    def acquire(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take the lease `name` for `holder` for `ttl_s` seconds, or renew it: True when `holder`
        holds it now, False when another holder's has not expired. One atomic statement."""
        with self.db.engine.begin() as conn:
            now = self.now(conn)
            row = conn.execute(
                self._acquire,
                {"name": name, "holder": holder, "now": now, "expires": now + dt.timedelta(seconds=ttl_s)},
            ).first()
        return row is not None

    def holder(self, name: str) -> str | None:
        t = self._table
        with self.db.engine.connect() as conn:
            return conn.execute(sa.select(t.c.holder).where(t.c.name == name)).scalar_one_or_none()

    def take_over(self, name: str, old: str, holder: str, ttl_s: float) -> bool:
        """Take `name` from `old` (a holder known to be gone), whether or not it expired: True when
        `holder` has it now — False when someone else took or renewed it meanwhile."""
        t = self._table
        with self.db.engine.begin() as conn:
            now = self.now(conn)
            n = conn.execute(
                sa.update(t)
                .where(t.c.name == name, t.c.holder == old)
                .values(
                    holder=holder,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=now + dt.timedelta(seconds=ttl_s),
                )
            ).rowcount
        return n == 1

    def release(self, name: str, holder: str) -> bool:
        """Give the lease up (a clean stop): it expires now, so another server takes it at its
        next try. False when `holder` did not hold it."""
        t = self._table
        with self.db.engine.begin() as conn:
            now = self.now(conn)
            n = conn.execute(
                sa.update(t)
                .where(t.c.name == name, t.c.holder == holder)
                .values(expires_at=now - dt.timedelta(seconds=1))
            ).rowcount
        return n == 1

    def drop(self, name: str, holder: str) -> bool:
        """Delete the lease's row if `holder` holds it (a short-lived lease, e.g. a sandbox's
        `move/…`: no row is left behind per sandbox). False when `holder` did not hold it."""
        t = self._table
        with self.db.engine.begin() as conn:
            n = conn.execute(sa.delete(t).where(t.c.name == name, t.c.holder == holder)).rowcount
        return n == 1

    def fence(self, conn: sa.Connection, name: str, holder: str) -> bool:
        """Inside the caller's transaction: whether `holder` still holds `name` (unexpired). The
        row is locked until the transaction ends (an UPDATE that changes nothing), so nobody takes
        the lease between this check and the commit."""
        t = self._table
        now = self.now(conn)
        return (
            conn.execute(
                sa.update(t)
                .where(t.c.name == name, t.c.holder == holder, t.c.expires_at > now)
                .values(holder=t.c.holder)
            ).rowcount
            == 1
        )

    def all(self) -> list[dict]:
        """Every lease row, as GET /v1/leases shows it (`expired`: nobody holds it now)."""
        with self.db.engine.connect() as conn:
            now = self.now(conn)
            rows = conn.execute(sa.select(self._table).order_by(self._table.c.name)).all()
        return [
            {
                "name": r.name,
                "holder": r.holder,
                "acquired_at": _aware(r.acquired_at),
                "renewed_at": _aware(r.renewed_at),
                "expires_at": _aware(r.expires_at),
                "expired": _aware(r.expires_at) <= now,
            }
            for r in rows
        ]


Listener = typing.Callable[[bool], None]


def move_lease(sandbox_id: str) -> str:
    """The name of the lease a server holds while its evacuation moves `sandbox_id`
    (controlplane.evacuation): two servers never move one sandbox at once."""
    return f"move/{sandbox_id}"


@contextlib.asynccontextmanager
async def holding(leases: Leases, name: str, holder: str, ttl_s: float):
    """Hold the lease `name` for the block: yields None while `holder` holds it (renewed every
    third of `ttl_s`, its row dropped at the end), else the holder that has it (nothing held, the
    block should not do what the lease guards). Raises what the database raises when it cannot
    be reached."""
    if not leases.acquire(name, holder, ttl_s):
        yield leases.holder(name) or "another server"
        return

    async def renew() -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                if not leases.acquire(name, holder, ttl_s):
                    log.warning("lease %r: taken by another holder while held (a stalled renewal)", name)
                    return
            except Exception as e:  # noqa: BLE001 - the database is away: try again
                log.warning("lease %r: renewal failed: %s", name, e)

    task = asyncio.ensure_future(renew())
    try:
        yield None
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        try:
            leases.drop(name, holder)
        except Exception as e:  # noqa: BLE001 - it runs out by itself after ttl_s
            log.warning("lease %r: not dropped (it runs out in %g s): %s", name, ttl_s, e)


class Leadership:
    """This server's hold on the `leader` lease (see the module docstring)."""

    def __init__(self, leases: Leases, ttl_s: float = DEFAULT_TTL_S, *, server: str | None = None):
        self.leases = leases
        self.ttl_s = ttl_s
        self.server_id = server or server_id()
        self.name = LEADER
        self.listeners: list[Listener] = []
        """Called with True when this server took the lease, False when it lost or released it."""
        self.renewed: list[typing.Callable[[], None]] = []
        """Called after each renewal while this server holds it (the manager refreshes its records)."""
        self.ticks: list[typing.Callable[[], None]] = []
        """Called after each try, held or not (every server shares its sandboxes' activity)."""
        self._held = False
        self._until = 0.0
        self._task: asyncio.Task | None = None
        self.started = False

    @property
    def held(self) -> bool:
        """Whether this server holds the lease now (false from TTL after its last renewal's start,
        even before the keeper finds out why)."""
        return self._held and time.monotonic() < self._until

    def step(self) -> bool:
        """One try to take or renew the lease; whether this server holds it after."""
        t0 = time.monotonic()
        if self._held and t0 >= self._until:
            self._set(False)  # ran out unnoticed (a stalled loop): another server may have had it since
        try:
            got: bool | None = self.leases.acquire(self.name, self.server_id, self.ttl_s)
            if not got:
                old = self.leases.holder(self.name)
                if (
                    old is not None
                    and gone_here(old)
                    and self.leases.take_over(self.name, old, self.server_id, self.ttl_s)
                ):
                    log.info("lease %r taken over from %s: that server process is gone", self.name, old)
                    got = True
        except Exception as e:  # noqa: BLE001 - the database is away: keep it until the TTL runs out
            log.warning("lease %r: renewal failed: %s", self.name, e)
            got = None
        if got:
            self._until = t0 + self.ttl_s
            self._set(True)
            for f in list(self.renewed):
                try:
                    f()
                except Exception:
                    log.exception("lease %r: a hook failed", self.name)
        elif got is False or time.monotonic() >= self._until:
            self._set(False)
        for f in list(self.ticks):
            try:
                f()
            except Exception:
                log.exception("lease %r: a hook failed", self.name)
        return self.held

    def _set(self, held: bool) -> None:
        if held == self._held:
            return
        self._held = held
        if held:
            log.info(
                "lease %r taken: this server (%s) runs the installation's background loops",
                self.name,
                self.server_id,
            )
        else:
            log.warning(
                "lease %r lost: this server (%s) stops its background loops", self.name, self.server_id
            )
        for f in list(self.listeners):
            try:
                f(held)
            except Exception:
                log.exception("lease %r: a listener failed", self.name)

    async def start(self) -> None:
        """Try once now (a lone server holds it before its loops start), then keep it."""
        log.info("server id %s (lease %r, TTL %g s)", self.server_id, self.name, self.ttl_s)
        self.started = True
        self.step()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            wait = self.ttl_s / 3
            if self._held:  # wake up at the deadline at the latest (the database may be slow)
                wait = max(0.01, min(wait, self._until - time.monotonic()))
            await asyncio.sleep(wait)
            self.step()

    async def aclose(self, *, release: bool = True) -> None:
        """Stop renewing; `release` gives the lease up (a clean stop), else it runs out (as when
        the server dies)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        if release and self._held:
            try:
                self.leases.release(self.name, self.server_id)
            except Exception as e:  # noqa: BLE001 - it runs out by itself
                log.warning("lease %r: release failed: %s", self.name, e)
        self._set(False)
