"""Public routes of sandboxes as records: create, list, get, delete, pause, resume.

Part of the app built by controlplane.app; everything goes through SandboxManager.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from atoll.controlplane import http, schemas
from atoll.controlplane.context import ctx
from atoll.core.lifecycle import Tier

router = APIRouter(tags=["sandboxes"])

ERRORS = {
    400: {
        "model": schemas.ErrorBody,
        "description": "invalid_request: the body, a parameter or the id is malformed",
    },
    401: {"model": schemas.ErrorBody, "description": "unauthorized"},
    404: {"model": schemas.ErrorBody, "description": "sandbox_not_found"},
    409: {"model": schemas.ErrorBody, "description": "invalid_state, sandbox_busy or sandbox_failed"},
    413: {"model": schemas.ErrorBody, "description": "payload_too_large"},
    500: {"model": schemas.ErrorBody, "description": "runtime_error or internal_error"},
    503: {"model": schemas.ErrorBody, "description": "worker_unavailable or no_worker (retryable)"},
}


def view(request: Request, rec) -> dict:
    return schemas.sandbox_view(rec, ctx(request).manager.workers.name_of(rec.worker_id))


def answer(request: Request, rec, status: int = 200) -> Response:
    return http.json_response(view(request, rec), status)


@router.post(
    "/v1/sandboxes",
    status_code=201,
    openapi_extra=http.body_schema(schemas.CreateSandbox, required=False),
    responses={201: {"model": schemas.Sandbox, "description": "the sandbox, running"}, **ERRORS},
)
async def create_sandbox(request: Request):
    """Create a sandbox on a ready worker and answer once it runs (every field optional)."""
    req = await http.read_json(request, schemas.CreateSandbox, optional=True)
    rec = await ctx(request).manager.create(req)
    return answer(request, rec, 201)


@router.get("/v1/sandboxes", responses={200: {"model": schemas.SandboxList}, **ERRORS})
async def list_sandboxes(
    request: Request,
    state: str | None = Query(
        None, description="Only sandboxes in this state (creating, running, standby, failed, deleted)"
    ),
):
    """Sandboxes, oldest first. Filter by `state`, and by labels with any number of
    `metadata.<KEY>=<VALUE>` query parameters (all must match exactly), e.g.
    `GET /v1/sandboxes?state=running&metadata.team=a`."""
    md = {k[len("metadata.") :]: v for k, v in request.query_params.items() if k.startswith("metadata.")}
    return http.json_response({"items": [view(request, r) for r in ctx(request).manager.list(state, md)]})


@router.get("/v1/sandboxes/{sid}", responses={200: {"model": schemas.Sandbox}, **ERRORS})
async def get_sandbox(request: Request, sid: str):
    """The sandbox object. Does not resume it."""
    return answer(request, ctx(request).manager.get(sid))


@router.delete(
    "/v1/sandboxes/{sid}",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "deleted; its runtime is removed in the background"}, **ERRORS},
)
async def delete_sandbox(request: Request, sid: str):
    await ctx(request).manager.delete(sid)
    return Response(status_code=204)


@router.post(
    "/v1/sandboxes/{sid}/pause",
    openapi_extra=http.body_schema(schemas.PauseRequest, required=False),
    responses={200: {"model": schemas.Sandbox}, **ERRORS},
)
async def pause_sandbox(request: Request, sid: str):
    """Standby: `memory` (frozen in RAM) or `disk` (checkpointed; the memory is freed). A sandbox
    the checkpoint gate refuses stays in the memory tier and `standby_reason` says why."""
    manager = ctx(request).manager
    manager.get(sid)
    req = await http.read_json(request, schemas.PauseRequest, optional=True)
    return answer(request, await manager.pause(sid, Tier(req.tier)))


@router.post("/v1/sandboxes/{sid}/resume", responses={200: {"model": schemas.Sandbox}, **ERRORS})
async def resume_sandbox(request: Request, sid: str):
    return answer(request, await ctx(request).manager.resume(sid))
