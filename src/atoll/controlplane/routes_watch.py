"""`GET /v1/sandboxes/watch`: the caller's sandboxes, then every change to them, as one NDJSON stream.

Lines, one JSON object each:

    {"type": "sandbox", "sandbox": {...}}   a sandbox as GET /v1/sandboxes/{id} answers it: first
                                            every live one (the snapshot), then each one that
                                            changed (created, paused, resumed, failed, claimed from
                                            a pool...); a deleted one comes once with state "deleted"
    {"type": "synced", "count": N}          the snapshot is complete (N sandboxes); changes follow
    {"type": "heartbeat"}                   nothing changed for HEARTBEAT_S seconds

Changes are found in the records, not in this process's memory, so a stream sees the changes made
through every server sharing the database: every POLL_S seconds one indexed-free read of the rows
whose `updated_at` (set by every write, Database.save) is past the newest one seen minus SKEW_S
(another server's clock may lag), sent only when their `version` differs from the one sent.
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
"""Lines of the snapshot written at a time."""
SKEW_S = 5.0
"""How far back each read looks past the newest change seen: writes of servers whose clock lags."""


def _rows(request: Request, tenant: str | None, since: dt.datetime | None) -> list[typing.Any]:
    """Non-pooled records of `tenant` (None: all): the live ones (since=None), or those written
    after `since`, deleted ones included."""
    R = dbm.SandboxRecord
    stmt = sa.select(*paging._sandbox_columns()).where(R.pooled.is_(False))
    if tenant is not None:
        stmt = stmt.where(R.tenant_id == tenant)
    if since is None:
        stmt = stmt.where(R.state != State.DELETED.value).order_by(R.created_at, R.id)
    else:
        stmt = stmt.where(R.updated_at > since)
    with ctx(request).manager.db.session() as s:
        return list(s.execute(stmt).all())


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
    first = await asyncio.to_thread(_rows, request, tenant, None)

    async def body() -> typing.AsyncIterator[bytes]:
        sent: dict[str, int] = {}
        mark: dt.datetime | None = None
        lines: list[bytes] = []
        for r in first:  # sent SNAPSHOT_BATCH lines at a time: one write per line costs more than the line
            sent[r.id] = r.version
            mark = max(mark, _aware(r.updated_at)) if mark else _aware(r.updated_at)
            lines.append(http.dumps({"type": "sandbox", "sandbox": view(request, r)}) + b"\n")
            if len(lines) >= SNAPSHOT_BATCH:
                yield b"".join(lines)
                lines.clear()
        lines.append(http.dumps({"type": "synced", "count": len(first)}) + b"\n")
        yield b"".join(lines)
        mark = mark or dt.datetime.now(dt.UTC)
        quiet = 0.0
        while True:
            await asyncio.sleep(POLL_S)
            rows = await asyncio.to_thread(_rows, request, tenant, mark - dt.timedelta(seconds=SKEW_S))
            lines = []
            for r in sorted(rows, key=lambda r: (r.updated_at, r.id)):
                mark = max(mark, _aware(r.updated_at))
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
