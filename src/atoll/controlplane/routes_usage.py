"""Public route of metering: `GET /v1/usage` — what was used, grouped by sandbox, day or tenant.

Reads controlplane.metering.Meter (the server's, on `app.state.meter`); a tenant key sees only its
own tenant (controlplane.auth.list_tenant), an admin key every tenant or `?tenant_id=`'s. Checks
the range (ISO 8601 times, `from` before `to`, at most metering.MAX_RANGE_DAYS) and answers 400
naming what is wrong. Part of the app built by controlplane.app.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from atoll.controlplane import auth, http, metering
from atoll.controlplane.context import ctx
from atoll.core import errors

router = APIRouter(tags=["usage"])

GROUPS = ("sandbox", "day", "tenant")


class UsageAmounts(BaseModel):
    cpu_seconds: float = Field(description="CPU time of the sandboxes' runtimes (cgroup), seconds")
    memory_gb_seconds: float = Field(description="Memory limit × seconds while running")
    standby_memory_gb_seconds: float = Field(description="Memory limit × seconds in the memory tier (no CPU)")
    snapshot_gb_seconds: float = Field(description="Snapshot size × seconds in the disk and archive tiers")
    snapshot_disk_gb_seconds: float = Field(description="… of which in the disk tier (bound: disk_mb)")
    snapshot_archive_gb_seconds: float = Field(description="… of which in the archive tier (bound: disk_mb)")
    volume_gb_seconds: float = Field(description="Volume size × seconds")
    drive_gb_seconds: float = Field(description="Drive size × seconds")
    egress_bytes: int = Field(
        description="TCP bytes the sandbox sent through its gateway (egress, preview answers)"
    )
    ingress_bytes: int = Field(description="TCP bytes that reached the sandbox through its gateway")
    build_seconds: float = Field(description="Seconds of template builds")
    cost: float = Field(description="The amounts priced by the server's price sheet (ATOLL_PRICES)")


class UsageItem(UsageAmounts):
    subject: str | None = Field(
        None,
        description="group_by=sandbox: a sandbox id, volume:<tenant>/<name>, drive:…, build:<id> or snapshot:<id>",
    )
    sandbox_id: str | None = Field(
        None, description="group_by=sandbox: the sandbox (null for other subjects)"
    )
    day: str | None = Field(None, description="group_by=day: the UTC day (YYYY-MM-DD)")
    tenant_id: str | None = Field(None, description="group_by=sandbox or tenant: the tenant")


class UsageAnswer(BaseModel):
    from_: str = Field(alias="from", description="The range's start, rounded down to an interval")
    to: str
    group_by: str
    items: list[UsageItem]
    total: UsageAmounts = Field(description="The sum of the items")


def parse_time(name: str, value: str | None, default: float) -> float:
    if value is None or value == "":
        return default
    try:
        t = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise errors.InvalidRequest(
            f"{name}={value[:80]!r} is not an ISO 8601 time; give e.g. 2026-12-01T00:00:00Z or 2026-12-01"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def check_range(
    from_: str | None, to: str | None, group_by: str | None, now: float
) -> tuple[float, float, str]:
    """(start, end, group) of a query, or errors.InvalidRequest saying what is wrong."""
    group = group_by or "sandbox"
    if group not in GROUPS:
        raise errors.InvalidRequest(f"group_by={group_by!r} is not one of {', '.join(GROUPS)}")
    end = parse_time("to", to, now)
    start = parse_time("from", from_, end - 86400)
    if start >= end:
        raise errors.InvalidRequest(f"from ({from_}) must be before to ({to or 'now'})")
    if end - start > metering.MAX_RANGE_DAYS * 86400:
        raise errors.InvalidRequest(
            f"the range from {from_} to {to or 'now'} spans {(end - start) / 86400:.0f} days; "
            f"ask for at most {metering.MAX_RANGE_DAYS} days at a time"
        )
    return start, end, group


@router.get(
    "/v1/usage",
    responses={
        200: {"model": UsageAnswer},
        **http.error_responses({400: "invalid_request: a bad time, range or group_by (the message says)"}),
    },
)
async def usage(
    request: Request,
    from_: Annotated[
        str | None, Query(alias="from", description="ISO 8601 start (default: 24 h before `to`)")
    ] = None,
    to: Annotated[str | None, Query(description="ISO 8601 end (default: now)")] = None,
    group_by: Annotated[str | None, Query(description="sandbox (default), day or tenant")] = None,
    tenant_id: Annotated[str | None, Query(description="Admin keys: only this tenant")] = None,
):
    """What was used in [from, to): per sandbox (and volume, drive, build), per UTC day or per
    tenant, with the total; up to the moment of the request (CPU up to the workers' last report,
    every few seconds). Intervals are INTERVAL_S (5 min) wide: the range rounds out to them."""
    meter: metering.Meter | None = getattr(request.app.state, "meter", None)
    if meter is None:  # an app built without controlplane.main (some tests): accrue at each query
        meter = request.app.state.meter = metering.Meter(ctx(request).manager)
    start, end, group = check_range(from_, to, group_by, meter.clock())
    return http.json_response(meter.usage(start, end, group, auth.list_tenant(tenant_id)))
