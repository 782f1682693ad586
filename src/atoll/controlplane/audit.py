"""The audit trail: one row per mutation of the public API (who, what, on what, with what result).

Every POST, PUT, PATCH and DELETE that reaches the control plane is recorded — refused ones too
(401 with no key id, 403 with the key that was refused) — as an `AuditRecord`: when, the key id
and its tenant (or the tenant the request acted in: `?tenant_id=`, the path's tenant, what a create
made, else the tenant of the first tenant resource it touched — a sandbox, template, secret,
volume, drive, a tenant's key — as controlplane.auth saw it looked up), a readable action named after the matched
route (`sandbox.create`, `secret.put`, `key.create`; an unnamed route is `"POST /v1/…"`), the
target (the ids and names in the path, plus the id or name of what a create made), the status and
error code, the request id and the client's address. Never a body, a query string, a header, a
secret value or a key: the only things read from an answer are its `id`/`name`/`tenant_id` and an
error's `code`, and only from small JSON answers (creates and failures).

Writes are cheap on the request path: `AuditMiddleware` (an ASGI layer outside
app.request_context) appends a tuple to memory; `AuditLog` inserts them in batches on a background
task (every FLUSH_S, or at once past BATCH rows, and at shutdown: `aclose`) and deletes rows older
than the retention (ATOLL_AUDIT_RETENTION_DAYS) every PRUNE_S. Worker heartbeats that succeed are
not recorded (one every few seconds per worker would drown the trail).

Listing (`page`) is in (at, id) order with an opaque cursor signed with HMAC-SHA256 under a key
derived from the installation's secrets key: a tampered cursor is refused. Built by
controlplane.app (create_app); read by routes_audit; stopped by controlplane.main and
atoll.testing.FakeAtoll.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime as dt
import hashlib
import hmac
import json
import logging
import re

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column
from starlette.routing import compile_path

from atoll.controlplane import auth
from atoll.controlplane import db as dbm
from atoll.core import errors

log = logging.getLogger(__name__)

MUTATIONS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FLUSH_S = 1.0
"""Seconds between batch inserts."""
BATCH = 500
"""Rows pending that trigger an insert at once."""
MAX_PENDING = 100_000
"""Rows kept in memory while the database refuses them; past this the oldest are dropped (logged)."""
PRUNE_S = 3600.0
"""Seconds between deletions of rows past the retention."""
PRUNE_CHUNK = 5000
"""Rows deleted per transaction by a prune."""
SNIFF_BYTES = 8192
"""Largest JSON answer read for a created id or an error code; larger answers are not read."""
DEFAULT_RETENTION_DAYS = 90
MAX_LIMIT = 1000
NO_ANSWER = 499
"""The status recorded for a request that ended before an answer started (the client hung up and
the call was cancelled), with the error `no_answer`."""
FIELD = 200
"""Longest id, name or path kept in a row (longer ones are cut)."""

ACTIONS: dict[tuple[str, str], str] = {
    ("POST", "/v1/sandboxes"): "sandbox.create",
    ("POST", "/v1/sandboxes/{sid}/fork"): "sandbox.fork",
    ("POST", "/v1/sandboxes/{sid}/snapshots"): "snapshot.create",
    ("DELETE", "/v1/snapshots/{snid:path}"): "snapshot.delete",
    ("DELETE", "/v1/sandboxes/{sid}"): "sandbox.delete",
    ("PATCH", "/v1/sandboxes/{sid}"): "sandbox.update",
    ("POST", "/v1/sandboxes/{sid}/pause"): "sandbox.pause",
    ("POST", "/v1/sandboxes/{sid}/resume"): "sandbox.resume",
    ("PUT", "/v1/sandboxes/{sid}/network"): "sandbox.network.set",
    ("PUT", "/v1/sandboxes/{sid}/preview/{port}"): "sandbox.preview.set",
    ("POST", "/v1/sandboxes/{sid}/exec"): "sandbox.exec",
    ("POST", "/v1/sandboxes/{sid}/grant"): "sandbox.grant",
    ("DELETE", "/v1/sandboxes/{sid}/processes/{pid}"): "process.kill",
    ("POST", "/v1/sandboxes/{sid}/processes/{pid}/stdin"): "process.stdin",
    ("POST", "/v1/sandboxes/{sid}/processes/{pid}/signal"): "process.signal",
    ("POST", "/v1/sandboxes/{sid}/processes/{pid}/wait"): "process.wait",
    ("PUT", "/v1/sandboxes/{sid}/files"): "file.write",
    ("DELETE", "/v1/sandboxes/{sid}/files"): "file.delete",
    ("POST", "/v1/sandboxes/{sid}/files/mkdir"): "file.mkdir",
    ("POST", "/v1/sandboxes/{sid}/files/move"): "file.move",
    ("POST", "/v1/sandboxes/{sid}/files/chmod"): "file.chmod",
    ("PUT", "/v1/sandboxes/{sid}/files/tar"): "file.upload_tar",
    ("POST", "/v1/sandboxes/{sid}/pty"): "terminal.create",
    ("DELETE", "/v1/sandboxes/{sid}/pty/{pty_id}"): "terminal.delete",
    ("DELETE", "/v1/workers/{wid}"): "worker.remove",
    ("POST", "/v1/workers/{wid}/drain"): "worker.drain",
    ("POST", "/v1/workers/{wid}/reconcile"): "worker.reconcile",
    ("POST", "/v1/workers/register"): "worker.register",
    ("POST", "/v1/workers/certificate"): "worker.certificate",
    ("POST", "/v1/workers/{wid}/heartbeat"): "worker.heartbeat",
    ("POST", "/v1/workers/{wid}/stopping"): "worker.stopping",
    ("POST", "/v1/secrets"): "secret.create",
    ("PUT", "/v1/secrets/{name}"): "secret.put",
    ("DELETE", "/v1/secrets/{name}"): "secret.delete",
    ("POST", "/v1/templates"): "template.build",
    ("DELETE", "/v1/templates/{name}"): "template.delete",
    ("PUT", "/v1/templates/{name}/pool"): "template.pool.set",
    ("POST", "/v1/volumes"): "volume.create",
    ("DELETE", "/v1/volumes/{name}"): "volume.delete",
    ("POST", "/v1/volumes/{name}/clone"): "volume.clone",
    ("PUT", "/v1/volumes/{name}/tar"): "volume.import",
    ("POST", "/v1/drives"): "drive.create",
    ("DELETE", "/v1/drives/{name}"): "drive.delete",
    ("POST", "/v1/drives/{name}/clone"): "drive.clone",
    ("PUT", "/v1/drives/{name}/tar"): "drive.import",
    ("PUT", "/v1/drives/{name}/files"): "drive.file.write",
    ("DELETE", "/v1/drives/{name}/files"): "drive.file.delete",
    ("POST", "/v1/drives/{name}/files/mkdir"): "drive.file.mkdir",
    ("PATCH", "/v1/drives/{name}/files"): "drive.file.set_attrs",
    ("POST", "/v1/drives/{name}/token"): "drive.token",
    ("POST", "/v1/tenants"): "tenant.create",
    ("PATCH", "/v1/tenants/{tid}"): "tenant.update",
    ("DELETE", "/v1/tenants/{tid}"): "tenant.delete",
    ("POST", "/v1/tenants/{tid}/keys"): "key.create",
    ("POST", "/v1/keys"): "key.create",
    ("DELETE", "/v1/keys/{kid}"): "key.revoke",
}
"""(method, route template) -> action. A route missing here is recorded as "METHOD /template"."""
_TEMPLATES: dict[str, list[tuple[re.Pattern, str]]] = {}
for (_method, _template), _ in sorted(ACTIONS.items(), key=lambda kv: kv[0][1].count("{")):
    _TEMPLATES.setdefault(_method, []).append((compile_path(_template)[0], _template))
QUIET = frozenset({"worker.heartbeat"})
"""Actions not recorded when they succeed (routine machine traffic); their failures are."""


def action_name(method: str, route_path: str) -> str:
    return ACTIONS.get((method, route_path)) or f"{method} {_cut(route_path)}"


class AuditRecord(dbm.Base):
    __tablename__ = "audit"
    __table_args__ = (
        sa.Index("ix_audit_at_id", "at", "id"),
        sa.Index("ix_audit_tenant_at", "tenant_id", "at"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True))
    key_id: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    """The key that made the request ("admin" for ATOLL_API_KEY); None when no valid key was sent."""
    tenant_id: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    """The key's tenant, or the tenant the request acted in (?tenant_id=, the path, what it made)."""
    action: Mapped[str] = mapped_column(sa.String(256))
    target: Mapped[str | None] = mapped_column(sa.String(512), nullable=True)
    status: Mapped[int] = mapped_column(sa.Integer)
    error: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    """The error code of a failure (`sandbox_not_found`, `forbidden`, …)."""
    request_id: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    source: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    """The client's address as the API server saw it."""


COLUMNS = ("at", "key_id", "tenant_id", "action", "target", "status", "error", "request_id", "source")


def view(rec: AuditRecord) -> dict:
    at = rec.at if rec.at.tzinfo is not None else rec.at.replace(tzinfo=dt.UTC)
    return {
        "at": at.isoformat(),
        "key_id": rec.key_id,
        "tenant_id": rec.tenant_id,
        "action": rec.action,
        "target": rec.target,
        "result": {"status": rec.status, "error": rec.error},
        "request_id": rec.request_id,
        "source": rec.source,
    }


# ---- cursors ------------------------------------------------------------------------------------


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class BadCursor(errors.InvalidRequest):
    pass


class Cursors:
    """Opaque page cursors: the last row's (at, id), signed so a changed one is refused."""

    def __init__(self, secrets_key: bytes):
        self._key = hmac.new(secrets_key, b"atoll audit cursor v1", hashlib.sha256).digest()

    def _sig(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()[:16]

    def make(self, at: dt.datetime, rid: int) -> str:
        payload = json.dumps([_utc(at).isoformat(), rid], separators=(",", ":")).encode()
        return _b64(payload) + "." + _b64(self._sig(payload))

    def read(self, cursor: str) -> tuple[dt.datetime, int]:
        bad = BadCursor(
            f"cursor {cursor[:60]!r} was not issued by this server (changed, cut or from another "
            "installation); pass the next_cursor of the previous page as it was, or start without cursor"
        )
        body, sep, sig = cursor.partition(".")
        try:
            payload, got = _unb64(body), _unb64(sig)
        except (binascii.Error, ValueError):
            raise bad from None
        if not sep or not hmac.compare_digest(got, self._sig(payload)):
            raise bad
        try:
            at, rid = json.loads(payload)
            return _utc(dt.datetime.fromisoformat(at)), int(rid)
        except (ValueError, TypeError):  # signed but not ours in shape: a key shared by mistake
            raise bad from None


def _utc(t: dt.datetime) -> dt.datetime:
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)


# ---- the log ------------------------------------------------------------------------------------

Row = tuple  # (at, key_id, tenant_id, action, target, status, error, request_id, source)


class _Unwritten(Exception):
    """The database did not answer: these rows are still to be written."""

    def __init__(self, rows: list[Row]):
        super().__init__(f"{len(rows)} audit row(s) not written")
        self.rows = rows


class AuditLog:
    """Pending rows in memory, inserted in batches by a background task started at the first row."""

    def __init__(self, database: dbm.Database, secrets_key: bytes, retention_days: int):
        if not 1 <= retention_days <= 36500:
            raise ValueError(f"audit retention {retention_days} days is out of range 1-36500")
        self.db = database
        self.retention = dt.timedelta(days=retention_days)
        self.cursors = Cursors(secrets_key)
        self._pending: list[Row] = []
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._closed = False
        self.dropped = 0
        self._insert = sa.insert(AuditRecord)

    # -- writing --
    def record(self, row: Row) -> None:
        """Queue one row (called on the request path: no I/O)."""
        self._pending.append(row)
        if self._task is None and not self._closed:
            self._start()
        if len(self._pending) >= BATCH and self._wake is not None:
            self._wake.set()

    def _start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the next flush or aclose writes it
            return
        self._wake = asyncio.Event()
        self._lock = self._lock or asyncio.Lock()
        self._task = loop.create_task(self._run(), name="audit-flush")

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        next_prune = loop.time()
        while not self._closed:
            try:
                await asyncio.wait_for(self._wake.wait(), FLUSH_S)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
                if loop.time() >= next_prune and not self._closed:
                    next_prune = loop.time() + PRUNE_S
                    await asyncio.to_thread(self.prune)
            except dbm.UNAVAILABLE as e:
                log.warning(
                    "audit: the records database is unavailable (%s); retrying in %.0f s",
                    dbm.cause(e),
                    FLUSH_S,
                )
            except Exception:  # noqa: BLE001 - the loop must outlive a database hiccup
                log.exception("audit: writing the trail failed; retrying in %.0f s", FLUSH_S)

    def _write(self, rows: list[Row]) -> None:
        """Insert rows in one transaction. When the database refuses the batch for what is in it
        (not for being unreachable), the rows go one by one and those it refuses are dropped,
        logged: one bad row must not hold back the trail. `_Unwritten` carries what is left when
        the database stops answering."""
        try:
            with self.db.engine.begin() as conn:
                conn.execute(self._insert, [dict(zip(COLUMNS, r, strict=True)) for r in rows])
            return
        except sa.exc.OperationalError as e:
            raise _Unwritten(rows) from e
        except sa.exc.DBAPIError:
            pass
        for i, r in enumerate(rows):
            try:
                with self.db.engine.begin() as conn:
                    conn.execute(self._insert, dict(zip(COLUMNS, r, strict=True)))
            except sa.exc.OperationalError as e:
                raise _Unwritten(rows[i:]) from e
            except sa.exc.DBAPIError as e:
                self.dropped += 1
                log.error(
                    "audit: a row the database refused was dropped (%s %s, request %s): %s",
                    r[3],
                    r[5],
                    r[7],
                    type(e.orig).__name__,
                )

    async def flush(self) -> None:
        """Insert what is pending (waits for an insert already under way, so a read after it sees
        every row recorded before the call)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            rows, self._pending = self._pending, []
            if not rows:
                return
            try:
                await asyncio.to_thread(self._write, rows)
            except _Unwritten as e:
                self._pending[:0] = e.rows  # kept for the next try, oldest first
                if len(self._pending) > MAX_PENDING:
                    cut = len(self._pending) - MAX_PENDING
                    del self._pending[:cut]
                    self.dropped += cut
                    log.error("audit: %d row(s) dropped: the database refused them too long", cut)
                raise

    def prune(self, now: dt.datetime | None = None) -> int:
        """Delete rows older than the retention, PRUNE_CHUNK at a time (a short transaction each:
        a retention just lowered must not hold SQLite's write lock past others' busy timeout);
        the number deleted."""
        cutoff = (now or dbm.utcnow()) - self.retention
        old = sa.select(AuditRecord.id).where(AuditRecord.at < cutoff).limit(PRUNE_CHUNK)
        n = 0
        while True:
            with self.db.engine.begin() as conn:
                gone = conn.execute(
                    sa.delete(AuditRecord).where(AuditRecord.id.in_(old.scalar_subquery()))
                ).rowcount
            n += gone
            if gone < PRUNE_CHUNK:
                break
        if n:
            log.info("audit: %d row(s) older than %s deleted", n, cutoff.isoformat())
        return n

    async def aclose(self) -> None:
        """Stop the background task after its insert under way and write what is pending (the
        server's shutdown)."""
        self._closed = True
        if self._task is not None:
            assert self._wake is not None
            self._wake.set()
            await self._task
            self._task = None
        try:
            await self.flush()
        except Exception:  # noqa: BLE001 - shutting down: say so and go on
            log.exception("audit: %d row(s) could not be written at shutdown", len(self._pending))

    # -- reading --
    def page(
        self,
        *,
        start: dt.datetime | None = None,
        end: dt.datetime | None = None,
        tenant_id: str | None = None,
        action: str | None = None,
        limit: int = MAX_LIMIT,
        cursor: str | None = None,
    ) -> tuple[list[AuditRecord], str | None]:
        """One page in (at, id) order, and the cursor of the next (None: the last page)."""
        t = AuditRecord
        q = sa.select(t).order_by(t.at, t.id).limit(limit + 1)
        if start is not None:
            q = q.where(t.at >= start)
        if end is not None:
            q = q.where(t.at < end)
        if tenant_id is not None:
            q = q.where(t.tenant_id == tenant_id)
        if action is not None:
            if action.endswith("*"):
                q = q.where(t.action.startswith(action[:-1], autoescape=True))
            else:
                q = q.where(t.action == action)
        if cursor is not None:
            at, rid = self.cursors.read(cursor)
            # (at, id) after the cursor's, written so the index's range starts at `at` (a plain
            # OR of the two cases made SQLite read ~5x longer)
            q = q.where(t.at >= at, sa.or_(t.at > at, t.id > rid))
        with self.db.session() as s:
            rows = list(s.scalars(q))
        more = len(rows) > limit
        rows = rows[:limit]
        return rows, (self.cursors.make(rows[-1].at, rows[-1].id) if more else None)


# ---- the request side ---------------------------------------------------------------------------


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_API_KEY = re.compile(r"(atk_ak-[0-9a-z]{16})_[A-Za-z0-9_-]*")
"""An API key (controlplane.auth) pasted where an id goes (`DELETE /v1/keys/atk_…`): its secret
part is redacted, its id kept."""


def _cut(value: object) -> str:
    """At most FIELD characters, an API key's secret part redacted, control characters (NUL:
    PostgreSQL refuses it) as '?'."""
    text = str(value)
    if "atk_" in text:
        text = _API_KEY.sub(r"\1_[redacted]", text)
    text = text[:FIELD]
    return text if text.isprintable() else _CONTROL.sub("?", text)


class AuditMiddleware:
    """Pure ASGI: for a mutation, watch the answer (status; a small JSON body's id/name/error code)
    and, once sent, queue its row. Reads pass through untouched. Sits outside
    app.request_context, so it sees the principal and request id that one put in scope["state"]
    and the route the router matched."""

    def __init__(self, app, audit: AuditLog, admin_key: str = ""):
        self.app = app
        self.audit = audit
        self._admin = admin_key if len(admin_key) >= 8 else ""
        """ATOLL_API_KEY, redacted wherever a path holds it (a short test key is not looked for)."""

    def _clean(self, value: object) -> str:
        text = str(value)
        if self._admin and self._admin in text:
            text = text.replace(self._admin, "[redacted]")
        return _cut(text)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in MUTATIONS:
            return await self.app(scope, receive, send)
        seen: dict = {"status": NO_ANSWER}
        chunks: list[bytes] = []
        target: list[str] = []
        token = auth.watch_target(target)

        async def watch(message):
            if message["type"] == "http.response.start":
                status = seen["status"] = message["status"]
                if status in (201, 202) or status >= 400:
                    for k, v in message.get("headers", ()):
                        k = k.lower()
                        if k == b"content-type" and v.startswith(b"application/json"):
                            seen["json"] = True
                        elif k == b"content-length" and v.isdigit() and int(v) > SNIFF_BYTES:
                            seen["big"] = True
            elif message["type"] == "http.response.body" and seen.get("json") and not seen.get("big"):
                chunks.append(message.get("body", b""))
                if sum(map(len, chunks)) > SNIFF_BYTES:
                    seen["big"] = True
                    chunks.clear()
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            auth.unwatch_target(token)
            try:
                self._record(scope, seen, chunks, target)
            except Exception:  # noqa: BLE001 - never fail a request for its audit row
                log.exception("audit: a row could not be made for %s %s", scope["method"], scope["path"][:80])

    def _route(self, scope) -> tuple[str | None, dict]:
        """The matched route's template and path params; for a request refused before routing
        (401, 403) the named route it would have matched."""
        route = scope.get("route")
        if route is not None:
            return getattr(route, "path", None), scope.get("path_params") or {}
        for regex, template in _TEMPLATES.get(scope["method"], ()):
            m = regex.fullmatch(scope["path"])
            if m is not None:
                return template, m.groupdict()
        return None, {}

    def _record(self, scope, seen: dict, chunks: list[bytes], target: list[str]) -> None:
        method, status = scope["method"], seen["status"]
        path, params = self._route(scope)
        action = action_name(method, path if path is not None else self._clean(scope["path"]))
        if status < 400 and action in QUIET:
            return
        state = scope.get("state") or {}
        p = state.get("principal")
        tenant = getattr(p, "tenant_id", None) or params.get("tid")
        parts = [self._clean(v) for v in params.values()]
        error = "no_answer" if status == NO_ANSWER else None
        if chunks and not seen.get("big"):
            try:
                doc = json.loads(b"".join(chunks))
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                if status >= 400:
                    err = doc.get("error")
                    if isinstance(err, dict) and isinstance(err.get("code"), str):
                        error = _cut(err["code"])[:64]
                else:
                    items = doc.get("items")
                    items = items if isinstance(items, list) else []
                    made = [doc, *(i for i in items if isinstance(i, dict))][:20]
                    names = [m.get("id") or m.get("name") for m in made]
                    parts += [_cut(n) for n in names if isinstance(n, str) and _cut(n) not in parts]
                    if tenant is None:
                        tenant = doc.get("tenant_id") if isinstance(doc.get("tenant_id"), str) else None
                        if tenant is None and action == "tenant.create" and isinstance(doc.get("id"), str):
                            tenant = doc["id"]
        if tenant is None and target:
            tenant = target[0]  # an admin's request naming no tenant: the tenant of what it acted on
        client = scope.get("client")
        self.audit.record(
            (
                dbm.utcnow(),
                getattr(p, "key_id", None),
                _cut(tenant)[:64] if tenant else None,
                action,
                "/".join(parts)[:512] or None,
                status,
                error,
                state.get("request_id"),
                _cut(client[0])[:64] if client else None,
            )
        )
