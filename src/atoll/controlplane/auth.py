"""Who is calling: tenants, API keys and the principal of each request.

A key is `atk_<id>_<secret>`: `id` (`ak-` + 16 base32) names its row, `secret` is 32 random bytes.
Only HMAC-SHA256(hash key, secret) is stored (the hash key is derived from the installation's
secrets key, so a copy of the database alone checks nothing); a check is one primary-key read and
a constant-time compare — no KDF per request, and no cache, so a revocation or an expiry takes
effect at the next request on every server sharing the database. Scopes: `admin` (every tenant),
`tenant` (one tenant's resources), `worker` (the worker protocol only). `ATOLL_API_KEY` (or
`$ATOLL_HOME/admin.key`) stays an admin key.

The middleware (controlplane.app) resolves each request's `Principal` and sets it in a context
variable for the request's task; code that reads or lists tenant resources asks `visible` /
`list_tenant` / `acting_tenant`. Outside a request (the server's own loops: policy, pools,
reconciliation) there is no principal and everything is visible. Called by controlplane.app,
routes_tenants, lifecycle, stores, templates, routes_secrets and pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import datetime as dt
import hashlib
import hmac
import re
import secrets
import typing

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from atoll.controlplane import db as dbm
from atoll.core import errors, ids

SCOPES = ("admin", "tenant", "worker")
KEY_RE = re.compile(rb"atk_(ak-[0-9a-hjkmnp-tv-z]{16})_([A-Za-z0-9_-]{43})")
TENANT_ID_RE = re.compile(r"tn-[0-9a-hjkmnp-tv-z]{16}|default")
TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
QUOTA_KEYS = {
    "max_running": (0, 100_000),
    "max_memory_mb": (0, 1 << 30),
    "max_standby_gb": (0, 1 << 20),
    "max_volume_gb": (0, 1 << 20),
    "creates_per_minute": (0, 1_000_000),
    "max_pool_slots": (0, 100_000),
    "build_minutes_per_day": (0, 1 << 20),
    "max_snapshots": (0, 100_000),
    "max_snapshot_gb": (0, 1 << 20),
}
"""Quota key -> (lowest, highest) accepted value; a key left out (or null) is unlimited."""
WHOLE_QUOTAS = frozenset(
    {"max_running", "max_memory_mb", "creates_per_minute", "max_pool_slots", "max_snapshots"}
)
"""Quotas that count (sandboxes, MB, creates, slots, snapshots): whole numbers (schemas.Quotas's ints)."""


class TenantRecord(dbm.Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), unique=True)
    quotas: Mapped[dict] = mapped_column(sa.JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=dbm.utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=dbm.utcnow)


class KeyRecord(dbm.Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    scope: Mapped[str] = mapped_column(sa.String(16))
    tenant_id: Mapped[str | None] = mapped_column(sa.String(64), nullable=True, index=True)
    digest: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=dbm.utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)


@dataclasses.dataclass(frozen=True)
class Principal:
    key_id: str
    """The key's id ("admin" for ATOLL_API_KEY)."""
    scope: str
    tenant_id: str | None
    """A tenant key's tenant; for an admin key the tenant its request names (`?tenant_id=`), else
    None; None for worker keys."""

    @property
    def admin(self) -> bool:
        return self.scope == "admin"


ADMIN = Principal("admin", "admin", None)
E2B_ACCESS = "e2b-access"
"""The key id of a caller that showed a sandbox's envd access token (core.grants) instead of a key."""


def e2b_access(tenant_id: str | None) -> Principal:
    """The principal of an envd access token: the sandbox's tenant, for its grant route only
    (controlplane.app makes it on that one path; the token names the sandbox)."""
    return Principal(E2B_ACCESS, "tenant", tenant_id)


DRIVE_TOKEN = "drive-token"
"""The key id of a caller that showed a drive token (core.grants) instead of a key."""


def drive_token(tenant_id: str) -> Principal:
    """The principal of a drive token: the drive's tenant, for that drive's file routes only
    (controlplane.app makes it only there, after checking the token against the drive)."""
    return Principal(DRIVE_TOKEN, "tenant", tenant_id)


def is_e2b_access(p: Principal | None) -> bool:
    return p is not None and p.key_id == E2B_ACCESS


_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("atoll_principal", default=None)


def current() -> Principal | None:
    return _current.get()


def set_current(p: Principal | None) -> contextvars.Token:
    return _current.set(p)


def reset_current(token: contextvars.Token) -> None:
    _current.reset(token)


def detached() -> contextvars.Context:
    """A copy of the current context without the caller: for work a request starts in the
    background that acts for the installation, not as the request's key (a worker's adoption,
    started by its registration or heartbeat under a `worker` key, which sees no tenant's
    sandbox). Run it with `loop.create_task(coro, context=auth.detached())`."""
    ctx = contextvars.copy_context()
    ctx.run(_current.set, None)
    ctx.run(_target.set, None)
    return ctx


_target: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "atoll_target_tenant", default=None
)


def watch_target(holder: list[str]) -> contextvars.Token:
    """Collect, for this request, the tenant of the first tenant resource it touches (`holder`
    gets it): controlplane.audit records it for an admin's request that names no tenant."""
    return _target.set(holder)


def unwatch_target(token: contextvars.Token) -> None:
    _target.reset(token)


def _touched(tenant_id: str | None) -> None:
    holder = _target.get()
    if holder is not None and not holder and tenant_id:
        holder.append(tenant_id)


# ---- what the caller may see ----------------------------------------------------------------------


def for_tenant(p: Principal, tenant_id: str | None) -> Principal:
    """An admin's principal acting in `tenant_id` (its `?tenant_id=`); others unchanged."""
    if not p.admin or not tenant_id:
        return p
    return dataclasses.replace(p, tenant_id=tenant_id)


def visible(tenant_id: str | None) -> bool:
    """Whether the current caller may see a resource of `tenant_id` (another tenant's is 404)."""
    p = _current.get()
    ok = p is None or p.admin or p.tenant_id == tenant_id
    if ok:
        _touched(tenant_id)
    return ok


def list_tenant(explicit: str | None = None) -> str | None:
    """The tenant a list is filtered to: a tenant key's own; for an admin `?tenant_id=` (None:
    every tenant)."""
    p = _current.get()
    if p is None:
        return explicit or None
    if p.admin:
        return explicit or p.tenant_id
    return p.tenant_id


def acting_tenant(explicit: str | None = None) -> str:
    """The tenant a new resource belongs to: a tenant key's own (naming another is refused); for
    an admin the body's `tenant_id`, else `default`."""
    p = _current.get()
    if p is not None and not p.admin:
        if explicit and explicit != p.tenant_id:
            raise Forbidden("tenant_id is set by the key: a tenant key acts only for its own tenant")
        assert p.tenant_id is not None
        return p.tenant_id
    tenant = explicit or (p.tenant_id if p is not None else None) or ids.DEFAULT_TENANT
    _touched(tenant)
    return tenant


class Forbidden(errors.AtollError):
    status = 403
    code = "forbidden"


# ---- keys -----------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(ids._ALPHABET) for _ in range(16))


def hash_key(secrets_key: bytes) -> bytes:
    return hmac.new(secrets_key, b"atoll api key digest v1", hashlib.sha256).digest()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _aware(t: dt.datetime | None) -> dt.datetime | None:
    if t is not None and t.tzinfo is None:  # SQLite hands datetimes back naive; they are UTC
        return t.replace(tzinfo=dt.UTC)
    return t


class Keys:
    """API keys and tenants in the database."""

    def __init__(self, database: dbm.Database, secrets_key: bytes, admin_key: str):
        self.db = database
        self._inflight: dict[str, set[asyncio.Task]] = {}
        self._cut_tasks: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None
        self._hk = hash_key(secrets_key)
        # The admin key is compared by its digest: both sides of every compare are 64 hex digits,
        # so the compare tells nothing about the admin key's length (compare_digest does on
        # inputs of different lengths), and a malformed token costs an HMAC like any other.
        self._admin = self._digest(admin_key.encode()) if admin_key else None
        self._select = sa.select(
            KeyRecord.scope, KeyRecord.tenant_id, KeyRecord.digest, KeyRecord.expires_at, KeyRecord.revoked_at
        ).where(KeyRecord.id == sa.bindparam("kid"))

    def _digest(self, secret: bytes) -> str:
        return hmac.new(self._hk, secret, hashlib.sha256).hexdigest()

    def check(self, token: bytes) -> Principal | None:
        """The principal of a bearer token, or None (unknown, wrong, revoked or expired)."""
        token = token.strip()
        m = KEY_RE.fullmatch(token)
        if m is None:
            want = self._digest(token)
            if self._admin is None:
                hmac.compare_digest(want, want)  # as long as a miss
                return None
            return ADMIN if hmac.compare_digest(want, self._admin) else None
        kid, secret = m.group(1).decode(), m.group(2)
        with self.db.engine.connect() as conn:
            row = conn.execute(self._select, {"kid": kid}).first()
        want = self._digest(secret)
        if row is None:
            hmac.compare_digest(want, want)  # as long as a miss
            return None
        scope, tenant_id, digest, expires_at, revoked_at = row
        if not hmac.compare_digest(want, digest) or revoked_at is not None:
            return None
        exp = _aware(expires_at)
        if exp is not None and exp <= _now():
            return None
        return Principal(kid, scope, tenant_id)

    def create(
        self, scope: str, tenant_id: str | None, expires_at: dt.datetime | None
    ) -> tuple[KeyRecord, str]:
        if scope not in SCOPES:
            raise errors.InvalidRequest(f"scope {scope!r} is not one of {', '.join(SCOPES)}")
        if expires_at is not None:
            expires_at = _aware(expires_at)
            assert expires_at is not None
            if expires_at <= _now():
                raise errors.InvalidRequest(
                    f"expires_at {expires_at.isoformat()} is in the past; give a time in the future (ISO 8601, UTC)"
                )
        kid = _new_id("ak-")
        secret = secrets.token_urlsafe(32)
        rec = KeyRecord(
            id=kid,
            scope=scope,
            tenant_id=tenant_id,
            digest=self._digest(secret.encode()),
            created_at=_now(),
            expires_at=expires_at,
        )
        with self.db.session.begin() as s:
            s.add(rec)
        return rec, f"atk_{kid}_{secret}"

    def revoke(self, kid: str) -> KeyRecord:
        with self.db.session.begin() as s:
            rec = s.get(KeyRecord, kid)
            if rec is None:
                raise errors.AtollError(f"no API key {kid!r}", code="key_not_found")
            _touched(rec.tenant_id)
            if rec.revoked_at is None:
                rec.revoked_at = _now()
        self._cut(kid)
        return rec

    # ---- requests in flight -------------------------------------------------------------------
    # A long request (a streaming exec, a terminal's WebSocket, a file transfer) outlives the check
    # made at its start: it is tracked by its key, cut at once when this server revokes the key,
    # and within STREAM_CHECK_S when another server does or the key expires.
    STREAM_CHECK_S = 2.0

    def _cut(self, kid: str) -> None:
        for task in list(self._inflight.get(kid, ())):
            self._cut_tasks.add(task)
            task.cancel()

    def was_cut(self, task: asyncio.Task) -> bool:
        """Whether `task` was cancelled because its key stopped being valid (then consumed)."""
        if task in self._cut_tasks:
            self._cut_tasks.discard(task)
            return True
        return False

    @contextlib.contextmanager
    def tracking(self, p: Principal) -> typing.Iterator[None]:
        if p.key_id in (ADMIN.key_id, E2B_ACCESS, DRIVE_TOKEN):  # ATOLL_API_KEY, tokens: not revocable
            yield
            return
        task = asyncio.current_task()
        assert task is not None
        self._inflight.setdefault(p.key_id, set()).add(task)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())
        try:
            yield
        finally:
            held = self._inflight.get(p.key_id)
            if held is not None:
                held.discard(task)
                if not held:
                    del self._inflight[p.key_id]

    def valid(self, kid: str) -> bool:
        with self.db.engine.connect() as conn:
            row = conn.execute(
                sa.select(KeyRecord.expires_at, KeyRecord.revoked_at).where(KeyRecord.id == kid)
            ).first()
        if row is None or row[1] is not None:
            return False
        exp = _aware(row[0])
        return exp is None or exp > _now()

    async def _watch(self) -> None:
        while self._inflight:
            await asyncio.sleep(self.STREAM_CHECK_S)
            for kid in list(self._inflight):
                try:
                    ok = self.valid(kid)
                except sa.exc.SQLAlchemyError:
                    continue  # the database is away: checked again next time
                if not ok:
                    self._cut(kid)

    def keys(self, tenant_id: str | None = None) -> list[KeyRecord]:
        with self.db.session() as s:
            q = sa.select(KeyRecord).order_by(KeyRecord.created_at, KeyRecord.id)
            if tenant_id is not None:
                q = q.where(KeyRecord.tenant_id == tenant_id)
            return list(s.scalars(q))

    # ---- tenants ------------------------------------------------------------------------------
    def tenant(self, tid: str) -> TenantRecord:
        with self.db.session() as s:
            rec = s.get(TenantRecord, tid) if TENANT_ID_RE.fullmatch(tid or "") else None
        if rec is None or not visible(rec.id):
            raise errors.AtollError(f"no tenant {tid!r}", code="tenant_not_found")
        return rec

    def tenants(self) -> list[TenantRecord]:
        with self.db.session() as s:
            return list(s.scalars(sa.select(TenantRecord).order_by(TenantRecord.created_at, TenantRecord.id)))

    def create_tenant(self, name: object, quotas: object) -> TenantRecord:
        name = check_tenant_name(name)
        q = check_quotas(quotas)
        now = _now()
        rec = TenantRecord(id=_new_id("tn-"), name=name, quotas=q, created_at=now, updated_at=now)
        try:
            with self.db.session.begin() as s:
                if s.scalar(sa.select(TenantRecord.id).where(TenantRecord.name == name)) is not None:
                    raise errors.Conflict(f"a tenant named {name!r} exists", code="tenant_exists")
                s.add(rec)
        except sa.exc.IntegrityError:
            raise errors.Conflict(f"a tenant named {name!r} exists", code="tenant_exists") from None
        return rec

    def update_tenant(self, tid: str, name: object = None, quotas: object = None) -> TenantRecord:
        self.tenant(tid)
        with self.db.session.begin() as s:
            rec = s.get(TenantRecord, tid)
            assert rec is not None
            if name is not None:
                name = check_tenant_name(name)
                other = s.scalar(sa.select(TenantRecord.id).where(TenantRecord.name == name))
                if other is not None and other != tid:
                    raise errors.Conflict(f"a tenant named {name!r} exists", code="tenant_exists")
                rec.name = name
            if quotas is not None:
                rec.quotas = {**(rec.quotas or {}), **check_quotas(quotas, partial=True)}
                rec.quotas = {k: v for k, v in rec.quotas.items() if v is not None}
            rec.updated_at = _now()
        return rec

    def quotas(self, tid: str) -> dict:
        with self.db.session() as s:
            rec = s.get(TenantRecord, tid)
        return dict(rec.quotas or {}) if rec is not None else {}

    def ensure_default(self) -> None:
        with self.db.session.begin() as s:
            if s.get(TenantRecord, ids.DEFAULT_TENANT) is None:
                now = _now()
                s.add(
                    TenantRecord(
                        id=ids.DEFAULT_TENANT, name="default", quotas={}, created_at=now, updated_at=now
                    )
                )


def check_tenant_name(name: object) -> str:
    if not isinstance(name, str) or not TENANT_NAME_RE.fullmatch(name):
        raise errors.InvalidRequest(
            f"tenant name {name!r} is not valid: use 1-63 lower-case letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_quotas(quotas: object, partial: bool = False) -> dict:
    if quotas is None:
        return {}
    if not isinstance(quotas, dict):
        raise errors.InvalidRequest(f"quotas must be an object of {sorted(QUOTA_KEYS)}; got {quotas!r}")
    out: dict = {}
    for k, v in quotas.items():
        if k not in QUOTA_KEYS:
            raise errors.InvalidRequest(f"unknown quota {k!r}; known: {', '.join(sorted(QUOTA_KEYS))}")
        if v is None:
            if partial:
                out[k] = None  # PATCH: null removes the quota (unlimited)
            continue
        lo, hi = QUOTA_KEYS[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi or v != v:
            raise errors.InvalidRequest(f"quota {k}={v!r} is out of range: give a number from {lo} to {hi}")
        if k in WHOLE_QUOTAS and not float(v).is_integer():
            raise errors.InvalidRequest(f"quota {k}={v!r} is a count: give a whole number from {lo} to {hi}")
        out[k] = int(v) if float(v).is_integer() else float(v)
    return out
