"""`Idempotency-Key` on creates: a retried `POST /v1/sandboxes` never makes a second sandbox.

A key (1-255 printable ASCII characters, per tenant) names one create for KEEP_S (24 h). The
first request with it INSERTs a row `(tenant, key) -> fingerprint of the body` before it creates
anything; the row's primary key makes that atomic through the database (SQLite or PostgreSQL, any
number of servers): a second request with the key — a retry, or one racing the first — fails that
INSERT and instead reads the row. Same body: it waits while the first is still creating, then
answers the same sandbox (as it is now); another body: 409 `idempotency_key_reused`. A create that
fails deletes its row, so its retry creates anew (a waiter then makes it itself); a key write the
database could not take (it was restarting) is retried in the background until it can
(controlplane.dbretry); a create whose sandbox started but whose start the database could not
record keeps its key pending until both are written, so a retry gets that sandbox. The row names
its sandbox as soon as the sandbox's worker is chosen, just before its record (state creating) is
written: a retry — on any server, also after the first one's server died mid-create — waits while
that record says `creating` and answers it once it runs. A dead server's unfinished create is
settled by whoever holds the worker then (controlplane.lifecycle `worker_joined`): the runtime was
made, the record follows it to running (the retry gets it); it was not, the record is dropped and
its key freed (`forget`; the retry creates anew). A row still pending without a sandbox after
PENDING_STALE_S (its server died before placing it) is taken over. Expired rows are swept now and
then. Called by controlplane.routes_sandboxes; the SandboxManager owns one `Keys`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
import time
import typing

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from atoll.controlplane import db as dbm
from atoll.controlplane import dbretry
from atoll.core import errors

log = logging.getLogger(__name__)

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
KEEP_S = 24 * 3600.0
"""How long a key names its create."""
PENDING_STALE_S = 600.0
"""A create pending this long is taken to have died with its server."""
LINK_GRACE_S = 30.0
"""A key naming a sandbox whose record is not there this long after the key was written: that
record never came (its server died between the two writes); the key is free again."""
WAIT_S = 300.0
"""How long a request waits for the first request with its key to finish."""
POLL_S = 0.05
SWEEP_EVERY_S = 600.0


class IdempotencyRecord(dbm.Base):
    __tablename__ = "idempotency_keys"
    __table_args__ = (sa.Index("ix_idempotency_keys_created_at", "created_at"),)

    tenant_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    key: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(sa.String(64))
    """SHA-256 of the create's body as understood (canonical JSON of its fields)."""
    sandbox_id: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    """The sandbox of the key, set as soon as its worker is chosen (just before its record is
    written, state creating); None until then."""
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True))


class KeyReused(errors.Conflict):
    code = "idempotency_key_reused"


class KeyInUse(errors.Conflict):
    code = "idempotency_key_in_use"
    retryable = True


def check_key(raw: str | None) -> str | None:
    """The header's value, or None when absent; 400 for an empty, too long or non-ASCII one."""
    if raw is None:
        return None
    if not raw or len(raw) > 255 or not raw.isascii() or not raw.isprintable():
        shown = raw[:40].encode("ascii", "backslashreplace").decode()
        raise errors.InvalidRequest(
            f"{HEADER} {shown!r} ({len(raw)} characters) is not valid: use 1-255 printable ASCII "
            "characters (a UUID is a good key)"
        )
    return raw


def fingerprint(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _aware(t: dt.datetime) -> dt.datetime:
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)  # SQLite hands them back naive (UTC)


class Keys:
    def __init__(self, database: dbm.Database):
        self.db = database
        self._swept = 0.0

    async def create(
        self,
        tenant: str,
        key: str,
        body: dict,
        make: typing.Callable[[typing.Callable[[str], None]], typing.Awaitable[dbm.SandboxRecord]],
    ) -> tuple[dbm.SandboxRecord, bool]:
        """The sandbox of this key: made now by `make` (False), or the earlier one (True). `make`
        is handed a callback to call with the sandbox's id once its record exists (`_link`)."""
        fp = fingerprint(body)
        self._sweep()
        deadline = time.monotonic() + WAIT_S
        while True:
            row = self._insert(tenant, key, fp)
            if row is None:
                break  # this request makes it
            if row == "again":
                continue
            if row.fingerprint != fp:
                raise KeyReused(
                    f"{HEADER} {key!r} was used by another create of this tenant with a different "
                    "body in the last 24 h; send the same body to get that sandbox, or use a new key"
                )
            if row.sandbox_id is not None:
                rec = self.db.get(row.sandbox_id)
                if rec is None:
                    if (dbm.utcnow() - _aware(row.created_at)).total_seconds() < LINK_GRACE_S:
                        await asyncio.sleep(POLL_S)  # named, its record about to be written
                        continue
                    self._drop(tenant, key, row.sandbox_id)  # its record is gone for good
                    continue
                if rec.state in ("failed", "deleted") and self._row(tenant, key) is None:
                    continue  # its create failed, or was dropped unfinished: the key is free again
                if rec.state != "creating":
                    log.info("sandbox.create.replayed", extra={"sandbox_id": rec.id, "tenant": tenant})
                    return rec, True
                # still creating: its request goes on, or its server died and whoever holds the
                # worker now settles the record (controlplane.lifecycle `worker_joined`)
            if time.monotonic() >= deadline:
                raise KeyInUse(
                    f"a create with {HEADER} {key!r} is still in progress after {WAIT_S:.0f} s; retry later"
                )
            await asyncio.sleep(POLL_S)
        placed: list[str] = []

        def on_placed(sandbox_id: str) -> None:
            placed.append(sandbox_id)
            self._link(tenant, key, sandbox_id)

        try:
            rec = await make(on_placed)
        except errors.DatabaseUnavailable as e:
            if e.made is None:
                dbretry.later(f"free key {key!r}", lambda: self._drop(tenant, key, None, placed))
            else:  # made, its start not recorded yet: the key names it once it is
                made = e.made
                dbretry.later(f"record sandbox {made} for key {key!r}", lambda: self._made(tenant, key, made))
            raise
        except BaseException:
            dbretry.later(f"free key {key!r}", lambda: self._drop(tenant, key, None, placed))
            raise
        dbretry.later(f"record sandbox {rec.id} for key {key!r}", lambda: self._made(tenant, key, rec.id))
        return rec, False

    def _made(self, tenant: str, key: str, sandbox_id: str) -> None:
        rec = self.db.get(sandbox_id)
        if rec is not None and rec.state == "creating":
            raise dbretry.NotYet(f"sandbox {sandbox_id}'s start is not recorded yet")
        with self.db.session.begin() as s:
            s.execute(
                sa.update(IdempotencyRecord)
                .where(IdempotencyRecord.tenant_id == tenant, IdempotencyRecord.key == key)
                .values(sandbox_id=sandbox_id)
            )

    def _link(self, tenant: str, key: str, sandbox_id: str) -> None:
        """The key's sandbox has its id and worker, its record (state creating) is written next:
        the key names it from now on, so a retry on any server — also after this one died
        mid-create — waits for that record to settle instead of making a second sandbox. Best
        effort: a write the database refuses now is made at the end of the create (`_made`)."""
        try:
            with self.db.session.begin() as s:
                s.execute(
                    sa.update(IdempotencyRecord)
                    .where(
                        IdempotencyRecord.tenant_id == tenant,
                        IdempotencyRecord.key == key,
                        IdempotencyRecord.sandbox_id.is_(None),
                    )
                    .values(sandbox_id=sandbox_id)
                )
        except dbretry.UNAVAILABLE as e:
            log.warning("idempotency key %r not linked to %s yet: %s", key, sandbox_id, dbm.cause(e))

    def _row(self, tenant: str, key: str) -> IdempotencyRecord | None:
        with self.db.session() as s:
            return s.get(IdempotencyRecord, (tenant, key))

    def forget(self, sandbox_id: str) -> None:
        """The create of `sandbox_id` was dropped unfinished (its server died before the worker
        made it; controlplane.lifecycle `_vanished`): its key is free for the retry to create anew."""
        with self.db.session.begin() as s:
            s.execute(sa.delete(IdempotencyRecord).where(IdempotencyRecord.sandbox_id == sandbox_id))

    def _insert(self, tenant: str, key: str, fp: str) -> IdempotencyRecord | None | typing.Literal["again"]:
        """None when this request's row went in; else the row in the way, or "again" when there
        was none after all, or an expired or abandoned one was just removed (INSERT again)."""
        now = dbm.utcnow()
        try:
            with self.db.session.begin() as s:
                s.add(IdempotencyRecord(tenant_id=tenant, key=key, fingerprint=fp, created_at=now))
            return None
        except sa.exc.IntegrityError:
            pass
        with self.db.session() as s:
            row = s.get(IdempotencyRecord, (tenant, key))
        if row is None:  # removed meanwhile
            return "again"
        age = (now - _aware(row.created_at)).total_seconds()
        if age > KEEP_S or (row.sandbox_id is None and age > PENDING_STALE_S):
            t = IdempotencyRecord
            with self.db.session.begin() as s:  # the condition again in SQL: another may have replaced it
                s.execute(
                    sa.delete(t).where(
                        t.tenant_id == tenant,
                        t.key == key,
                        sa.or_(
                            t.created_at < now - dt.timedelta(seconds=KEEP_S),
                            sa.and_(
                                t.sandbox_id.is_(None),
                                t.created_at < now - dt.timedelta(seconds=PENDING_STALE_S),
                            ),
                        ),
                    )
                )
            return "again"
        return row

    def _drop(self, tenant: str, key: str, sandbox_id: str | None, placed: typing.Sequence[str] = ()) -> None:
        """Remove the key's row if it names `sandbox_id` (None: no sandbox, or one of `placed`:
        the failed create's own, linked when it was placed)."""
        cond = (
            sa.or_(IdempotencyRecord.sandbox_id.is_(None), IdempotencyRecord.sandbox_id.in_(list(placed)))
            if sandbox_id is None
            else IdempotencyRecord.sandbox_id == sandbox_id
        )
        with self.db.session.begin() as s:
            s.execute(
                sa.delete(IdempotencyRecord).where(
                    IdempotencyRecord.tenant_id == tenant, IdempotencyRecord.key == key, cond
                )
            )

    def _sweep(self) -> None:
        if time.monotonic() - self._swept < SWEEP_EVERY_S:
            return
        self._swept = time.monotonic()
        cutoff = dbm.utcnow() - dt.timedelta(seconds=KEEP_S)
        with self.db.session.begin() as s:
            s.execute(sa.delete(IdempotencyRecord).where(IdempotencyRecord.created_at < cutoff))
