"""`GET /v1/sandboxes/watch`: the caller's sandboxes, then every change to them, as one NDJSON stream.

Lines, one JSON object each:

    {"type": "sandbox", "sandbox": {...}}   a sandbox as GET /v1/sandboxes/{id} answers it: first
                                            every live one, newest first (the snapshot, read and
                                            sent SNAPSHOT_BATCH at a time), then each one that
                                            changed (created, paused, resumed, failed, claimed from
                                            a pool...); a deleted one comes once with state "deleted"
    {"type": "synced", "count": N}          the snapshot is complete (N sandboxes); changes follow
    {"type": "heartbeat"}                   nothing changed for HEARTBEAT_S seconds

Changes are found in the records, not in this process's memory, so a stream sees the changes made
through every server sharing the database: every POLL_S seconds a read of the marks (id, version,
write time) of the rows whose `updated_at` (set by every write, Database.save) is past the newest
one seen minus SKEW_S (another server's clock may lag), then of the whole rows of those whose
`version` differs from the one sent.
Tenant-scoped like the list: a tenant key sees its tenant, an admin key every tenant (or one, with
`?tenant_id=`). The stream ends when the client goes away or its key is revoked (auth.Keys cuts it).

Built for the dashboard (atoll.ui), which cannot poll cheaply and cannot send an Authorization
header with EventSource: it reads this with fetch(). Part of the app built by controlplane.app,
included before routes_sandboxes so that `watch` is not taken for a sandbox id.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import typing

import sqlalchemy as sa
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from atoll.controlplane import auth, http, paging
from atoll.controlplane import db as dbm
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_sandboxes import view
from atoll.core.lifecycle import State

router = APIRouter(tags=["sandboxes"])

POLL_S = 0.5
"""Seconds between two reads of the records for changes."""
HEARTBEAT_S = 15.0
"""Seconds without a change after which a heartbeat line is sent (keeps proxies from timing out)."""
SNAPSHOT_BATCH = 500
"""Records of the snapshot read and written at a time."""
SKEW_S = 5.0
"""How far back each read looks past the newest change seen: writes of servers whose clock lags."""


def _snapshot_page(request: Request, tenant: str | None, after: tuple | None) -> list[typing.Any]:
    """SNAPSHOT_BATCH live, non-pooled records of `tenant` (None: all), newest first, after the
    (created_at, id) key `after` (None: from the newest)."""
    R = dbm.SandboxRecord
    stmt = sa.select(*paging._sandbox_columns()).where(R.pooled.is_(False), R.state != State.DELETED.value)
    if tenant is not None:
        stmt = stmt.where(R.tenant_id == tenant)
    if after is not None:
        stmt = stmt.where(paging._past((R.created_at, R.id), after, True))
    stmt = stmt.order_by(R.created_at.desc(), R.id.desc()).limit(SNAPSHOT_BATCH)
    with ctx(request).manager.db.session() as s:
        return [paging.Row(r._asdict()) for r in s.execute(stmt)]


def _changes(
    request: Request, tenant: str | None, since: dt.datetime, sent: dict[str, int]
) -> tuple[list[typing.Any], dt.datetime | None]:
    """The non-pooled records of `tenant` written after `since` (deleted ones included) whose
    version is not the one in `sent`, oldest write first, and the newest write time seen. Two
    reads: the marks of what was written (the skew window holds many rows after a burst of
    writes), then the whole rows of those that changed only."""
    R = dbm.SandboxRecord
    marks = sa.select(R.id, R.version, R.updated_at, R.state).where(R.pooled.is_(False), R.updated_at > since)
    if tenant is not None:
        marks = marks.where(R.tenant_id == tenant)
    with ctx(request).manager.db.session() as s:
        seen = s.execute(marks).all()
        newest = max((_aware(m.updated_at) for m in seen), default=None)
        changed = [
            m.id
            for m in seen
            if (m.id in sent if m.state == State.DELETED.value else sent.get(m.id) != m.version)
        ]
        rows: list[typing.Any] = []
        for i in range(0, len(changed), 500):
            stmt = sa.select(*paging._sandbox_columns()).where(R.id.in_(changed[i : i + 500]))
            rows.extend(paging.Row(r._asdict()) for r in s.execute(stmt))
    return sorted(rows, key=lambda r: (_aware(r.updated_at), r.id)), newest


def _aware(t: dt.datetime) -> dt.datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)  # SQLite hands back naive times


@router.get(
    "/v1/sandboxes/watch",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": 'NDJSON: `{"type": "sandbox", "sandbox": {...}}` for every live sandbox, '
            '`{"type": "synced", "count": N}`, then a `sandbox` line for each change (state "deleted" '
            'once for a deleted one) and `{"type": "heartbeat"}` every 15 s without one',
            "content": {http.NDJSON: {"schema": {"type": "string"}}},
        },
    },
)
async def watch_sandboxes(request: Request):
    """The caller's sandboxes and then each change to them, live, as NDJSON (one line per
    sandbox), until the client disconnects. A tenant key sees its tenant; an admin key every
    tenant, or one with `?tenant_id=`. Changes made through any server are seen within about a
    second."""
    tenant = auth.list_tenant()
    start = dt.datetime.now(dt.UTC)  # changes from here on are the polls' (SKEW_S covers other clocks)
    first = await asyncio.to_thread(_snapshot_page, request, tenant, None)

    async def body() -> typing.AsyncIterator[bytes]:
        sent: dict[str, int] = {}
        page = first
        # the snapshot a page at a time, newest first: the first lines go out before the rest is read
        while page:
            for r in page:
                sent[r.id] = r.version
            yield b"".join(http.dumps({"type": "sandbox", "sandbox": view(request, r)}) + b"\n" for r in page)
            if len(page) < SNAPSHOT_BATCH:
                break
            page = await asyncio.to_thread(
                _snapshot_page, request, tenant, (page[-1].created_at, page[-1].id)
            )
        yield http.dumps({"type": "synced", "count": len(sent)}) + b"\n"
        mark = start
        quiet = 0.0
        while True:
            await asyncio.sleep(POLL_S)
            since = mark - dt.timedelta(seconds=SKEW_S)
            rows, newest = await asyncio.to_thread(_changes, request, tenant, since, sent)
            mark = max(mark, newest) if newest else mark
            lines = []
            for r in rows:
                if r.state == State.DELETED.value:
                    if sent.pop(r.id, None) is None:
                        continue  # deleted before this stream saw it, or already told
                elif sent.get(r.id) == r.version:
                    continue
                else:
                    sent[r.id] = r.version
                lines.append(http.dumps({"type": "sandbox", "sandbox": view(request, r)}) + b"\n")
            if lines:
                quiet = 0.0
                yield b"".join(lines)
            else:
                quiet += POLL_S
                if quiet >= HEARTBEAT_S:
                    quiet = 0.0
                    yield b'{"type":"heartbeat"}\n'

    return StreamingResponse(body(), media_type=http.NDJSON, headers={"Cache-Control": "no-store"})
