"""Public routes of sandboxes as records: create, list, get, delete, pause, resume, network policy,
preview URLs.

Part of the app built by controlplane.app; everything goes through SandboxManager.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response

from atoll.controlplane import auth, forking, http, idempotency, lifetime, paging, schemas
from atoll.controlplane.context import ctx
from atoll.core import errors, ids
from atoll.core.lifecycle import State, Tier

router = APIRouter(tags=["sandboxes"])

# A sandbox id in a path. The pattern is documented, not enforced here: SandboxManager.get answers
# 400 invalid_request for a malformed id with a message that says what ids look like.
SandboxId = Annotated[
    str,
    Path(
        description="The sandbox's id: `sb-` and 16 lower-case letters/digits",
        json_schema_extra={"pattern": ids.SANDBOX_ID_RE.pattern},
    ),
]

# The error answers of the routes (all schemas.ErrorBody). 401 unauthorized and 500 internal_error
# can come from every protected route (the middleware's auth and last line of defence): app declares
# them on all of them. ERRORS are those of a call that reaches the sandbox's worker.
BAD_ID = {400: "invalid_request: the id (or a parameter) is malformed", 404: "sandbox_not_found"}
ERROR_TEXTS = {
    400: "invalid_request: the body, a parameter or the id is malformed",
    404: "sandbox_not_found",
    409: "invalid_state, sandbox_busy (retryable) or sandbox_failed",
    500: "runtime_error: a host step failed (the sandbox is then failed)",
    503: "worker_unavailable: the sandbox's worker cannot be reached now; no_worker: resuming it from "
    "the disk or archive tier found no worker with a free slot (both retryable)",
}
ERRORS = http.error_responses(ERROR_TEXTS)
TOO_LARGE = http.error_responses({413: "payload_too_large: the JSON body is over 1 MiB"})


def view(request: Request, rec) -> dict:
    manager = ctx(request).manager
    h = manager.workers.handles.get(rec.worker_id)
    return schemas.sandbox_view(
        rec, h.name if h else None, manager.usage.get(rec.id), worker_state=h.state if h else None
    )


def answer(request: Request, rec, status: int = 200) -> Response:
    return http.json_response(view(request, rec), status)


@router.post(
    "/v1/sandboxes",
    status_code=201,
    openapi_extra={
        **http.body_schema(schemas.CreateSandbox, required=False),
        "parameters": [
            {
                "name": idempotency.HEADER,
                "in": "header",
                "required": False,
                "description": "Makes a retry safe: the same key (per tenant, 1-255 printable ASCII "
                "characters) within 24 h answers the first create's sandbox (201 with the header "
                f"`{idempotency.REPLAYED_HEADER}: true`) instead of making another; with another body "
                "it is refused (409 idempotency_key_reused)",
                "schema": {"type": "string", "minLength": 1, "maxLength": 255},
            }
        ],
    },
    responses={
        201: {"model": schemas.Sandbox, "description": "the sandbox, running"},
        **http.error_responses(
            {
                400: "invalid_request: the body is malformed, or asks for more than any worker has, or "
                "the Idempotency-Key is not 1-255 printable ASCII characters",
                404: "template_not_found",
                409: "idempotency_key_reused: the key named a create with another body; or "
                "idempotency_key_in_use: its first create is still running (retryable)",
                500: "runtime_error: the sandbox could not be started (it is left failed)",
                503: "no_worker, or worker_unavailable: no worker can take it now (retryable)",
            }
        ),
        **TOO_LARGE,
    },
)
async def create_sandbox(request: Request):
    """Create a sandbox on a ready worker and answer once it runs (every field optional). A user
    template's sandbox is claimed from its warm pool when one is ready, else restored from the
    template's snapshot; the caller's env, metadata, limits, network and secrets apply either way.
    With an `Idempotency-Key` header a retry answers the first create's sandbox."""
    key = idempotency.check_key(request.headers.get(idempotency.HEADER))
    req = await http.read_json(request, schemas.CreateSandbox, optional=True)
    manager = ctx(request).manager
    if key is None:
        return answer(request, await manager.create(req), 201)
    tenant = auth.acting_tenant(req.tenant_id)
    rec, replayed = await manager.idempotency.create(
        tenant, key, req.model_dump(mode="json"), lambda placed: manager.create(req, on_placed=placed)
    )
    r = answer(request, rec, 201)
    if replayed:
        r.headers[idempotency.REPLAYED_HEADER] = "true"
    return r


@router.post(
    "/v1/sandboxes/{sid}/fork",
    status_code=201,
    responses={
        201: {"description": '{"items": [sandbox, ...]}: the copies, running'},
        **http.error_responses(
            {
                400: "invalid_request: count outside 1-50",
                404: "sandbox_not_found",
                409: "checkpoint_refused (its state cannot be saved now; it runs on untouched), sandbox_busy or invalid_state",
                503: "worker_unavailable, or no_worker: its worker has not `count` free slots",
            }
        ),
    },
)
async def fork_sandbox(request: Request, sid: SandboxId):
    """Copy a running sandbox `count` times (1-50) from one checkpoint; the parent keeps running.
    Each copy has its own id, hostname and generation (/run/atoll/identity.json inside)."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise errors.InvalidRequest(f"request body is not valid JSON: {e}") from None
    copies = await forking.fork(
        ctx(request).manager.ledger, ctx(request).manager, sid, forking.check_count(body)
    )
    return http.json_response({"items": [view(request, c) for c in copies]}, 201)


# `metadata.<KEY>=<VALUE>` query parameters: OpenAPI has no parameters named by a pattern, but an
# object parameter in the form style, exploded, is sent as one query parameter per property, so an
# object whose property names are `metadata.<KEY>` is exactly these (clients and Swagger UI send
# {"metadata.team": "a"} as `metadata.team=a`; `metadata` itself never appears in the query).
METADATA_FILTER = {
    "name": "metadata",
    "in": "query",
    "required": False,
    "style": "form",
    "explode": True,
    "description": (
        "Label filters: any number of `metadata.<KEY>=<VALUE>` query parameters, all of which must "
        "match exactly (e.g. `?metadata.team=a&metadata.env=ci`). Each property of this object is one "
        "query parameter: its name is `metadata.` followed by the label's key."
    ),
    "schema": {
        "type": "object",
        "propertyNames": {"pattern": r"^metadata\..+$"},
        "additionalProperties": {"type": "string"},
    },
    "example": {"metadata.team": "a"},
}


@router.get(
    "/v1/sandboxes",
    openapi_extra={"parameters": [METADATA_FILTER, *paging.PARAMETERS]},
    responses={
        200: {"model": schemas.SandboxList},
        **http.error_responses(
            {400: "invalid_request: an unknown state or tier filter, a bad limit or cursor"}
        ),
    },
)
async def list_sandboxes(
    request: Request,
    state: str | None = Query(
        None,
        description=(
            "Only sandboxes in this state, or in any of several separated by commas "
            f"(e.g. `running,standby`); states: {', '.join(s.value for s in State)}"
        ),
        json_schema_extra={"pattern": "^[a-z]+(,[a-z]+)*$"},  # each checked by paging.sandboxes
    ),
    tier: str | None = Query(
        None,
        description="Only sandboxes in standby in this tier",
        json_schema_extra={"enum": [t.value for t in Tier]},
    ),
    template: str | None = Query(None, description="Only sandboxes made from this template"),
    created_after: str | None = Query(
        None, description="Only sandboxes created after this time (RFC 3339, e.g. 2026-12-06T18:00:00Z)"
    ),
    created_before: str | None = Query(
        None, description="Only sandboxes created before this time (RFC 3339)"
    ),
    order: str = Query("asc", description="`asc` (oldest first, the default) or `desc` (newest first)"),
):
    """Sandboxes, oldest first (`order=desc`: newest first), a page at a time (`limit`,
    `cursor`: pass `next_cursor` until it is null). Filter by `state` (one, or several separated
    by commas: any of them, e.g. `state=running,standby`), `tier`, `template`, creation time
    (`created_after`, `created_before`), and by labels with any number of
    `metadata.<KEY>=<VALUE>` query parameters (all must match exactly), e.g.
    `GET /v1/sandboxes?state=running&metadata.team=a`."""
    # `state=running&state=standby` means any of them, as `state=running,standby` does
    states = request.query_params.getlist("state")
    state = ",".join(states) if states else None
    paging.once(request, "tier", "template", "created_after", "created_before", "order")
    if order not in ("asc", "desc"):
        raise errors.InvalidRequest(f"order={order!r} is not a sort order; use asc (oldest first) or desc")
    after, before = _instant("created_after", created_after), _instant("created_before", created_before)
    md = {k[len("metadata.") :]: v for k, v in request.query_params.items() if k.startswith("metadata.")}
    # a cursor names its order: one handed out for one order is refused for the other
    p = paging.page(request, "/v1/sandboxes" if order == "asc" else "/v1/sandboxes?order=desc")
    recs, nxt = paging.sandboxes(
        request,
        p,
        state=state,
        tier=tier,
        template=template,
        metadata=md,
        created_after=after,
        created_before=before,
        desc=order == "desc",
    )
    return http.json_response(paging.answer([view(request, r) for r in recs], nxt))


def _instant(name: str, raw: str | None) -> dt.datetime | None:
    return http.query_time(name, raw)


@router.get(
    "/v1/sandboxes/{sid}", responses={200: {"model": schemas.Sandbox}, **http.error_responses(BAD_ID)}
)
async def get_sandbox(request: Request, sid: SandboxId):
    """The sandbox object. Does not resume it."""
    return answer(request, ctx(request).manager.get(sid))


@router.delete(
    "/v1/sandboxes/{sid}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "deleted; its runtime is removed in the background"},
        **http.error_responses(BAD_ID),
    },
)
async def delete_sandbox(request: Request, sid: SandboxId):
    await ctx(request).manager.delete(sid)
    return Response(status_code=204)


@router.post(
    "/v1/sandboxes/{sid}/pause",
    openapi_extra=http.body_schema(schemas.PauseRequest, required=False),
    responses={200: {"model": schemas.Sandbox}, **ERRORS, **TOO_LARGE},
)
async def pause_sandbox(request: Request, sid: SandboxId):
    """Standby: `memory` (frozen in RAM), `disk` (checkpointed; the memory is freed) or `archive`
    (checkpointed, then moved with its files to the object store; the worker's disk is freed). A
    sandbox the checkpoint gate refuses stays in the memory tier, one whose archive upload fails
    stays in the disk tier, and `standby_reason` says why."""
    manager = ctx(request).manager
    manager.get(sid)
    req = await http.read_json(request, schemas.PauseRequest, optional=True)
    return answer(request, await manager.pause(sid, Tier(req.tier), end_streams=req.end_streams))


@router.post("/v1/sandboxes/{sid}/resume", responses={200: {"model": schemas.Sandbox}, **ERRORS})
async def resume_sandbox(request: Request, sid: SandboxId):
    return answer(request, await ctx(request).manager.resume(sid))


@router.put(
    "/v1/sandboxes/{sid}/network",
    openapi_extra=http.body_schema(schemas.NetworkPolicy),
    responses={
        200: {"model": schemas.NetworkPolicy, "description": "the policy as applied (normalized)"},
        **ERRORS,
        **TOO_LARGE,
    },
)
async def set_network(request: Request, sid: SandboxId):
    """Replace the sandbox's egress policy, live: new connections and DNS questions follow it at
    once (open connections stay), in any state but failed; a sandbox in standby is not resumed."""
    manager = ctx(request).manager
    manager.get(sid)
    req = await http.read_json(request, schemas.NetworkPolicy)
    return http.json_response(await manager.set_network(sid, req.model_dump()), 200)


PortNumber = Annotated[int, Path(description="A TCP port in the sandbox", ge=1, le=65535)]


@router.get(
    "/v1/sandboxes/{sid}/preview/{port}",
    responses={200: {"model": schemas.Preview}, **http.error_responses(BAD_ID)},
)
async def get_preview(
    request: Request,
    sid: SandboxId,
    port: PortNumber,
    expires_in_s: float | None = Query(
        None,
        description="Lifetime of the signed URL in seconds (default 3600, at most 7 days)",
        gt=0,
        le=7 * 86400,
    ),
):
    """The preview URL of a port (served by the ingress router, ATOLL_INGRESS_PORT), the sandbox's
    access token (header `Atoll-Access-Token`), a signed URL, and whether the port is public. A
    request to a sandbox in standby resumes it. Does not resume it itself."""
    return http.json_response(ctx(request).previews.describe(sid, port, expires_in_s))


@router.put(
    "/v1/sandboxes/{sid}/preview/{port}",
    openapi_extra=http.body_schema(schemas.PreviewUpdate),
    responses={200: {"model": schemas.Preview}, **http.error_responses(BAD_ID), **TOO_LARGE},
)
async def set_preview(request: Request, sid: SandboxId, port: PortNumber):
    """Make a port public (`{"public": true}`: no token needed) or private again."""
    c = ctx(request)
    c.manager.get(sid)
    req = await http.read_json(request, schemas.PreviewUpdate)
    c.manager.set_preview(sid, port, req.public)
    return http.json_response(c.previews.describe(sid, port))


# ---- live settings and figures (controlplane.lifetime) -----------------------------------------
@router.patch(
    "/v1/sandboxes/{sid}",
    openapi_extra=http.body_schema(schemas.UpdateSandbox),
    responses={
        200: {"model": schemas.Sandbox, "description": "the sandbox, its new settings applied"},
        **http.error_responses(
            {
                400: "invalid_request: an unknown field, a value out of bounds, a lifetime in the past",
                404: "sandbox_not_found",
            }
        ),
        **TOO_LARGE,
    },
)
async def update_sandbox(request: Request, sid: SandboxId):
    """Change `idle_timeout_s`, `disk_after_s`, `timeout_s` (the lifetime, from now; null removes
    it), `on_timeout` or `metadata` (replaces the labels), in any state, live; only the fields
    sent change. Does not resume it."""
    manager = ctx(request).manager
    manager.get(sid)
    req = await http.read_json(request, schemas.UpdateSandbox)
    return answer(request, lifetime.update(manager.ledger, sid, req))


@router.get(
    "/v1/sandboxes/{sid}/metrics",
    responses={200: {"model": schemas.SandboxMetrics}, **ERRORS},
)
async def sandbox_metrics(request: Request, sid: SandboxId):
    """CPU, memory, disk and process figures now, from its cgroups, writable layer and guest
    agent. Does not resume it: in standby cpu_percent is 0 and processes null."""
    manager = ctx(request).manager
    rec = manager.get(sid)
    base = {"sandbox_id": sid, "state": rec.state, "standby_tier": rec.standby_tier}
    if rec.state not in (State.RUNNING, State.STANDBY):  # creating or failed: nothing to measure
        zeros = {"cpu_percent": 0.0, "memory_used_mb": 0.0, "disk_used_mb": 0.0, "processes": None}
        return http.json_response(
            {**base, **zeros, "memory_limit_mb": rec.memory_mb, "disk_limit_mb": rec.disk_mb}
        )
    m = await manager.worker(rec).metrics(sid)
    fields = (
        "cpu_percent",
        "memory_used_mb",
        "memory_limit_mb",
        "disk_used_mb",
        "disk_limit_mb",
        "processes",
    )
    return http.json_response({**base, **{f: getattr(m, f) for f in fields}})
