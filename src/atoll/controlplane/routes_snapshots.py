"""Public routes of named snapshots: take one of a sandbox, list, get, delete. A create from one is
`POST /v1/sandboxes {"snapshot": id-or-name}` (routes_sandboxes).

Part of the app built by controlplane.app; the records and steps are controlplane.snapshots.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import RedirectResponse, Response

from atoll.controlplane import auth, http, paging, schemas
from atoll.controlplane import snapshots as snapshots_mod
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_sandboxes import SandboxId

router = APIRouter(tags=["snapshots"])

SnapshotRef = Annotated[
    str,
    Path(
        description="The snapshot's id (`snp-` and 16 hex digits) or its name, resolved in the tenant "
        "the caller acts in (an admin key's `?tenant_id=`, else `default`); a name may hold '/'",
    ),
]


def answer(request: Request, rec, status: int = 200) -> Response:
    snaps = ctx(request).manager.snapshots
    return http.json_response(snapshots_mod.view(rec, snaps.worker_name(rec)), status)


@router.post(
    "/v1/sandboxes/{sid}/snapshots",
    status_code=201,
    openapi_extra=http.body_schema(schemas.CreateSnapshot, required=False),
    responses={
        201: {"model": schemas.Snapshot, "description": "the snapshot, kept on the sandbox's worker"},
        **http.error_responses(
            {
                400: "invalid_request: a bad name or body",
                403: "quota_exceeded: the tenant's max_snapshots or max_snapshot_gb is reached",
                404: "sandbox_not_found",
                409: "snapshot_exists (the name is taken in your tenant); checkpoint_refused (its state "
                "cannot be saved now; it runs on untouched), sandbox_busy or invalid_state (volumes or "
                "drives mounted, failed)",
                503: "worker_unavailable",
            }
        ),
    },
)
async def create_snapshot(request: Request, sid: SandboxId):
    """Keep the sandbox's state as a snapshot: checkpointed once (it is stopped for the time of a
    checkpoint and restored, as for a fork) and kept on its worker — its memory and processes too
    unless `memory` is false. Sandboxes created from it (`POST /v1/sandboxes {"snapshot": …}`) start
    from that state, each with its own identity."""
    body = await http.read_json(request, schemas.CreateSnapshot, optional=True)
    rec = await ctx(request).manager.snapshots.take(
        sid, body.name, body.memory, body.replace, body.end_streams
    )
    return answer(request, rec, 201)


@router.get(
    "/v1/snapshots",
    openapi_extra=paging.OPENAPI,
    responses={
        200: {"model": schemas.SnapshotList},
        **http.error_responses({400: "invalid_request: a bad limit or cursor"}),
    },
)
async def list_snapshots(
    request: Request,
    sandbox_id: str | None = Query(None, description="Only snapshots taken of this sandbox"),
    name: str | None = Query(None, description="Only the snapshot of this name"),
):
    """Your snapshots, oldest first."""
    paging.once(request, "sandbox_id", "name")
    recs, nxt = paging.snapshots(
        request, paging.page(request, "/v1/snapshots"), auth.list_tenant(), sandbox_id, name
    )
    snaps = ctx(request).manager.snapshots
    return http.json_response(paging.answer([snapshots_mod.view(r, snaps.worker_name(r)) for r in recs], nxt))


@router.get(
    "/v1/snapshots/{snid:path}",
    responses={
        200: {"model": schemas.Snapshot},
        307: {"description": "`GET /v1/snapshots/` (nothing after the slash): the list, at /v1/snapshots"},
        **http.error_responses({400: "invalid_request: neither an id nor a name", 404: "snapshot_not_found"}),
    },
)
async def get_snapshot(request: Request, snid: SnapshotRef):
    """One snapshot, by id or by name."""
    if snid == "":  # as every other collection's trailing slash: to the list (this route took the path)
        query = request.url.query
        return RedirectResponse("/v1/snapshots" + ("?" + query if query else ""), status_code=307)
    return answer(request, ctx(request).manager.snapshots.get(snid))


@router.delete(
    "/v1/snapshots/{snid:path}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "deleted (sandboxes made from it are not affected)"},
        **http.error_responses(
            {
                400: "invalid_request: neither an id nor a name",
                404: "snapshot_not_found",
                503: "worker_unavailable: the worker keeping it cannot be reached now (retryable)",
            }
        ),
    },
)
async def delete_snapshot(request: Request, snid: SnapshotRef):
    """Delete a snapshot, named by id or by name (sandboxes made from it live on)."""
    await ctx(request).manager.snapshots.delete(snid)
    return Response(status_code=204)
