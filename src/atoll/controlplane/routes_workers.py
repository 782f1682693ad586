"""Routes of workers: the admin's view (`GET /v1/workers`, drain, remove) and the worker protocol's
server side (certificate, register, heartbeat, stopping), which `atoll worker` calls with the admin key and the
`Atoll-Protocol` header (an incompatible version is refused with 409 incompatible_protocol).

Part of the app built by controlplane.app; registrations go to controlplane.workers.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response

from atoll.controlplane import http, impostors, paging, schemas
from atoll.controlplane.context import ctx
from atoll.controlplane.remote_worker import RemoteWorker
from atoll.controlplane.routes_sandboxes import TOO_LARGE
from atoll.controlplane.workers import WorkerHandle
from atoll.core import errors, ids, wire
from atoll.core import worker_api as api

log = logging.getLogger(__name__)
router = APIRouter(tags=["workers"])
NOT_FOUND = http.error_responses({404: "worker_not_found"})
WorkerId = Annotated[
    str,
    Path(
        description="The worker's id (GET /v1/workers): `wk-` and 16 lower-case letters/digits",
        json_schema_extra={"pattern": ids.WORKER_ID_RE.pattern},
    ),
]
BAD_BODY = http.error_responses({400: "invalid_request: the body is malformed"})
# The worker protocol's routes: the `Atoll-Protocol` header, and what they refuse.
PROTOCOL = {
    "parameters": [
        {
            "name": wire.PROTOCOL_HEADER,
            "in": "header",
            "required": True,
            "description": "The worker protocol version the caller speaks (another one is refused with "
            "409 incompatible_protocol)",
            "schema": {"type": "string", "enum": [str(api.PROTOCOL_VERSION)]},
        }
    ]
}


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
            "slots": cap.slots if cap else rec.capacity.get("slots", 0),
        },
        "allocated": {k: alloc[k] for k in ("memory_mb", "cpus", "disk_mb", "slots")},
        "sandboxes": alloc["sandboxes"],
        "evacuated": h.state == "draining" and alloc["sandboxes"] == 0,
        "evacuation": ev.view() if (ev := manager.evacuations.get(h.id)) is not None else None,
        "version": rec.version,
        "protocol": rec.protocol,
        "url": None if h.local else rec.url,
        "tunnel_port": None if h.local or h.info is None else (h.info.tunnel_port or None),
        "installation": rec.installation,
        "registered_at": schemas.iso(rec.registered_at),
        "last_heartbeat_at": schemas.iso(rec.last_heartbeat_at),
    }


@router.get("/v1/workers", openapi_extra=paging.OPENAPI, responses={200: {"model": schemas.WorkerList}})
async def list_workers(request: Request):
    """Every worker the server knows, by name: state (`ready`, `lost`, `draining`; `joining` while
    it is taken over), capacity, what its sandboxes hold, how many it holds, its version."""
    reg = ctx(request).manager.workers
    handles, nxt = paging.of_list(
        paging.page(request, "/v1/workers"), reg.handles.values(), lambda h: (h.name,)
    )
    return http.json_response(paging.answer([view(request, h) for h in handles], nxt))


@router.get("/v1/workers/{wid}", responses={200: {"model": schemas.Worker}, **NOT_FOUND})
async def get_worker(request: Request, wid: WorkerId):
    return http.json_response(view(request, ctx(request).manager.workers.get(wid)))


@router.post(
    "/v1/workers/{wid}/drain",
    openapi_extra=http.body_schema(schemas.DrainRequest, required=False),
    status_code=202,
    responses={
        202: {"model": schemas.Worker, "description": "draining (the evacuation runs in the background)"},
        200: {"model": schemas.Worker, "description": "undrained (`draining: false`)"},
        **BAD_BODY,
        **NOT_FOUND,
        **http.error_responses({409: "invalid_state: the worker is neither ready nor draining"}),
        **TOO_LARGE,
    },
)
async def drain_worker(request: Request, wid: WorkerId):
    """`{}` or `{"draining": true}`: no new sandboxes go to this worker, and every sandbox on it
    moves to another worker in the background (standby ones by reference through the object
    store, running ones by checkpoint, adoption and restore there: a pause of seconds, memory and
    files intact); `GET /v1/workers/{id}` shows the progress (`evacuation`, and `evacuated: true`
    once it holds none). A sandbox that cannot move (the checkpoint gate keeps it in memory, the
    store fails, no other worker has room) stays, listed with the reason. Draining again moves
    what is left. The progress is kept in the worker's record: after a server restart the
    evacuation goes on once the worker is taken over again (`resumed_at`). `{"draining": true, "evacuate": false}`: only the cordon. `{"draining": false}`:
    undrained (200), an evacuation stops between sandboxes. Through a server that does not hold
    the worker (several servers on one PostgreSQL; its `state_reason` says so) the drain is written
    to the worker's row and the server holding it takes it over within ~5 s, running the
    evacuation there."""
    req = await http.read_json(request, schemas.DrainRequest, optional=True)
    manager = ctx(request).manager
    h = manager.workers.drain(wid, req.draining, evacuate=req.evacuate)
    if h.borrowed is not None:  # its holder follows the row within seconds and runs the evacuation
        return http.json_response(view(request, h), 202 if req.draining else 200)
    if not req.draining:
        manager.evacuations.stop(h.id)
        return http.json_response(view(request, h))
    if req.evacuate:
        manager.evacuations.start(h)
    return http.json_response(view(request, h), 202)


@router.post(
    "/v1/workers/{wid}/reconcile",
    responses={
        200: {"model": schemas.ReconcileAnswer},
        **NOT_FOUND,
        **http.error_responses(
            {
                413: "answer_too_large: the worker's answer is over 64 MiB",
                500: "runtime_error: the worker's pass failed",
                503: "worker_unavailable: the worker is not ready, or cannot be reached (retryable)",
            }
        ),
    },
)
async def reconcile_worker(request: Request, wid: WorkerId):
    """Reconcile now: the worker compares its host with its runtime records (removing what no
    sandbox owns, failing sandboxes whose runtime vanished), then the server compares the records
    with the worker's inventory. Both also run every ATOLL_RECONCILE_S on their own."""
    reg = ctx(request).manager.workers
    h = reg.get(wid)
    report = await reg.api_for_worker(h).reconcile()
    await reg.reconcile(h)
    return http.json_response({"worker": wire.dump(report)})


@router.delete(
    "/v1/workers/{wid}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "forgotten; its archived sandboxes moved to other workers, the rest failed"},
        **NOT_FOUND,
        **http.error_responses(
            {
                409: "invalid_state: only a lost remote worker can be removed (not one another server hears from)"
            }
        ),
    },
)
async def remove_worker(request: Request, wid: WorkerId):
    """Forget a lost worker for good (its machine is gone). Its sandboxes in the archive tier move
    to another worker through the shared object store (they resume there on the next call), those
    with `on_worker_lost: "restore"` come back on another worker from their last archive (as
    ATOLL_WORKER_GONE_S does, controlplane.lost_workers); the others, and those no worker can
    adopt, become failed with the reason."""
    manager = ctx(request).manager
    h = manager.workers.forget(wid)
    await manager.gone.settle(h, f"its worker {h.name!r} was removed", final=True)
    return Response(status_code=204)


# ---- the worker protocol (server side) ---------------------------------------------------------


NOT_REGISTERED = http.error_responses(
    {409: "incompatible_protocol, or worker_not_registered: the server does not know this registration"}
)


def _protocol(request: Request) -> None:
    wire.check_protocol(request.headers.get(wire.PROTOCOL_HEADER), "this worker")


@router.post(
    "/v1/workers/register",
    status_code=201,
    openapi_extra={**http.body_schema(schemas.RegisterRequest), **PROTOCOL},
    responses={
        201: {"model": schemas.RegisterAnswer},
        **BAD_BODY,
        **http.error_responses(
            {
                409: "incompatible_protocol, or worker_conflict: the name is taken by another "
                "installation, by the server's own worker, or by a worker that answers (at another URL, or "
                "at this one without the proof that the registrant holds its token)"
            }
        ),
        **TOO_LARGE,
    },
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
    principal = request.scope.get("state", {}).get("principal")
    if principal is not None and principal.admin:
        log.warning(
            "worker %r registered with an admin key: deprecated; give it a worker key "
            '(POST /v1/keys {"scope": "worker"}) as its ATOLL_API_KEY',
            req.info.get("name") if isinstance(req.info, dict) else None,
        )
    workers = ctx(request).manager.workers
    await impostors.check_registration(workers, req.info, req.url.rstrip("/"), req.proof)
    answer = workers.register({"info": req.info}, req.url.rstrip("/"))
    return http.json_response(answer, 201)


@router.post(
    "/v1/workers/certificate",
    openapi_extra={**http.body_schema(schemas.CertificateRequest), **PROTOCOL},
    responses={
        200: {"model": schemas.CertificateAnswer},
        **BAD_BODY,
        **http.error_responses(
            {
                400: "invalid_request: the body is malformed, or the CSR or the URL is not usable",
                404: "not_found: this server has no certificate authority",
                409: "incompatible_protocol, or worker_conflict: the name is this server's own worker, "
                "or a registered worker's that answers",
            }
        ),
        **TOO_LARGE,
    },
)
async def worker_certificate(request: Request):
    """Called by `atoll worker` before it registers when it serves https: the installation CA signs
    its CSR (the key stays on the worker) for the URL's host and its name; the server then checks,
    on every connection to that worker, that it presents a certificate naming it."""
    _protocol(request)
    req = await http.read_json(request, schemas.CertificateRequest)
    manager = ctx(request).manager
    authority = manager.authority
    if authority is None:
        raise errors.NotFound("this server has no certificate authority")
    if not req.url.startswith("https://"):
        raise errors.InvalidRequest(f"url {req.url!r} must be the https:// URL the worker serves at")
    RemoteWorker.address(req.url)
    if any(h.local and h.name == req.name for h in manager.workers.handles.values()):
        raise errors.Conflict(
            f"worker name {req.name!r} is this server's own in-process worker; give yours another --name",
            code="worker_conflict",
        )
    await impostors.refuse_live_twin(manager.workers, req.name, None)
    try:
        cert = authority.sign_worker(req.csr.encode(), req.name, req.url)
    except ValueError as e:
        raise errors.InvalidRequest(f"csr: {e}") from None
    log.info("worker.certified", extra={"worker": req.name, "url": req.url})
    return http.json_response({"certificate": cert.decode(), "ca": authority.root_pem.decode()})


@router.post(
    "/v1/workers/{wid}/heartbeat",
    openapi_extra={**http.body_schema(schemas.HeartbeatRequest, required=False), **PROTOCOL},
    responses={200: {"model": schemas.HeartbeatAnswer}, **BAD_BODY, **NOT_REGISTERED, **TOO_LARGE},
)
async def heartbeat(request: Request, wid: WorkerId):
    """409 worker_not_registered: the server does not know this registration (it restarted): register again."""
    _protocol(request)
    req = await http.read_json(request, schemas.HeartbeatRequest, optional=True)
    return http.json_response(ctx(request).manager.workers.heartbeat(wid, req.epoch))


@router.post(
    "/v1/workers/{wid}/stopping",
    status_code=204,
    response_class=Response,
    openapi_extra={**http.body_schema(schemas.HeartbeatRequest, required=False), **PROTOCOL},
    responses={204: {"description": "shown lost at once"}, **BAD_BODY, **NOT_REGISTERED, **TOO_LARGE},
)
async def stopping(request: Request, wid: WorkerId):
    _protocol(request)
    req = await http.read_json(request, schemas.HeartbeatRequest, optional=True)
    ctx(request).manager.workers.stopping(wid, req.epoch)
    return Response(status_code=204)
