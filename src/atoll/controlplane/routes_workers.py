"""Routes of workers: the admin's view (`GET /v1/workers`, drain, remove) and the worker protocol's
server side (register, heartbeat, stopping), which `atoll worker` calls with the admin key and the
`Atoll-Protocol` header (an incompatible version is refused with 409 incompatible_protocol).

Part of the app built by controlplane.app; registrations go to controlplane.workers.
"""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Request
from fastapi.responses import Response

from atoll.controlplane import http, schemas
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_sandboxes import ERRORS
from atoll.controlplane.workers import WorkerHandle
from atoll.core import errors, wire

router = APIRouter(tags=["workers"])
W_ERRORS = {**ERRORS, 404: {"model": schemas.ErrorBody, "description": "worker_not_found"}}


def _iso(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).isoformat()


def view(request: Request, h: WorkerHandle) -> dict:
    manager = ctx(request).manager
    cap = h.info.capacity if h.info else None
    alloc = manager.allocated(h.id)
    rec = h.record
    return {
        "id": h.id,
        "name": h.name,
        "state": h.state,
        "state_reason": h.reason,
        "capacity": {
            "memory_mb": cap.memory_mb if cap else rec.capacity.get("memory_mb", 0),
            "cpus": cap.cpus if cap else rec.capacity.get("cpus", 0),
            "disk_mb": cap.disk_mb if cap else rec.capacity.get("disk_mb", 0),
        },
        "allocated": {k: alloc[k] for k in ("memory_mb", "cpus", "disk_mb")},
        "sandboxes": alloc["sandboxes"],
        "version": rec.version,
        "protocol": rec.protocol,
        "url": None if h.local else rec.url,
        "installation": rec.installation,
        "registered_at": _iso(rec.registered_at),
        "last_heartbeat_at": _iso(rec.last_heartbeat_at),
    }


@router.get("/v1/workers", responses={200: {"model": schemas.WorkerList}, **ERRORS})
async def list_workers(request: Request):
    """Every worker the server knows, by name: state (`ready`, `lost`, `draining`; `joining` while
    it is taken over), capacity, what its sandboxes hold, how many it holds, its version."""
    reg = ctx(request).manager.workers
    items = [view(request, h) for h in sorted(reg.handles.values(), key=lambda h: h.name)]
    return http.json_response({"items": items})


@router.get("/v1/workers/{wid}", responses={200: {"model": schemas.Worker}, **W_ERRORS})
async def get_worker(request: Request, wid: str):
    return http.json_response(view(request, ctx(request).manager.workers.get(wid)))


@router.post(
    "/v1/workers/{wid}/drain",
    openapi_extra=http.body_schema(schemas.DrainRequest, required=False),
    responses={200: {"model": schemas.Worker}, **W_ERRORS},
)
async def drain_worker(request: Request, wid: str):
    """`{"draining": true}` (default): no new sandboxes go to this worker; `false` undoes it."""
    req = await http.read_json(request, schemas.DrainRequest, optional=True)
    return http.json_response(view(request, ctx(request).manager.workers.drain(wid, req.draining)))


@router.delete(
    "/v1/workers/{wid}",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "forgotten; its sandboxes are failed"}, **W_ERRORS},
)
async def remove_worker(request: Request, wid: str):
    """Forget a lost worker for good (its machine is gone): its sandboxes become failed."""
    manager = ctx(request).manager
    h = manager.workers.forget(wid)
    for rec in [r for r in manager.live() if r.worker_id == h.id]:
        manager.fail_lost(rec, f"its worker {h.name!r} was removed")
    return Response(status_code=204)


# ---- the worker protocol (server side) ---------------------------------------------------------


def _protocol(request: Request) -> None:
    wire.check_protocol(request.headers.get(wire.PROTOCOL_HEADER), "this worker")


@router.post(
    "/v1/workers/register",
    status_code=201,
    openapi_extra=http.body_schema(schemas.RegisterRequest),
    responses={201: {"model": schemas.RegisterAnswer}, **W_ERRORS},
)
async def register_worker(request: Request):
    """Called by `atoll worker` at start and whenever the server forgot it: answers the worker id
    and a fresh token the server will present to it; the worker is then taken over (`joining`,
    then `ready`)."""
    _protocol(request)
    req = await http.read_json(request, schemas.RegisterRequest)
    if not req.url.startswith(("http://", "https://")):
        raise errors.InvalidRequest(
            f"url {req.url!r} must be an http:// or https:// URL the server can reach"
        )
    answer = ctx(request).manager.workers.register({"info": req.info}, req.url.rstrip("/"))
    return http.json_response(answer, 201)


@router.post(
    "/v1/workers/{wid}/heartbeat",
    openapi_extra=http.body_schema(schemas.HeartbeatRequest),
    responses={200: {"model": schemas.HeartbeatAnswer}, **W_ERRORS},
)
async def heartbeat(request: Request, wid: str):
    """409 worker_not_registered: the server does not know this registration (it restarted): register again."""
    _protocol(request)
    req = await http.read_json(request, schemas.HeartbeatRequest, optional=True)
    return http.json_response(ctx(request).manager.workers.heartbeat(wid, req.epoch))


@router.post(
    "/v1/workers/{wid}/stopping",
    status_code=204,
    response_class=Response,
    openapi_extra=http.body_schema(schemas.HeartbeatRequest),
    responses={204: {"description": "shown lost at once"}, **W_ERRORS},
)
async def stopping(request: Request, wid: str):
    _protocol(request)
    req = await http.read_json(request, schemas.HeartbeatRequest, optional=True)
    ctx(request).manager.workers.stopping(wid, req.epoch)
    return Response(status_code=204)
