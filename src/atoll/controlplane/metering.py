"""Metering: what each sandbox, volume, drive and template build used, per interval, and its cost.

`Meter` runs in the server (started by controlplane.main and testing.control_plane.FakeAtoll next
to the tier policy) and ticks every TICK_S. Each tick accrues, for every subject, the time since
its last accrued point:

- a sandbox (the ledger's live records): `memory_gb_seconds` while running (its memory limit,
  `memory_mb`), `standby_memory_gb_seconds` in the memory tier (the limit stays reserved, no CPU;
  the memory tier holds no image, so nothing else accrues), `snapshot_disk_gb_seconds` /
  `snapshot_archive_gb_seconds` in the disk / archive tier at the bytes its image really takes
  (the worker's UsageReport `snapshots`, worker.runtimes.retained: allocated blocks of checkpoint
  + upper layer image on disk, the object's size in the store), and `cpu_seconds` from the
  worker's UsageReports (the runtime cgroup's CPU time since that runtime generation started: a
  restore starts a new generation at 0, so a lower reading or a new `generation` counts from 0);
- a volume or drive (the stores table): `volume_gb_seconds` / `drive_gb_seconds` of the bytes used
  in it (the report's `stores`: statvfs of the mounted filesystem, from the worker that keeps it;
  for a filer drive from any worker that mounts it);
- a template build while it builds: `build_seconds`;
- a named snapshot (controlplane.snapshots): `snapshot_disk_gb_seconds` of its bytes on its
  worker's disk (measured once, when it is taken), from its creation until its record is deleted.

Measured bytes: an image is measured once per standby (a report from before the standby began is
not used); accrual of a standby image or a store waits for the first measurement up to
MEASURE_WAIT_S (the workers report every 5 s) and then accrues the waited time at that rate, so
usage stays continuous. When no measurement comes (a worker of an earlier version, an archive
adopted without its manifest, an unmounted store) it accrues at the bound after MEASURE_WAIT_S:
`disk_mb` for an image, `size_mb` for a store. A store keeps its last measurement while its worker
is away; the rate of a GiB is 2^30 bytes.

A state change between two ticks is placed at the record's `updated_at`. Amounts go into aligned
intervals of INTERVAL_S (`usage_intervals`, keyed by subject and interval start) and are written
every FLUSH_S together with each subject's cursor (`usage_cursors`: accrued up to when, the CPU
reading counted) in one transaction, as increments: a restart continues from the cursors, so
nothing is counted twice and the time the server was down is accrued from the records' states
(the CPU counter is cumulative, so CPU used meanwhile is found in the first report after). Usage
not yet written is kept in memory and included in queries (`usage`), which tick first: answers
include usage up to the moment of the request (CPU up to the worker's last report).

Egress and ingress bytes are the TCP payload bytes on the sandbox's side of its gateway
connections (gateway.egress reads TCP_INFO; outbound connections and previews alike), from the
worker's reports, which count from the worker's start (a lower reading counts from 0). A price sheet (`ATOLL_PRICES`: JSON, or a path to a JSON file; a price per unit of
each field) turns usage into `cost`. Per-tenant totals since the server started are exported to
Prometheus (`atoll_usage_*_total{tenant}`). With several servers only the holder of the `leader`
lease (controlplane.leases) accrues and writes (every server receives every worker's usage reports:
controlplane.workers subscribes to those of workers other servers hold), its flush fenced by the lease; a server that
takes the lease continues from the cursors, one that loses it drops what it had not written.
Called by controlplane.routes_usage (queries), controlplane.main and testing.control_plane
(start/stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import time
import typing

import sqlalchemy as sa
from prometheus_client.core import CounterMetricFamily
from sqlalchemy.orm import Mapped, mapped_column

from atoll.controlplane import db as dbm
from atoll.controlplane import metrics
from atoll.core import errors, mounts
from atoll.core import worker_api as api
from atoll.core.lifecycle import State, Tier

if typing.TYPE_CHECKING:
    from atoll.controlplane.lifecycle import SandboxManager

log = logging.getLogger(__name__)

INTERVAL_S = 300
"""Width of a stored interval (seconds, aligned to the epoch); query ranges round out to it."""
TICK_S = 1.0
FLUSH_S = 10.0
MEASURE_WAIT_S = 12.0
"""How long accrual of a standby image or a store waits for its worker's first measurement (the
workers report every 5 s) before it accrues at the size bound (a worker of an earlier version, or
one that cannot measure it)."""
GIB_PER_BYTE = 1 / 2**30
MAX_RANGE_DAYS = 366
GIB_PER_MB = 1 / 1024

STORED = (
    "cpu_seconds",
    "memory_gb_seconds",
    "standby_memory_gb_seconds",
    "snapshot_disk_gb_seconds",
    "snapshot_archive_gb_seconds",
    "volume_gb_seconds",
    "drive_gb_seconds",
    "egress_bytes",
    "ingress_bytes",
    "build_seconds",
)
"""The columns of an interval."""
FIELDS = (
    "cpu_seconds",
    "memory_gb_seconds",
    "standby_memory_gb_seconds",
    "snapshot_gb_seconds",
    "snapshot_disk_gb_seconds",
    "snapshot_archive_gb_seconds",
    "volume_gb_seconds",
    "drive_gb_seconds",
    "egress_bytes",
    "ingress_bytes",
    "build_seconds",
)
"""What a usage item reports (snapshot_gb_seconds = disk + archive), before `cost`."""
PRICED = tuple(f for f in FIELDS if f != "snapshot_gb_seconds")

DEFAULT_PRICES: dict[str, float] = {
    "cpu_seconds": 0.000014,
    "memory_gb_seconds": 0.0000045,
    "standby_memory_gb_seconds": 0.0000015,
    "snapshot_disk_gb_seconds": 0.00000004,
    "snapshot_archive_gb_seconds": 0.00000001,
    "volume_gb_seconds": 0.00000004,
    "drive_gb_seconds": 0.00000004,
    "egress_bytes": 0.0,
    "ingress_bytes": 0.0,
    "build_seconds": 0.000014,
}
"""Illustrative prices (currency units per unit); `ATOLL_PRICES` replaces any of them."""


class UsageInterval(dbm.Base):
    """What one subject used in one interval [start, start + INTERVAL_S)."""

    __tablename__ = "usage_intervals"

    subject: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    """A sandbox id, `volume:<name>`, `drive:<name>`, `build:<id>` or `snapshot:<snapshot id>`."""
    start: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, index=True)
    """The interval's start (Unix seconds, a multiple of INTERVAL_S)."""
    tenant_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    sandbox_id: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    cpu_seconds: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    memory_gb_seconds: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    standby_memory_gb_seconds: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    snapshot_disk_gb_seconds: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    snapshot_archive_gb_seconds: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    volume_gb_seconds: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    drive_gb_seconds: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    egress_bytes: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    ingress_bytes: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    build_seconds: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")


class UsageCursor(dbm.Base):
    """How far a subject's usage is accrued (written with the intervals, in one transaction)."""

    __tablename__ = "usage_cursors"

    subject: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(64))
    accrued_to: Mapped[float] = mapped_column(sa.Float)
    """Unix seconds up to which its usage is in usage_intervals."""
    state: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    """What it was at accrued_to ("running", "standby:memory", …), for the gap after a restart."""
    cpu_generation: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    cpu_seen: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    """The CPU reading (of `cpu_generation`) already counted."""
    egress_seen: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    ingress_seen: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    """The worker's byte counters already counted (they count from the worker's start)."""


CURSOR_SET = ("tenant_id", "accrued_to", "state", "cpu_generation", "cpu_seen", "egress_seen", "ingress_seen")
MARK = "_meter"
"""The cursor row that says up to when the meter last wrote (a subject first seen after a restart
starts there, or at its creation if later)."""


# ---- prices ---------------------------------------------------------------------------------------


def load_prices(value: str | None = None) -> dict[str, float]:
    """The price sheet: DEFAULT_PRICES with `ATOLL_PRICES` (JSON object, or a path to a file with
    one) over it. A bad sheet raises errors.InvalidRequest naming what is wrong (checked at start)."""
    value = os.environ.get("ATOLL_PRICES") if value is None else value
    prices = dict(DEFAULT_PRICES)
    if not value or not value.strip():
        return prices
    text = value
    if not value.lstrip().startswith("{"):
        try:
            with open(value) as f:
                text = f.read()
        except OSError as e:
            raise errors.InvalidRequest(
                f"ATOLL_PRICES: cannot read price file {value!r}: {e.strerror}"
            ) from None
    try:
        sheet = json.loads(text)
    except ValueError as e:
        raise errors.InvalidRequest(f"ATOLL_PRICES is not valid JSON: {e}") from None
    if not isinstance(sheet, dict):
        raise errors.InvalidRequest("ATOLL_PRICES must be a JSON object {field: price per unit}")
    for k, v in sheet.items():
        if k not in PRICED:
            raise errors.InvalidRequest(f"ATOLL_PRICES: unknown field {k!r}; known: {', '.join(PRICED)}")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise errors.InvalidRequest(f"ATOLL_PRICES: {k} must be a number >= 0, got {v!r}")
        prices[k] = float(v)
    return prices


# ---- accrual --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Cursor:
    tenant_id: str
    accrued_to: float
    state: str | None
    sandbox_id: str | None = None
    cpu_generation: int = 0
    cpu_seen: float = 0.0
    egress_seen: int = 0
    ingress_seen: int = 0
    report: object = None
    """The last UsageReport item counted (identity: a new report is a new object)."""
    dirty: bool = True
    measured: float | None = None
    """GiB its worker last measured of its standby image (this standby) or of its store; None:
    none yet (accrual waits up to MEASURE_WAIT_S for one, then falls back to the bound)."""
    stale: object = None
    """The image measurement held when this standby began (a report from before it: not used)."""
    waiting_since: float | None = None


def _epoch(t: dt.datetime | None) -> float | None:
    if t is None:
        return None
    if t.tzinfo is None:  # SQLite hands datetimes back naive; they are UTC
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def sandbox_state(rec: dbm.SandboxRecord) -> str | None:
    """What a sandbox record is billed as: running, standby:<tier>, or None (nothing accrues)."""
    if rec.state == State.RUNNING:
        return "running"
    if rec.state == State.STANDBY and rec.standby_tier:
        return f"standby:{rec.standby_tier}"
    return None


SNAPSHOT_STATES = frozenset({f"standby:{Tier.DISK.value}", f"standby:{Tier.ARCHIVE.value}"})

TIER_STATE = {t: f"standby:{t.value}" for t in Tier}

STATE_FIELD = {
    "running": "memory_gb_seconds",
    f"standby:{Tier.MEMORY.value}": "standby_memory_gb_seconds",
    f"standby:{Tier.DISK.value}": "snapshot_disk_gb_seconds",
    f"standby:{Tier.ARCHIVE.value}": "snapshot_archive_gb_seconds",
    "volume": "volume_gb_seconds",
    "drive": "drive_gb_seconds",
    "build": "build_seconds",
    "named_snapshot": "snapshot_disk_gb_seconds",
}


class Meter:
    """Accrues usage each tick (see the module docstring); `usage` answers queries."""

    def __init__(
        self,
        manager: SandboxManager,
        m: metrics.Metrics | None = None,
        *,
        clock: typing.Callable[[], float] = time.time,
        prices: dict[str, float] | None = None,
    ):
        self.manager = manager
        self.db = manager.db
        self.clock = clock
        """Unix seconds now (tests inject one to move time)."""
        self.prices = prices if prices is not None else load_prices()
        self.cursors: dict[str, _Cursor] = {}
        self.pending: dict[tuple[str, int], dict[str, float]] = {}
        """(subject, interval start) -> amounts accrued but not yet written."""
        self.pending_meta: dict[str, tuple[str, str | None]] = {}
        """subject -> (tenant_id, sandbox_id) of pending rows."""
        self.totals: dict[str, dict[str, float]] = {}
        """tenant -> field -> amount since this server started (the Prometheus counters)."""
        self.mark: float | None = None
        self._loaded = False
        self._last_flush = 0.0
        self._task: asyncio.Task | None = None
        self._upsert_cache: dict[str, typing.Any] = {}
        self._retained: dict[
            str, tuple[object, dict[str, api.SnapshotUsage], dict[tuple[str, str], int]]
        ] = {}
        """worker id -> (its last report, images by sandbox id, stores' bytes by (kind, worker name))."""
        if m is not None:
            m.registry.register(_UsageCollector(self))
        self.leader = getattr(manager, "leader", None)
        """The server's hold on the `leader` lease (controlplane.leases): only its holder accrues
        and writes; None (a bare manager in a test): always."""
        if self.leader is not None:
            self.leader.listeners.append(self._lease_changed)

    def _leading(self) -> bool:
        return self.leader is None or not self.leader.started or self.leader.held

    def _lease_changed(self, held: bool) -> None:
        """Taken or lost, what is in memory is not this server's to write: the cursors are read
        again from what the last holder wrote (at the next tick), and usage accrued here but not
        written is dropped — the holder accrues it from the cursors, nothing is counted twice."""
        if self.pending:
            log.info("metering: %d unwritten interval(s) left to the lease's holder", len(self.pending))
        self.cursors.clear()
        self.pending.clear()
        self.pending_meta.clear()
        self.mark = None
        self._loaded = False
        self._last_flush = 0.0

    # ---- loop --------------------------------------------------------------------------------
    def start(self) -> None:
        self.load()
        self._task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if not self._leading():  # another server meters
                continue
            try:
                self.tick()
            except dbm.UNAVAILABLE as e:
                log.warning("metering tick skipped: the records database is unavailable (%s)", dbm.cause(e))
            except Exception:  # noqa: BLE001 - a failed pass is retried at the next tick
                log.exception("metering tick failed")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self._leading():
            return
        try:
            self.tick(flush=True)
        except Exception:  # noqa: BLE001 - the next start accrues the gap from the cursors
            log.exception("metering: last flush failed")

    def load(self) -> None:
        """The cursors written before (a restart continues from them)."""
        with self.db.session() as s:
            rows = list(s.scalars(sa.select(UsageCursor)))
        for r in rows:
            if r.subject == MARK:
                self.mark = r.accrued_to
                continue
            self.cursors[r.subject] = _Cursor(
                r.tenant_id,
                r.accrued_to,
                r.state,
                r.subject if r.subject.startswith("sb-") else None,
                r.cpu_generation,
                r.cpu_seen,
                r.egress_seen or 0,
                r.ingress_seen or 0,
                dirty=False,
            )
        self._loaded = True

    # ---- one pass ----------------------------------------------------------------------------
    def tick(self, now: float | None = None, *, flush: bool = False) -> None:
        """Accrue everything up to `now` (default: the clock); write it every FLUSH_S."""
        if not self._loaded:
            self.load()
        now = self.clock() if now is None else now
        if self.mark is None:
            self.mark = now  # the first start ever: usage begins now, nothing before is known
        seen: set[str] = set()
        for rec in list(self.manager.ledger.cache.values()):
            seen.add(rec.id)
            self._sandbox(rec, now)
        for subject in [s for s in self.cursors if s.startswith("sb-") and s not in seen]:
            self._gone(subject, now)
        self._stores_and_builds(now)
        if flush or now - self._last_flush >= FLUSH_S:
            self.flush(now)

    def _cursor(
        self, subject: str, tenant_id: str, state: str | None, since: float | None, now: float
    ) -> _Cursor:
        c = self.cursors.get(subject)
        if c is None:
            start = max(since if since is not None else now, self.mark if self.mark is not None else now)
            c = self.cursors[subject] = _Cursor(tenant_id, min(start, now), state)
        return c

    def _measurements(
        self, worker_id: str | None
    ) -> tuple[dict[str, api.SnapshotUsage], dict[tuple[str, str], int]] | None:
        """The images and stores `worker_id` measured in its last report (indexed once per report)."""
        if worker_id is None:
            return None
        report = self.manager.ledger.retained.get(worker_id)
        if report is None:
            return None
        known = self._retained.get(worker_id)
        if known is None or known[0] is not report:
            snaps = {u.sandbox_id: u for u in getattr(report, "snapshots", ())}
            stores = {(u.kind, u.name): u.used_bytes for u in getattr(report, "stores", ())}
            known = self._retained[worker_id] = (report, snaps, stores)
        return known[1], known[2]

    def _image(self, rec: dbm.SandboxRecord) -> api.SnapshotUsage | None:
        m = self._measurements(rec.worker_id)
        return m[0].get(rec.id) if m is not None else None

    def _store_bytes(self, worker_id: str | None, backend: str | None, kind: str, wname: str) -> int | None:
        m = self._measurements(worker_id)
        used = m[1].get((kind, wname)) if m is not None else None
        if used is None and backend == "filer":  # every worker with the filer mounts it
            for wid in list(self.manager.ledger.retained):
                m = self._measurements(wid)
                if m is not None and (kind, wname) in m[1]:
                    return m[1][(kind, wname)]
        return used

    @staticmethod
    def _waited(c: _Cursor, now: float) -> bool:
        """Whether accrual without a measurement has waited long enough to take the bound."""
        if c.waiting_since is None:
            c.waiting_since = now
        return now - c.waiting_since >= MEASURE_WAIT_S

    def _sandbox(self, rec: dbm.SandboxRecord, now: float) -> None:
        state = sandbox_state(rec)
        c = self._cursor(rec.id, rec.tenant_id, state, _epoch(rec.created_at), now)
        c.sandbox_id = rec.id
        c.tenant_id = rec.tenant_id
        gb = rec.memory_mb * GIB_PER_MB
        bound_gb = rec.disk_mb * GIB_PER_MB
        if state != c.state:
            changed = _epoch(rec.updated_at)
            if changed is not None and c.accrued_to < changed < now:
                self._time(rec.id, c, c.state, gb, _or(c.measured, bound_gb), changed)
            c.state = state
            since = min(now, max(changed if changed is not None else now, c.accrued_to))
            c.measured, c.waiting_since, c.stale = None, since, self._image(rec)
        if state in SNAPSHOT_STATES:
            image = self._image(rec)
            if image is not None and image is not c.stale and state == TIER_STATE.get(image.tier):
                c.measured = image.bytes * GIB_PER_BYTE
            if c.measured is not None or self._waited(c, now):
                self._time(rec.id, c, state, gb, _or(c.measured, bound_gb), now)
        else:
            self._time(rec.id, c, state, gb, bound_gb, now)
        u = self.manager.usage.get(rec.id)
        if u is not None and u is not c.report:
            c.report = u
            gen = getattr(u, "generation", 0)
            if gen != c.cpu_generation or u.cpu_seconds < c.cpu_seen:
                delta = u.cpu_seconds  # a new runtime generation: its cgroup counts from 0
            else:
                delta = u.cpu_seconds - c.cpu_seen
            c.cpu_generation, c.cpu_seen = gen, u.cpu_seconds
            if delta > 0:
                self._add(rec.id, c, "cpu_seconds", delta, now)
            for field, attr in (("egress_bytes", "egress_seen"), ("ingress_bytes", "ingress_seen")):
                value = int(getattr(u, field, 0))
                seen = getattr(c, attr)
                moved = value - seen if value >= seen else value  # a restarted worker counts from 0
                setattr(c, attr, value)
                if moved > 0:
                    self._add(rec.id, c, field, moved, now)
            c.dirty = True

    def _time(
        self, subject: str, c: _Cursor, state: str | None, gb: float, disk_gb: float, to: float
    ) -> None:
        """Accrue [c.accrued_to, to) in `state` and move the cursor."""
        start = c.accrued_to
        if to <= start:
            return
        field = STATE_FIELD.get(state or "")
        if field is not None:
            rate = disk_gb if field.startswith("snapshot_") else (1.0 if field == "build_seconds" else gb)
            if rate > 0:
                self._spread(subject, c, field, rate, start, to)
        c.accrued_to = to
        c.dirty = True

    def _spread(self, subject: str, c: _Cursor, field: str, rate: float, start: float, end: float) -> None:
        """rate × seconds of [start, end) into the intervals it spans."""
        t = start
        while t < end:
            bucket = int(t // INTERVAL_S) * INTERVAL_S
            upto = min(end, bucket + INTERVAL_S)
            self._put(subject, c, bucket, field, rate * (upto - t))
            t = upto

    def _add(self, subject: str, c: _Cursor, field: str, amount: float, at: float) -> None:
        self._put(subject, c, int(at // INTERVAL_S) * INTERVAL_S, field, amount)

    def _put(self, subject: str, c: _Cursor, bucket: int, field: str, amount: float) -> None:
        row = self.pending.get((subject, bucket))
        if row is None:
            row = self.pending[(subject, bucket)] = {}
            self.pending_meta[subject] = (c.tenant_id, c.sandbox_id)
        row[field] = row.get(field, 0.0) + amount
        t = self.totals.setdefault(c.tenant_id, {})
        t[field] = t.get(field, 0.0) + amount

    def _gone(self, subject: str, now: float) -> None:
        """A sandbox no longer in the ledger (deleted): accrue up to its deletion, drop the cursor."""
        c = self.cursors[subject]
        if c.report == "gone":  # done; its cursor goes at the next write
            return
        rec = self.db.get(subject)
        end = now
        if rec is not None:
            end = min(now, _epoch(rec.deleted_at) or _epoch(rec.updated_at) or now)
            gb, disk_gb = rec.memory_mb * GIB_PER_MB, _or(c.measured, rec.disk_mb * GIB_PER_MB)
            self._time(subject, c, c.state, gb, disk_gb, max(end, c.accrued_to))
        c.state = None
        c.accrued_to = max(c.accrued_to, end)
        c.dirty = True
        c.report = "gone"

    def _stores_and_builds(self, now: float) -> None:
        with self.db.engine.connect() as conn:
            stores = conn.execute(
                sa.select(
                    dbm.StoreRecord.tenant_id,
                    dbm.StoreRecord.kind,
                    dbm.StoreRecord.name,
                    dbm.StoreRecord.size_mb,
                    dbm.StoreRecord.created_at,
                    dbm.StoreRecord.worker_id,
                    dbm.StoreRecord.backend,
                )
            ).all()
            horizon = dt.datetime.fromtimestamp(min(self.mark or now, now) - 3600, dt.UTC)
            builds = conn.execute(
                sa.select(
                    dbm.BuildRecord.id,
                    dbm.BuildRecord.tenant_id,
                    dbm.BuildRecord.created_at,
                    dbm.BuildRecord.finished_at,
                ).where(sa.or_(dbm.BuildRecord.finished_at.is_(None), dbm.BuildRecord.finished_at >= horizon))
            ).all()
            snapshots = conn.execute(
                sa.select(
                    dbm.SnapshotRecord.id,
                    dbm.SnapshotRecord.tenant_id,
                    dbm.SnapshotRecord.bytes,
                    dbm.SnapshotRecord.created_at,
                )
            ).all()
        live: set[str] = set()
        for (
            sid,
            tenant_id,
            size,
            created_at,
        ) in snapshots:  # named snapshots: kept bytes, as a disk-tier image
            subject = f"snapshot:{sid}"
            live.add(subject)
            c = self._cursor(subject, tenant_id, "named_snapshot", _epoch(created_at), now)
            self._time(subject, c, "named_snapshot", 0.0, (size or 0) * GIB_PER_BYTE, now)
        for tenant_id, kind, name, size_mb, created_at, worker_id, backend in stores:
            subject = f"{kind}:{tenant_id}/{name}"
            live.add(subject)
            c = self._cursor(subject, tenant_id, kind, _epoch(created_at), now)
            used = self._store_bytes(worker_id, backend, kind, mounts.worker_name(tenant_id, name))
            if used is not None:
                c.measured = used * GIB_PER_BYTE
            if c.measured is not None or self._waited(c, now):
                self._time(subject, c, kind, _or(c.measured, (size_mb or 0) * GIB_PER_MB), 0.0, now)
        for bid, tenant_id, created_at, finished_at in builds:
            subject = f"build:{bid}"
            end = _epoch(finished_at)
            if subject not in self.cursors and end is not None and self.mark is not None and end <= self.mark:
                continue  # finished before metering knew of it
            live.add(subject)
            c = self._cursor(subject, tenant_id, "build", _epoch(created_at), now)
            self._time(subject, c, "build", 1.0, 0.0, min(now, end) if end is not None else now)
        for subject in [s for s in self.cursors if not s.startswith("sb-") and s not in live]:
            c = self.cursors[subject]
            if c.state is not None:
                c.state, c.dirty = None, True

    # ---- writing -----------------------------------------------------------------------------
    def _upsert(self, table: sa.Table, keys: tuple[str, ...], add: tuple[str, ...], set_: tuple[str, ...]):
        """INSERT … ON CONFLICT DO UPDATE (SQLite and PostgreSQL): `add` columns add up, `set_`
        columns are replaced."""
        from sqlalchemy.dialects import postgresql, sqlite

        insert: typing.Any = (
            postgresql.insert if self.db.engine.dialect.name == "postgresql" else sqlite.insert
        )
        stmt = insert(table)
        values = {k: table.c[k] + stmt.excluded[k] for k in add}
        values.update({k: stmt.excluded[k] for k in set_})
        return stmt.on_conflict_do_update(index_elements=list(keys), set_=values)

    def flush(self, now: float) -> None:
        """Write pending amounts (as increments) with the cursors, in one transaction."""
        rows = []
        for (subject, bucket), amounts in self.pending.items():
            tenant_id, sandbox_id = self.pending_meta[subject]
            rows.append(
                {
                    "subject": subject,
                    "start": bucket,
                    "tenant_id": tenant_id,
                    "sandbox_id": sandbox_id,
                    **{f: amounts.get(f, 0.0) for f in STORED},
                }
            )
        cursors = [
            {
                "subject": s,
                "tenant_id": c.tenant_id,
                "accrued_to": c.accrued_to,
                "state": c.state,
                "cpu_generation": c.cpu_generation,
                "cpu_seen": c.cpu_seen,
                "egress_seen": c.egress_seen,
                "ingress_seen": c.ingress_seen,
            }
            for s, c in self.cursors.items()
            if c.dirty
        ]
        cursors.append(
            {
                "subject": MARK,
                "tenant_id": "",
                "accrued_to": now,
                "state": None,
                "cpu_generation": 0,
                "cpu_seen": 0.0,
                "egress_seen": 0,
                "ingress_seen": 0,
            }
        )
        ints = typing.cast(sa.Table, UsageInterval.__table__)
        curs = typing.cast(sa.Table, UsageCursor.__table__)
        if "i" not in self._upsert_cache:
            self._upsert_cache["i"] = self._upsert(ints, ("subject", "start"), STORED, ())
            self._upsert_cache["c"] = self._upsert(
                curs,
                ("subject",),
                (),
                CURSOR_SET,
            )
        gone = [s for s, c in self.cursors.items() if c.state is None and c.report == "gone"]
        gone += [s for s, c in self.cursors.items() if c.state is None and not s.startswith("sb-")]
        try:
            with self.db.engine.begin() as conn:
                lease = self.leader
                if (
                    lease is not None
                    and lease.started
                    and not lease.leases.fence(conn, lease.name, lease.server_id)
                ):
                    raise _NotHolder
                if rows:
                    conn.execute(self._upsert_cache["i"], rows)
                conn.execute(self._upsert_cache["c"], cursors)
                if gone:
                    conn.execute(sa.delete(curs).where(curs.c.subject.in_(gone)))
        except _NotHolder:  # rolled back: the holder (another server now) accrues it
            log.warning("metering: not written, this server no longer holds the lease")
            self._lease_changed(False)
            return
        self.pending.clear()
        self.pending_meta.clear()
        for c in self.cursors.values():
            c.dirty = False
        for s in gone:
            self.cursors.pop(s, None)
        self.mark = now
        self._last_flush = now

    # ---- queries -----------------------------------------------------------------------------
    def usage(self, start: float, end: float, group_by: str, tenant_id: str | None) -> dict:
        """Usage in the intervals that overlap [start, end), grouped (`sandbox`, `day`, `tenant`),
        of `tenant_id` (None: every tenant), with the pending (open) part: accrued up to now. On a
        server that does not hold the `leader` lease: what its holder wrote (up to FLUSH_S old)."""
        if self._leading():
            self.tick()
        lo = int(start // INTERVAL_S) * INTERVAL_S
        t = typing.cast(sa.Table, UsageInterval.__table__)
        sums = [sa.func.sum(t.c[f]) for f in STORED]
        day = t.c.start - t.c.start % 86400
        if group_by == "sandbox":
            keys: list = [t.c.subject, t.c.tenant_id, t.c.sandbox_id]
        elif group_by == "day":
            keys = [day, t.c.tenant_id, t.c.tenant_id]  # (tenant unused)
        else:
            keys = [t.c.tenant_id, t.c.tenant_id, t.c.tenant_id]
        q = sa.select(*keys, *sums).where(t.c.start >= lo, t.c.start < end).group_by(*dict.fromkeys(keys))
        if tenant_id is not None:
            q = q.where(t.c.tenant_id == tenant_id)
        groups: dict[tuple, dict[str, float]] = {}

        def add(
            subject: str, bucket: int, tenant: str, sandbox: str | None, amounts: typing.Iterable
        ) -> None:
            if group_by == "sandbox":
                key: tuple = (subject, sandbox, tenant)
            elif group_by == "day":
                key = (dt.datetime.fromtimestamp(bucket, dt.UTC).date().isoformat(),)
            else:
                key = (tenant,)
            g = groups.setdefault(key, dict.fromkeys(STORED, 0.0))
            for f, v in amounts:
                g[f] += v or 0.0

        with self.db.engine.connect() as conn:  # summed by the database, one row per group
            for row in conn.execute(q):
                k0, k1, k2, values = row[0], row[1], row[2], zip(STORED, row[3:], strict=True)
                if group_by == "sandbox":
                    add(k0, 0, k1, k2, values)
                elif group_by == "day":
                    add("", int(k0), "", None, values)
                else:
                    add("", 0, k0, None, values)
        for (subject, bucket), amounts in self.pending.items():
            tenant, sandbox = self.pending_meta[subject]
            if lo <= bucket < end and (tenant_id is None or tenant == tenant_id):
                add(subject, bucket, tenant, sandbox, amounts.items())
        items = []
        for key, amounts in sorted(groups.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
            view = self.view(amounts)
            if group_by == "sandbox":
                items.append({"subject": key[0], "sandbox_id": key[1], "tenant_id": key[2], **view})
            elif group_by == "day":
                items.append({"day": key[0], **view})
            else:
                items.append({"tenant_id": key[0], **view})
        total = dict.fromkeys(STORED, 0.0)
        for amounts in groups.values():
            for f in STORED:
                total[f] += amounts[f]
        whole = self.view(total)
        whole["cost"] = round(sum(i["cost"] for i in items), 6)  # the items' costs add up to it
        return {"from": _iso(lo), "to": _iso(end), "group_by": group_by, "items": items, "total": whole}

    def view(self, amounts: dict[str, float]) -> dict[str, float]:
        out = {f: amounts.get(f, 0.0) for f in STORED}
        out["snapshot_gb_seconds"] = out["snapshot_disk_gb_seconds"] + out["snapshot_archive_gb_seconds"]
        out["egress_bytes"] = int(out["egress_bytes"])
        out["ingress_bytes"] = int(out["ingress_bytes"])
        out["cost"] = round(sum(out[f] * self.prices.get(f, 0.0) for f in PRICED), 6)
        return {f: out[f] for f in (*FIELDS, "cost")}


class _NotHolder(Exception):
    """A flush found that this server no longer holds the `leader` lease."""


def _or(measured: float | None, bound: float) -> float:
    return bound if measured is None else measured


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


class _UsageCollector:
    """`atoll_usage_<field>_total{tenant}`: each tenant's usage since this server started."""

    def __init__(self, meter: Meter):
        self.meter = meter

    def collect(self):
        totals = {t: dict(v) for t, v in self.meter.totals.items()}
        for f in STORED:
            c = CounterMetricFamily(
                f"atoll_usage_{f}", f"Usage accrued since the server started: {f}", labels=["tenant"]
            )
            for tenant, amounts in sorted(totals.items()):
                c.add_metric([tenant], amounts.get(f, 0.0))
            yield c
