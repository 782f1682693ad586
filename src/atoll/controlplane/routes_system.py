"""Routes about the installation itself: `/healthz`, `/metrics`, `/v1/ca.crt`, and (admin)
`GET /v1/leases`: which server holds the lease of the background loops (controlplane.leases).

Part of the app built by controlplane.app.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from atoll.controlplane import http, schemas
from atoll.controlplane.context import VERSION, ctx
from atoll.core import errors

router = APIRouter()
BASE = "base"


@router.get(
    "/healthz",
    tags=["system"],
    response_model=schemas.Health,
    responses={
        503: {"model": schemas.Health, "description": "starting: no worker has the base template ready yet"}
    },
)
async def healthz(request: Request):
    """200 once atoll can create sandboxes: a worker is ready and has the `base` template (layer and
    template image) prepared; 503 `starting` until then (its first build takes a minute), so that
    "wait for /healthz" means "ready to use"; 200 `degraded` when preparing it failed."""
    c = ctx(request)
    reg = c.manager.workers
    templates = {t.name: t for t in reg.templates()}
    body: dict = {
        "status": "ok",
        "version": VERSION,
        "templates": {name: t.status for name, t in templates.items()},
        "workers": {h.name: h.state for h in reg.handles.values()},
    }
    base = templates.get(BASE)
    if not c.started or base is None or base.status in ("building", "missing"):
        body["status"] = "starting"
        if c.started and not reg.ready():
            body["error"] = "no worker is ready yet (GET /v1/workers)"
        return JSONResponse(body, status_code=503)
    if base.status == "failed":
        body["status"], body["error"] = "degraded", base.error
    return body


@router.get(
    "/metrics",
    tags=["system"],
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text format",
        }
    },
)
async def metrics_endpoint(request: Request):
    return Response(ctx(request).manager.m.render(), media_type="text/plain; version=0.0.4")


@router.get(
    "/v1/ca.crt",
    tags=["system"],
    response_class=Response,
    responses={
        200: {
            "content": {"application/x-pem-file": {"schema": {"type": "string"}}},
            "description": "the installation's root CA (PEM): what preview URLs' certificates and the "
            "gateway's intercepted HTTPS chain to",
        },
        **http.error_responses({404: "not_found: this server has no CA"}),
    },
)
async def ca_certificate(request: Request):
    """The installation's root certificate: trust it to verify preview URLs (`https://…:ATOLL_INGRESS_PORT`)
    from another machine (on the server it is `$ATOLL_HOME/ca/root.crt`)."""
    authority = ctx(request).manager.authority
    if authority is None:
        raise errors.NotFound("this server has no certificate authority")
    return Response(authority.root_pem, media_type="application/x-pem-file")


@router.get("/v1/leases", tags=["system"], response_model=schemas.LeaseList)
async def leases(request: Request):
    """Which server runs the installation's background loops (the tier policy and lifetimes, the
    warm pools' keeper, lost workers, metering): the holder of the `leader` lease, until when,
    and the id of the server that answered. Every server serves requests; with several servers on
    one database, only the holder runs those loops, and another takes over ATOLL_LEASE_TTL_S
    after it stops renewing (admin key)."""
    leader = ctx(request).manager.leader
    rows = leader.leases.all()
    return {
        "server_id": leader.server_id,
        "items": [
            {
                **r,
                **{k: schemas.iso(r[k]) for k in ("acquired_at", "renewed_at", "expires_at")},
                "this_server": r["holder"] == leader.server_id and not r["expired"],
            }
            for r in rows
        ],
    }


@router.get(
    "/v1/whoami",
    tags=["system"],
    responses={
        200: {
            "description": '`{"key_id", "scope", "tenant_id"}`: the key this request was made with '
            '(scope "admin", "tenant" or "worker"; an admin key\'s tenant_id is null unless '
            "`?tenant_id=` names one)",
        }
    },
)
async def whoami(request: Request):
    """The key this request was made with: its id, its scope and its tenant. A tenant or admin key may ask (the
    dashboard, atoll.ui, asks at sign-in, to show an admin the admin pages only)."""
    p = request.scope["state"]["principal"]
    return {"key_id": p.key_id, "scope": p.scope, "tenant_id": p.tenant_id}
