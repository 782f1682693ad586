"""Public route of the audit trail: `GET /v1/audit` (admin keys only: controlplane.app refuses the
others), one page of controlplane.audit's rows in (at, id) order with filters and a signed cursor.

What is pending in memory is written first, so a mutation that has answered is in the next list.
Part of the app built by controlplane.app.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from atoll.controlplane import audit, http
from atoll.core import errors

router = APIRouter(tags=["audit"])


class AuditResult(BaseModel):
    status: int = Field(description="The HTTP status the request was answered with")
    error: str | None = Field(description="The error code of a failure (e.g. forbidden), else null")


class AuditEntry(BaseModel):
    at: str = Field(description="When the answer was sent (ISO 8601, UTC)")
    key_id: str | None = Field(description='The key used ("admin" for ATOLL_API_KEY); null: no valid key')
    tenant_id: str | None = Field(description="The key's tenant, or the tenant the request acted in")
    action: str = Field(description='e.g. "sandbox.create", "secret.put", "key.create"')
    target: str | None = Field(description="Ids and names from the path, and what a create made")
    result: AuditResult
    request_id: str | None
    source: str | None = Field(description="The client's address")


class AuditList(BaseModel):
    items: list[AuditEntry]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last")


def _time(value: str | None, name: str) -> dt.datetime | None:
    return http.query_time(name, value)


def _log(request: Request) -> audit.AuditLog:
    return request.app.state.audit


@router.get(
    "/v1/audit",
    responses={
        200: {"model": AuditList},
        **http.error_responses(
            {
                400: "invalid_request: a bad time, a reversed range, a limit outside 1-1000, or a "
                "cursor this server did not issue",
                403: "forbidden: an admin key is needed",
            }
        ),
    },
)
async def list_audit(
    request: Request,
    from_: Annotated[
        str | None, Query(alias="from", description="From this time (ISO 8601, inclusive; naive = UTC)")
    ] = None,
    to: Annotated[str | None, Query(description="Up to this time (ISO 8601, exclusive)")] = None,
    tenant_id: Annotated[str | None, Query(description="Only this tenant's rows")] = None,
    action: Annotated[
        str | None, Query(description='Only this action; a trailing * matches a prefix ("sandbox.*")')
    ] = None,
    limit: Annotated[str | None, Query(description="Rows per page, 1-1000 (default 1000)")] = None,
    cursor: Annotated[str | None, Query(description="The previous page's next_cursor")] = None,
):
    """The audit trail: every mutation (who, what, on what, the result), oldest first. Secret values,
    keys and bodies are never in it."""
    start, end = _time(from_, "from"), _time(to, "to")
    if start is not None and end is not None and start > end:
        raise errors.InvalidRequest(
            f"from {start.isoformat()} is after to {end.isoformat()}; give from <= to"
        )
    n = audit.MAX_LIMIT
    if limit is not None and limit != "":
        try:
            n = int(limit)
        except ValueError:
            n = 0
        if not 1 <= n <= audit.MAX_LIMIT:
            raise errors.InvalidRequest(
                f"limit={limit[:40]!r} is not a whole number from 1 to {audit.MAX_LIMIT}"
            )
    log = _log(request)
    await log.flush()
    rows, nxt = log.page(
        start=start,
        end=end,
        tenant_id=tenant_id or None,
        action=action or None,
        limit=n,
        cursor=cursor or None,
    )
    return http.json_response({"items": [audit.view(r) for r in rows], "next_cursor": nxt})
