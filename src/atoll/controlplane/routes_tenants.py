"""Public routes of tenants and API keys (admin keys only: controlplane.app refuses the others).

Tenants: create (with quotas), list, get, change (name, quotas — lowering one below the current
use is allowed: new admissions are refused, nothing running is touched), delete (refused while the
tenant owns anything, listing what). Keys: a tenant key for a tenant, an admin or worker key, a
list (never the keys themselves: only their ids), revoke (effective at the next request). The
store is controlplane.auth.Keys. Part of the app built by controlplane.app.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Path, Request
from fastapi.responses import Response

from atoll.controlplane import auth, http, paging, schemas
from atoll.controlplane import db as dbm
from atoll.controlplane.context import ctx
from atoll.core import errors

router = APIRouter(tags=["tenants"])

TenantId = Annotated[str, Path(description="The tenant's id (tn-…, or default)")]
KeyId = Annotated[str, Path(description="The key's id (ak-…)")]
ADMIN_ONLY = http.error_responses({403: "forbidden: an admin key is needed"})


def _iso(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.isoformat()


def tenant_view(rec: auth.TenantRecord) -> dict:
    return {
        "id": rec.id,
        "name": rec.name,
        "quotas": dict(rec.quotas or {}),
        "created_at": _iso(rec.created_at),
        "updated_at": _iso(rec.updated_at),
    }


def key_view(rec: auth.KeyRecord, key: str | None = None) -> dict:
    out = {
        "id": rec.id,
        "scope": rec.scope,
        "tenant_id": rec.tenant_id,
        "created_at": _iso(rec.created_at),
        "expires_at": _iso(rec.expires_at),
        "revoked_at": _iso(rec.revoked_at),
    }
    if key is not None:
        out["key"] = key
    return out


def _keys(request: Request) -> auth.Keys:
    keys = ctx(request).manager.keys
    assert keys is not None
    return keys


def _expiry(value: object) -> dt.datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise errors.InvalidRequest(f"expires_at must be an ISO 8601 time; got {value!r}")
    try:
        t = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise errors.InvalidRequest(
            f"expires_at {value!r} is not an ISO 8601 time (e.g. 2027-01-31T00:00:00Z)"
        ) from None
    return t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)


@router.post(
    "/v1/tenants",
    status_code=201,
    openapi_extra=http.body_schema(schemas.CreateTenant),
    responses={
        201: {"model": schemas.Tenant},
        **http.error_responses(
            {400: "invalid_request: a bad name or quota (the message names it)", 409: "tenant_exists"}
        ),
        **ADMIN_ONLY,
    },
)
async def create_tenant(request: Request):
    """A tenant: its sandboxes, templates, secrets, volumes and drives are its own; its keys see
    nothing else. Quotas left out are unlimited."""
    body = await http.read_json(request, schemas.CreateTenant)
    quotas = body.quotas.model_dump(exclude_none=True) if body.quotas is not None else {}
    return http.json_response(tenant_view(_keys(request).create_tenant(body.name, quotas)), 201)


@router.get(
    "/v1/tenants", openapi_extra=paging.OPENAPI, responses={200: {"model": schemas.TenantList}, **ADMIN_ONLY}
)
async def list_tenants(request: Request):
    """Tenants, oldest first, a page at a time (`limit`, `cursor`)."""
    recs, nxt = paging.tenants(request, paging.page(request, "/v1/tenants"))
    return http.json_response(paging.answer([tenant_view(t) for t in recs], nxt))


@router.get(
    "/v1/tenants/{tid}",
    responses={
        200: {"model": schemas.Tenant},
        **http.error_responses({404: "tenant_not_found"}),
        **ADMIN_ONLY,
    },
)
async def get_tenant(request: Request, tid: TenantId):
    """The tenant, its quotas and what it uses now against them (`use`, by quota)."""
    view = tenant_view(_keys(request).tenant(tid))
    view["use"] = await asyncio.to_thread(ctx(request).manager.quotas.use, tid)
    return http.json_response(view)


@router.patch(
    "/v1/tenants/{tid}",
    openapi_extra=http.body_schema(schemas.UpdateTenant),
    responses={
        200: {"model": schemas.Tenant},
        **http.error_responses({400: "invalid_request", 404: "tenant_not_found", 409: "tenant_exists"}),
        **ADMIN_ONLY,
    },
)
async def update_tenant(request: Request, tid: TenantId):
    """Rename, or change quotas (`null` removes one). A quota lowered below the current use
    refuses new admissions; nothing running is stopped."""
    body = await http.read_json(request, schemas.UpdateTenant)
    return http.json_response(tenant_view(_keys(request).update_tenant(tid, body.name, body.quotas)))


def _owned(request: Request, tid: str) -> list[str]:
    """What the tenant still owns, as "kind name" strings (a few of each)."""
    m = ctx(request).manager
    out: list[str] = []
    with m.db.session() as s:
        for model, kind, col in (
            (dbm.SandboxRecord, "sandbox", dbm.SandboxRecord.id),
            (dbm.TemplateRecord, "template", dbm.TemplateRecord.name),
            (dbm.SecretRecord, "secret", dbm.SecretRecord.name),
            (dbm.StoreRecord, "volume/drive", dbm.StoreRecord.name),
            (dbm.SnapshotRecord, "snapshot", dbm.SnapshotRecord.id),
        ):
            q = sa.select(col).where(model.tenant_id == tid)
            if model is dbm.SandboxRecord:
                q = q.where(dbm.SandboxRecord.state != "deleted")
            out += [f"{kind} {n}" for n in s.scalars(q.limit(10))]
        q = sa.select(auth.KeyRecord.id).where(
            auth.KeyRecord.tenant_id == tid, auth.KeyRecord.revoked_at.is_(None)
        )
        out += [f"key {k}" for k in s.scalars(q.limit(10))]
    return out


@router.delete(
    "/v1/tenants/{tid}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "deleted"},
        **http.error_responses(
            {404: "tenant_not_found", 409: "tenant_in_use: it still owns resources (listed)"}
        ),
        **ADMIN_ONLY,
    },
)
async def delete_tenant(request: Request, tid: TenantId):
    """Delete an empty tenant: one that owns anything (sandboxes, templates, secrets, volumes,
    drives, snapshots, unrevoked keys) is refused with the list; `default` cannot be deleted."""
    keys = _keys(request)
    rec = keys.tenant(tid)
    if rec.id == "default":
        raise errors.InvalidRequest("the default tenant cannot be deleted")
    owned = _owned(request, tid)
    if owned:
        raise errors.Conflict(
            f"tenant {rec.name!r} still owns: {', '.join(owned)}; delete (or revoke) them first",
            code="tenant_in_use",
        )
    with keys.db.session.begin() as s:
        s.execute(sa.delete(auth.TenantRecord).where(auth.TenantRecord.id == tid))
    return Response(status_code=204)


@router.post(
    "/v1/tenants/{tid}/keys",
    status_code=201,
    openapi_extra=http.body_schema(schemas.CreateTenantKey),
    responses={
        201: {"model": schemas.ApiKey, "description": "the key is in `key`, shown this once"},
        **http.error_responses({400: "invalid_request", 404: "tenant_not_found"}),
        **ADMIN_ONLY,
    },
)
async def create_tenant_key(request: Request, tid: TenantId):
    """A `tenant` key: it sees and acts on this tenant's resources only."""
    body = await http.read_json(request, schemas.CreateTenantKey, optional=True)
    keys = _keys(request)
    keys.tenant(tid)
    rec, key = keys.create("tenant", tid, _expiry(body.expires_at))
    return http.json_response(key_view(rec, key), 201)


@router.post(
    "/v1/keys",
    status_code=201,
    openapi_extra=http.body_schema(schemas.CreateKey),
    responses={
        201: {"model": schemas.ApiKey, "description": "the key is in `key`, shown this once"},
        **http.error_responses({400: "invalid_request: a bad scope or expiry"}),
        **ADMIN_ONLY,
    },
)
async def create_key(request: Request):
    """An `admin` key (every tenant) or a `worker` key (`atoll worker` registers with it as its
    ATOLL_API_KEY; it can call nothing else)."""
    body = await http.read_json(request, schemas.CreateKey, optional=True)
    if body.scope not in ("admin", "worker"):
        raise errors.InvalidRequest(
            f"scope {body.scope!r} is not 'admin' or 'worker'; a tenant key is made with POST /v1/tenants/{{id}}/keys"
        )
    rec, key = _keys(request).create(body.scope, None, _expiry(body.expires_at))
    return http.json_response(key_view(rec, key), 201)


@router.get(
    "/v1/keys", openapi_extra=paging.OPENAPI, responses={200: {"model": schemas.ApiKeyList}, **ADMIN_ONLY}
)
async def list_keys(request: Request, tenant_id: str | None = None):
    """Keys by id (never the keys themselves), oldest first, a page at a time; `?tenant_id=` for
    one tenant's."""
    recs, nxt = paging.keys(request, paging.page(request, "/v1/keys"), tenant_id)
    return http.json_response(paging.answer([key_view(k) for k in recs], nxt))


@router.delete(
    "/v1/keys/{kid}",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "revoked"}, **http.error_responses({404: "key_not_found"}), **ADMIN_ONLY},
)
async def revoke_key(request: Request, kid: KeyId):
    """Revoke a key: the next request with it answers 401, on every server."""
    _keys(request).revoke(kid)
    return Response(status_code=204)
