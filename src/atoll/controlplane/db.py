"""Records of the control plane (SQLAlchemy 2): sandboxes, workers, secrets, templates, their builds,
their pools' claim counts and named snapshots.

The records live in SQLite (embedded, the default: `$ATOLL_HOME/atoll.db`) or PostgreSQL
(`ATOLL_DATABASE_URL=postgresql://…`, through psycopg 3: `engine_url`); the same models, queries
and Alembic migrations serve both, and the tests run on both. Where the two differ the code asks
`Database.dialect` (SQLite's `BEGIN IMMEDIATE` and synchronous pragmas; PostgreSQL's row locks).
Every sandbox record carries a tenant id and the id of the worker that holds it. Schema changes
go through Alembic migrations (`controlplane/migrations`); `open_database` upgrades the database
to the newest revision at start-up. Called by controlplane.lifecycle and controlplane.workers.
"""

from __future__ import annotations

import builtins
import datetime as dt
import importlib.util
import os
import time
import typing

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from atoll.core import errors


class Base(DeclarativeBase):
    pass


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


CLOCK_CHECK_S = 30.0
"""How often a server reads the database's clock again to know how far its own is off (PostgreSQL)."""


class SandboxRecord(Base):
    __tablename__ = "sandboxes"
    __table_args__ = (
        # the order lists page in (controlplane.paging; migration 0015)
        sa.Index("ix_sandboxes_list", "created_at", "id"),
        sa.Index("ix_sandboxes_tenant_list", "tenant_id", "created_at", "id"),
        # the changes the watch stream polls for (controlplane.routes_watch; migration 0024)
        sa.Index("ix_sandboxes_updated", "updated_at"),
        sa.Index("ix_sandboxes_tenant_updated", "tenant_id", "updated_at"),
    )

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    worker_id: Mapped[str] = mapped_column(sa.String(64))
    state: Mapped[str] = mapped_column(sa.String(16), index=True)
    standby_tier: Mapped[str | None] = mapped_column(sa.String(16), nullable=True)
    standby_reason: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    failure_reason: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    template: Mapped[str] = mapped_column(sa.String(64))
    metadata_: Mapped[dict] = mapped_column("metadata", sa.JSON, default=dict)
    env: Mapped[dict] = mapped_column(sa.JSON, default=dict)
    user: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    network: Mapped[dict | None] = mapped_column(sa.JSON, nullable=True)
    """Egress policy in wire form ({"allow_out": [...], "deny_out": [...]}); None = deny all."""
    secrets: Mapped[dict | None] = mapped_column(sa.JSON, nullable=True)
    """{ENV: {"secret": name, "placeholder": "atoll_ph_…"}} (controlplane.secrets); no values."""
    previews: Mapped[dict | None] = mapped_column(sa.JSON, nullable=True)
    """{"public": [ports]}: the ports the ingress router serves without a token."""
    memory_mb: Mapped[int] = mapped_column(sa.Integer)
    cpus: Mapped[float] = mapped_column(sa.Float)
    disk_mb: Mapped[int] = mapped_column(sa.Integer)
    idle_timeout_s: Mapped[float] = mapped_column(sa.Float)
    disk_after_s: Mapped[float] = mapped_column(sa.Float)
    archive_after_s: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    """Seconds in standby (from standby_since) before a disk-tier sandbox moves to the archive (0 = never)."""
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    standby_since: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    last_activity_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    deleted_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    build_id: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    """The user template build it was made from (None: a built-in template)."""
    workdir: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    """Its template's workdir: relative file paths and commands without cwd start there."""
    pooled: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    """A warm pool's sandbox not claimed yet: not listed, not subject to the idle policy."""
    shell: Mapped[str | None] = mapped_column(sa.String(16), nullable=True)
    """How its string commands run: "bash" (bash -l -c), "sh" (sh -c); None = bash when the
    template has it."""
    expires_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    """The end of its lifetime (create's timeout_s; PATCH extends it); None = no lifetime."""
    on_timeout: Mapped[str] = mapped_column(sa.String(16), default="pause", server_default="pause")
    """What its lifetime's end does: "pause" (the disk tier) or "delete"."""
    on_worker_lost: Mapped[str] = mapped_column(sa.String(16), default="fail", server_default="fail")
    """What happens to it, running or in the memory/disk tier, once its worker has been lost for
    ATOLL_WORKER_GONE_S (controlplane.lost_workers): "fail", or "restore" (from its last archive
    in the object store, on another worker; its resumes keep that archive)."""
    version: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    """Bumped by every write (Database.save): a write made from a stale copy (another server
    wrote since it was read) matches no row and fails with `sandbox_changed` (no lost update)."""
    resume_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    """Why the last resume from the disk tier failed (it stays in standby); None once one succeeds."""
    resume_failures: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    """Failed resumes in a row; the sandbox is failed at ledger.MAX_RESUME_FAILURES."""
    mounts: Mapped[list | None] = mapped_column(sa.JSON, nullable=True)
    """Volumes and drives it mounts: [{kind, name, path, read_only}] (None: none)."""
    compat: Mapped[dict | None] = mapped_column(sa.JSON, nullable=True)
    """The options of the compatibility API it was created through (migration 0022): for the E2B
    port `{"created_via": "e2b", "auto_resume": bool, "on_timeout": "kill"|"pause"}`; None when
    made through atoll's own API. Not metadata (that is the user's)."""
    moving_to: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    """The worker asked to adopt it from the object store, written before the ask and cleared when
    `worker_id` names that worker (migration 0023): a server stopped in between leaves it set, and
    that worker's reconciliation finishes the move (controlplane.lifecycle `_adopted_here`)."""


class StoreRecord(Base):
    """A volume or drive: where it lives and, for a volume, the one sandbox that has it."""

    __tablename__ = "stores"

    tenant_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(sa.String(16), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    worker_id: Mapped[str] = mapped_column(sa.String(64))
    size_mb: Mapped[int] = mapped_column(sa.Integer)
    attached_to: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    """A volume's holder (a sandbox id); None when free. Set with one conditional UPDATE, so two
    creates can never both take it."""
    detaching: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    """The holder's DELETE has answered; its worker is still taking it down."""
    backend: Mapped[str] = mapped_column(sa.String(16), default="local", server_default="local")
    """"local" (an image on `worker_id`) or "filer" (a drive every worker with the filer mounts)."""
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class TemplateRecord(Base):
    """A user template: its current (ready) build, its latest, and its warm pool's settings."""

    __tablename__ = "templates"

    tenant_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    current_build: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    latest_build: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    pool: Mapped[dict | None] = mapped_column(sa.JSON, nullable=True)
    pool_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class PoolClaimsRecord(Base):
    """How many sandboxes a template's warm pool has handed to creates, since the template was
    made. A row of its own (not a column of TemplateRecord) so that a claim's increment is one
    atomic UPDATE that no merge of a template record read earlier can overwrite."""

    __tablename__ = "pool_claims"

    tenant_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    template: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    claimed: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")


class BuildRecord(Base):
    """One build of a user template, on one worker."""

    __tablename__ = "template_builds"

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(64))
    template: Mapped[str] = mapped_column(sa.String(64), index=True)
    worker_id: Mapped[str] = mapped_column(sa.String(64))
    status: Mapped[str] = mapped_column(sa.String(16))
    error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    progress: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    spec: Mapped[dict] = mapped_column(sa.JSON)
    parent_build: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    info: Mapped[dict | None] = mapped_column(sa.JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)


class SecretRecord(Base):
    """A secret: its value sealed (core.secretbox) with the installation's secrets key."""

    __tablename__ = "secrets"

    tenant_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    hosts: Mapped[list] = mapped_column(sa.JSON)
    sealed: Mapped[str] = mapped_column(sa.Text)
    allow_http: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class SnapshotRecord(Base):
    """A named snapshot (controlplane.snapshots): a sandbox's state kept on the worker that made it
    (and, with a shared object store, uploaded there: `stored`),
    from which sandboxes are created. `name` is unique per tenant (several unnamed ones may exist);
    `memory_mb` is the memory size a create from it must use (0: files only, any size); `source`
    holds what a create from it takes of its sandbox (template settings, user, shell, workdir, disk)."""

    __tablename__ = "snapshots"
    __table_args__ = (sa.UniqueConstraint("tenant_id", "name", name="uq_snapshots_tenant_name"),)

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    name: Mapped[str | None] = mapped_column(sa.String(128), nullable=True)
    sandbox_id: Mapped[str] = mapped_column(sa.String(32), index=True)
    template: Mapped[str] = mapped_column(sa.String(64))
    build_id: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    worker_id: Mapped[str] = mapped_column(sa.String(64))
    bytes: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    memory: Mapped[bool] = mapped_column(sa.Boolean)
    memory_mb: Mapped[int] = mapped_column(sa.Integer)
    source: Mapped[dict] = mapped_column(sa.JSON)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    stored: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    """A whole copy is in the workers' shared object store (migration 0026): any worker with that
    store creates from it, also when `worker_id` is gone."""


class WorkerRecord(Base):
    """A worker the control plane knows: registered at least once. Its token is stored only sealed
    with the installation's secrets key, and only where servers share the records (PostgreSQL), for
    the servers that do not hold the worker to call it (controlplane.workers, borrowed workers); a
    restarted server still waits for each worker to register again before it holds it."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), unique=True)
    installation: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    url: Mapped[str | None] = mapped_column(sa.String(512), nullable=True)
    state: Mapped[str] = mapped_column(sa.String(16))
    state_reason: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    draining: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    """An operator drained it: it gets no new sandboxes, also after it or the server restarts."""
    version: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    protocol: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    capacity: Mapped[dict] = mapped_column(sa.JSON, default=dict)
    registered_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    last_heartbeat_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    evacuation: Mapped[dict | None] = mapped_column(sa.JSON, nullable=True)
    """The last drain's evacuation (controlplane.evacuation `Evacuation.record`): what is still to
    move, what moved, what stays and why; a server that starts finds an unfinished one and resumes it."""
    token_sealed: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    """The token of its current registration, sealed (core.secretbox; associated data
    `worker-token/<id>`); null on SQLite, where no other server shares the records."""


class BadDatabaseURL(ValueError):
    """ATOLL_DATABASE_URL names no database atoll can use (the message says why and what works)."""


class DatabaseUnavailable(RuntimeError):
    """The database could not be opened or migrated at start-up (unreachable, refused the login,
    ...); the message names the URL (password hidden) and the database's reason."""


_FORMS = "sqlite:///PATH or postgresql://USER:PASSWORD@HOST:PORT/DATABASE"


UNAVAILABLE = (sa.exc.OperationalError, sa.exc.InterfaceError)
"""The errors that mean "the records database cannot be reached now" (or, on SQLite, stayed locked
past the busy timeout): 503 `database_unavailable` at the API (controlplane.app), a pass skipped by
the background loops, a write retried by controlplane.dbretry."""


def copy_record(src: SandboxRecord, dst: SandboxRecord) -> None:
    """Every column of `src` (a record as read again, version included) into `dst`, the copy
    callers hold (controlplane.ledger.persist, after another server's write)."""
    for attr in sa.inspect(SandboxRecord).column_attrs:
        setattr(dst, attr.key, getattr(src, attr.key))


def cause(exc: sa.exc.DBAPIError) -> str:
    """The first line of the driver's message for a database error (for a one-line log or answer)."""
    orig = getattr(exc, "orig", None)
    return str(orig).strip().splitlines()[0] if orig is not None and str(orig).strip() else type(exc).__name__


def engine_url(url: str) -> str:
    """The SQLAlchemy URL for ATOLL_DATABASE_URL `url`: `postgresql://` (and `postgres://`) use
    psycopg 3, the driver the server extra installs (`postgresql+psycopg://`); `sqlite:///PATH`
    stays. BadDatabaseURL says what is wrong with any other (it names the URL, password hidden)."""
    try:
        u = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        raise BadDatabaseURL(f"{redact(url)!r} is not a database URL; give {_FORMS}") from None
    backend, _, driver = u.drivername.partition("+")
    shown = redact(url)
    if backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise BadDatabaseURL(f"{shown!r}: SQLite is used through Python's sqlite3; give sqlite:///PATH")
        if not u.database or u.database == ":memory:":
            raise BadDatabaseURL(
                f"{shown!r} names no file (an in-memory SQLite database is lost at exit and not shared "
                "between connections); give sqlite:///PATH"
            )
        return url
    if backend in ("postgresql", "postgres"):
        if driver not in ("", "psycopg"):
            raise BadDatabaseURL(
                f"{shown!r}: the PostgreSQL driver {driver!r} is not supported; give postgresql://… "
                "(atoll uses psycopg 3)"
            )
        if not u.database:
            raise BadDatabaseURL(f"{shown!r} names no database; give {_FORMS}")
        if importlib.util.find_spec("psycopg") is None:
            raise BadDatabaseURL(
                f"{shown!r} needs the PostgreSQL driver psycopg 3, which is not installed: "
                "pip install 'atoll[server]' (or psycopg[binary])"
            )
        return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    raise BadDatabaseURL(f"{shown!r}: atoll keeps its records in SQLite or PostgreSQL; give {_FORMS}")


def redact(url: str) -> str:
    """`url` with its password hidden (***), for logs and messages."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except (sa.exc.ArgumentError, ValueError):
        return "<not a URL>" if "@" in url else url


class Database:
    """The records: an engine, its sessions and the queries the control plane runs on them. The
    same code serves SQLite (one file, WAL, BEGIN IMMEDIATE where it must serialize) and
    PostgreSQL (row locks), on the same Alembic migrations."""

    def __init__(self, url: str):
        url = engine_url(url)
        if url.startswith("sqlite"):
            self.engine = sa.create_engine(url)
            event.listen(self.engine, "connect", _sqlite_pragmas)
        else:
            self.engine = sa.create_engine(
                url,
                # a server restarted or a connection cut by a proxy: found out before use, not by
                # the request that draws the dead connection from the pool
                pool_pre_ping=True,
                # datetimes come back in UTC, as SQLite's (naive, UTC) are read
                connect_args={"options": "-c TimeZone=UTC"},
            )
        self.dialect = self.engine.dialect.name
        """"sqlite" or "postgresql"."""
        self.trouble_at = -1e18
        """When (monotonic) a statement last failed for want of the database (it could not be
        reached, or the connection broke): the worker watch does not take missed heartbeats for
        lost workers right after (controlplane.workers)."""
        event.listen(self.engine, "handle_error", self._trouble)
        self.session = sessionmaker(self.engine, expire_on_commit=False)
        self._clock_offset = 0.0
        self._clock_read_at = -1e18

    def now(self) -> dt.datetime:
        """The database's clock (UTC): on PostgreSQL, this machine's clock plus how far it is off
        the database's, read again every CLOCK_CHECK_S (`check_clock`), so that times several
        servers write and compare (worker heartbeats: controlplane.workers, lost_workers) are on
        one clock however far theirs are apart; on SQLite (one machine) this machine's clock."""
        if self.dialect == "sqlite":
            return utcnow()
        if time.monotonic() - self._clock_read_at >= CLOCK_CHECK_S:
            self.check_clock()
        return utcnow() + dt.timedelta(seconds=self._clock_offset)

    def check_clock(self) -> float:
        """Read the database's clock: how many seconds it is ahead of this machine's (the midpoint
        of the round trip). A database that cannot be reached keeps the last offset (tried again
        CLOCK_CHECK_S later)."""
        self._clock_read_at = time.monotonic()
        try:
            before = utcnow()
            with self.engine.connect() as conn:
                theirs = conn.execute(sa.select(sa.func.clock_timestamp())).scalar_one()
            after = utcnow()
        except sa.exc.DBAPIError:
            return self._clock_offset
        if theirs.tzinfo is None:
            theirs = theirs.replace(tzinfo=dt.UTC)
        self._clock_offset = (theirs - (before + (after - before) / 2)).total_seconds()
        return self._clock_offset

    def _trouble(self, ctx) -> None:
        if ctx.is_disconnect or isinstance(ctx.sqlalchemy_exception, UNAVAILABLE):
            self.trouble_at = time.monotonic()

    def get(self, sid: str) -> SandboxRecord | None:
        with self.session() as s:
            return s.get(SandboxRecord, sid)

    def add(self, rec: SandboxRecord) -> None:
        with self.session.begin() as s:
            s.add(rec)

    _COLUMNS: dict[str, str] | None = None
    _UPDATES: typing.ClassVar[dict[tuple[str, ...], sa.Update]] = {}

    def save(
        self, rec: SandboxRecord, fields: typing.Iterable[str] | None = None, *, durable: bool = False
    ) -> None:
        """Write `rec` with one UPDATE (no SELECT first, unlike Session.merge): all columns, or only
        the attributes named in `fields` (plus updated_at).

        SQLite runs with synchronous=NORMAL (a commit survives a crash of atoll, not a power loss);
        `durable=True` makes this one commit synchronous=FULL, for writes that must survive a power
        loss once acknowledged (a delete: the next start must not resurrect the sandbox).

        The UPDATE for each set of fields is built once and cached with bind parameters: building
        it per call cost ~0.2 ms, more than the write itself (resume and pause call this)."""
        if Database._COLUMNS is None:
            Database._COLUMNS = {
                attr.key: attr.columns[0].name
                for attr in sa.inspect(SandboxRecord).column_attrs
                if attr.key not in ("id", "version")
            }
        cols = Database._COLUMNS
        keys = tuple(cols) if fields is None else (*(f for f in fields if f != "version"), "updated_at")
        stmt = Database._UPDATES.get(keys)
        if stmt is None:
            table = SandboxRecord.__table__
            stmt = (
                sa.update(table)
                .where((table.c.id == sa.bindparam("b_id")) & (table.c.version == sa.bindparam("b_version")))
                .values(
                    {
                        **{cols[k]: sa.bindparam("v_" + k, type_=table.c[cols[k]].type) for k in keys},
                        "version": sa.bindparam("v_version", type_=sa.Integer),
                    }
                )
            )
            Database._UPDATES[keys] = stmt
        read = rec.version or 0
        rec.updated_at = utcnow()
        params = {
            "b_id": rec.id,
            "b_version": read,
            "v_version": read + 1,
            **{"v_" + k: getattr(rec, k) for k in keys},
        }
        full = durable and self.engine.dialect.name == "sqlite"
        with self.engine.connect() as conn:
            # on the driver's connection: a PRAGMA through SQLAlchemy would autobegin a transaction
            raw = conn.connection.dbapi_connection if full else None
            if raw is not None:
                raw.execute("PRAGMA synchronous=FULL")
            try:
                with conn.begin():
                    written = conn.execute(stmt, params).rowcount
            finally:
                if raw is not None:
                    raw.execute("PRAGMA synchronous=NORMAL")
        if written != 1:
            raise errors.SandboxChanged(
                f"sandbox {rec.id} was changed by another server since this one read it "
                f"(version {read}); nothing was written — retry the call (it reads the sandbox again)"
            )
        rec.version = read + 1

    def version(self, sid: str) -> int | None:
        """The record's version in the database (None: no such record): one indexed read, to see
        whether a copy is stale."""
        t = SandboxRecord.__table__
        with self.engine.connect() as conn:
            return conn.execute(sa.select(t.c.version).where(t.c.id == sid)).scalar_one_or_none()

    def live_marks(self) -> dict[str, tuple[int, dt.datetime | None]]:
        """id -> (version, last_activity_at) of every record not deleted (ledger.refresh: what
        changed, and which sandboxes were used, through other servers)."""
        t = SandboxRecord.__table__
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.id, t.c.version, t.c.last_activity_at).where(t.c.state != "deleted")
            ).all()
        return {sid: (version, at) for sid, version, at in rows}

    def note_activity(self, times: dict[str, dt.datetime]) -> None:
        """Move each sandbox's `last_activity_at` forward to the given time (never back), in one
        transaction. Not a write of the record (no version bump, no conflict with a step of another
        server): the activity clock the servers share (ledger.share_activity)."""
        if not times:
            return
        t = SandboxRecord.__table__
        stmt = (
            sa.update(t)
            .where(
                t.c.id == sa.bindparam("b_id"),
                sa.or_(t.c.last_activity_at.is_(None), t.c.last_activity_at < sa.bindparam("b_at")),
            )
            .values(last_activity_at=sa.bindparam("b_at"))
        )
        with self.engine.begin() as conn:
            conn.execute(stmt, [{"b_id": sid, "b_at": at} for sid, at in times.items()])

    def get_many(self, ids: builtins.list[str]) -> builtins.list[SandboxRecord]:
        """The records of `ids` (those that exist), 500 to a query."""
        out: builtins.list[SandboxRecord] = []
        for i in range(0, len(ids), 500):
            with self.session() as s:
                out.extend(s.scalars(sa.select(SandboxRecord).where(SandboxRecord.id.in_(ids[i : i + 500]))))
        return out

    def list(
        self, tenant_id: str | None = None, state: str | None = None, include_deleted: bool = False
    ) -> list[SandboxRecord]:
        q = sa.select(SandboxRecord).order_by(SandboxRecord.created_at)
        if tenant_id is not None:
            q = q.where(SandboxRecord.tenant_id == tenant_id)
        if state is not None:
            q = q.where(SandboxRecord.state == state)
        elif not include_deleted:
            q = q.where(SandboxRecord.state != "deleted")
        with self.session() as s:
            return list(s.scalars(q))

    def workers(self) -> builtins.list[WorkerRecord]:
        with self.session() as s:
            return list(s.scalars(sa.select(WorkerRecord).order_by(WorkerRecord.name)))

    def put_worker(
        self, rec: WorkerRecord, *, under_lock: typing.Callable[[WorkerRecord | None], None] | None = None
    ) -> None:
        """Write the whole row. `under_lock` is called first with the row as the database has it
        (None: no row yet), locked until the write commits (PostgreSQL's `FOR UPDATE`; SQLite has
        one writer): what it copies from there onto `rec` no other server can change meanwhile."""
        with self.session.begin() as s:
            if under_lock is not None:
                under_lock(s.get(WorkerRecord, rec.id, with_for_update=True, populate_existing=True))
            s.merge(rec)

    def worker_by_name(self, name: str) -> WorkerRecord | None:
        with self.session() as s:
            return s.scalars(sa.select(WorkerRecord).where(WorkerRecord.name == name)).first()

    def get_worker(self, worker_id: str) -> WorkerRecord | None:
        with self.session() as s:
            return s.get(WorkerRecord, worker_id)

    def set_worker_columns(self, worker_id: str, **values: typing.Any) -> None:
        """Write only these columns of a worker's row (a server that does not hold the worker:
        the rest is its holder's to write)."""
        t = WorkerRecord.__table__
        with self.engine.begin() as conn:
            conn.execute(sa.update(t).where(t.c.id == worker_id).values(**values))

    def worker_seen(self, worker_id: str, at: dt.datetime) -> None:
        """Record a heartbeat's time (only that column: other servers write the rest)."""
        t = WorkerRecord.__table__
        with self.engine.begin() as conn:
            conn.execute(sa.update(t).where(t.c.id == worker_id).values(last_heartbeat_at=at))

    def get_secret(self, tenant_id: str, name: str) -> SecretRecord | None:
        with self.session() as s:
            return s.get(SecretRecord, (tenant_id, name))

    def put_secret(self, rec: SecretRecord) -> None:
        with self.session.begin() as s:
            s.merge(rec)

    def delete_secret(self, tenant_id: str, name: str) -> None:
        with self.session.begin() as s:
            s.execute(
                sa.delete(SecretRecord).where(SecretRecord.tenant_id == tenant_id, SecretRecord.name == name)
            )

    def secrets(self, tenant_id: str | None) -> builtins.list[SecretRecord]:
        with self.session() as s:
            q = sa.select(SecretRecord).order_by(SecretRecord.tenant_id, SecretRecord.name)
            if tenant_id is not None:
                q = q.where(SecretRecord.tenant_id == tenant_id)
            return list(s.scalars(q))

    # ---- templates ------------------------------------------------------------------------------
    def get_template(self, tenant_id: str, name: str) -> TemplateRecord | None:
        with self.session() as s:
            return s.get(TemplateRecord, (tenant_id, name))

    def put_template(self, rec: TemplateRecord) -> None:
        rec.updated_at = utcnow()
        with self.session.begin() as s:
            s.merge(rec)

    def delete_template(self, tenant_id: str, name: str) -> None:
        with self.session.begin() as s:
            s.execute(
                sa.delete(TemplateRecord).where(
                    TemplateRecord.tenant_id == tenant_id, TemplateRecord.name == name
                )
            )
            s.execute(
                sa.delete(BuildRecord).where(BuildRecord.tenant_id == tenant_id, BuildRecord.template == name)
            )
            s.execute(
                sa.delete(PoolClaimsRecord).where(
                    PoolClaimsRecord.tenant_id == tenant_id, PoolClaimsRecord.template == name
                )
            )

    def count_pool_claim(self, tenant_id: str, name: str) -> None:
        """One more sandbox claimed from the template's pool (atomic across control planes)."""
        t = PoolClaimsRecord.__table__
        where = (t.c.tenant_id == tenant_id) & (t.c.template == name)
        for _ in range(3):
            with self.engine.begin() as conn:
                if conn.execute(sa.update(t).where(where).values(claimed=t.c.claimed + 1)).rowcount:
                    return
            try:  # the template's first claim
                with self.engine.begin() as conn:
                    conn.execute(sa.insert(t).values(tenant_id=tenant_id, template=name, claimed=1))
                return
            except sa.exc.IntegrityError:  # another control plane inserted it meanwhile: update it
                continue

    def pool_claimed(self, tenant_id: str, name: str) -> int:
        with self.session() as s:
            rec = s.get(PoolClaimsRecord, (tenant_id, name))
            return rec.claimed if rec is not None else 0

    def templates(self, tenant_id: str | None = None) -> builtins.list[TemplateRecord]:
        q = sa.select(TemplateRecord).order_by(TemplateRecord.name)
        if tenant_id is not None:
            q = q.where(TemplateRecord.tenant_id == tenant_id)
        with self.session() as s:
            return list(s.scalars(q))

    def get_build(self, build_id: str) -> BuildRecord | None:
        with self.session() as s:
            return s.get(BuildRecord, build_id)

    def put_build(self, rec: BuildRecord) -> None:
        with self.session.begin() as s:
            s.merge(rec)

    def builds(self, template: str | None = None, tenant_id: str | None = None) -> builtins.list[BuildRecord]:
        q = sa.select(BuildRecord).order_by(BuildRecord.created_at)
        if template is not None:
            q = q.where(BuildRecord.template == template)
        if tenant_id is not None:
            q = q.where(BuildRecord.tenant_id == tenant_id)
        with self.session() as s:
            return list(s.scalars(q))

    def count_by_state(self) -> dict[str, int]:
        with self.session() as s:
            rows = s.execute(sa.select(SandboxRecord.state, sa.func.count()).group_by(SandboxRecord.state))
            return {st: n for st, n in rows}


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()


def open_database(url: str) -> Database:
    """Open the database and bring its schema to the newest Alembic revision."""
    from alembic import command

    url = engine_url(url)
    cfg = alembic_config(url)
    try:
        command.upgrade(cfg, "head")
    except sa.exc.OperationalError as e:
        raise DatabaseUnavailable(
            f"the records database {redact(url)} cannot be opened: {str(e.orig).strip() or e}"
        ) from e
    return Database(url)


def alembic_config(url: str):
    """Alembic's configuration for the records at `url` (open_database; tests compare the
    migrated schema with the models through it)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", os.path.join(os.path.dirname(__file__), "migrations"))
    # Alembic's ini interpolation would read a `%` in a password as a reference
    cfg.set_main_option("sqlalchemy.url", engine_url(url).replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg
