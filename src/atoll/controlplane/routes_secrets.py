"""Public routes of secrets: create, list, replace, delete. No route ever answers with a value.

Part of the app built by controlplane.app; the store is controlplane.secrets, and a replace or
delete reaches the sandboxes bound to the secret through SandboxManager.secret_changed.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response

from atoll.controlplane import auth, http, paging, schemas
from atoll.controlplane import secrets as secrets_mod
from atoll.controlplane.context import ctx

router = APIRouter(tags=["secrets"])

SecretName = Annotated[
    str, Path(description="The secret's name", json_schema_extra={"pattern": secrets_mod.NAME.pattern})
]
TOO_LARGE = http.error_responses({413: "payload_too_large: the JSON body is over 1 MiB"})


@router.post(
    "/v1/secrets",
    status_code=201,
    openapi_extra=http.body_schema(schemas.CreateSecret),
    responses={
        201: {"model": schemas.Secret, "description": "stored, sealed; the value is never returned"},
        **http.error_responses(
            {
                400: "invalid_request: a bad name, value or hosts entry (the message names it)",
                409: "secret_exists: a secret of that name exists (PUT replaces it)",
            }
        ),
        **TOO_LARGE,
    },
)
async def create_secret(request: Request):
    """Store a secret: its value sealed at rest, bound to the hosts it may be sent to. A sandbox
    created with `secrets: {ENV: name}` sees a placeholder in ENV; its egress gateway puts the value
    in place of the placeholder in requests to those hosts (headers and query string)."""
    body = await http.read_json(request, schemas.CreateSecret)
    rec = ctx(request).secrets.create(auth.acting_tenant(), body.model_dump())
    return http.json_response(secrets_mod.view(rec), 201)


@router.get("/v1/secrets", openapi_extra=paging.OPENAPI, responses={200: {"model": schemas.SecretList}})
async def list_secrets(request: Request):
    """Secrets by name, with their hosts (never their values)."""
    recs = ctx(request).secrets.list(auth.list_tenant())
    recs, nxt = paging.of_list(paging.page(request, "/v1/secrets"), recs, lambda r: (r.name, r.tenant_id))
    return http.json_response(paging.answer([secrets_mod.view(r) for r in recs], nxt))


@router.get(
    "/v1/secrets/{name}",
    responses={
        200: {"model": schemas.Secret},
        **http.error_responses({400: "invalid_request", 404: "secret_not_found"}),
    },
)
async def get_secret(request: Request, name: SecretName):
    return http.json_response(secrets_mod.view(ctx(request).secrets.get(auth.acting_tenant(), name)))


@router.put(
    "/v1/secrets/{name}",
    openapi_extra=http.body_schema(schemas.ReplaceSecret),
    responses={
        200: {"model": schemas.Secret, "description": "replaced; live sandboxes bound to it use it at once"},
        **http.error_responses({400: "invalid_request", 404: "secret_not_found"}),
        **TOO_LARGE,
    },
)
async def replace_secret(request: Request, name: SecretName):
    """Replace a secret's value and hosts (rotation): every live sandbox bound to it sends the new
    value from its next request on."""
    body = await http.read_json(request, schemas.ReplaceSecret)
    c = ctx(request)
    rec = c.secrets.create(auth.acting_tenant(), body.model_dump(exclude_none=True), replace=True, name=name)
    await c.manager.secret_changed(rec.name, rec.tenant_id)
    return http.json_response(secrets_mod.view(rec))


@router.delete(
    "/v1/secrets/{name}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "deleted; bound sandboxes' placeholders are no longer replaced"},
        **http.error_responses({400: "invalid_request", 404: "secret_not_found"}),
    },
)
async def delete_secret(request: Request, name: SecretName):
    c = ctx(request)
    c.secrets.delete(auth.acting_tenant(), name)
    await c.manager.secret_changed(name, auth.acting_tenant())
    return Response(status_code=204)
