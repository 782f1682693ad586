"""The public REST API as one FastAPI app: middleware (request id, auth, durations), the error
envelope, the routers (controlplane.routes_*), and an OpenAPI document you can drive.

Errors are always `{"error": {"code", "message", "request_id", "retryable"}}`; internal causes are
logged with the request id, never sent to the caller, and nothing escapes as a traceback (a last
line of defence answers 500 internal_error). Every route but the public ones needs
`Authorization: Bearer <admin key>`, checked before routing.

/openapi.json is FastAPI's document finished by `finish_openapi` to say what this server really
does: the bearer scheme on every protected operation (so /docs can "Authorize" and "Try it out"),
the 401 and 500 any of them may answer, 400 invalid_request where FastAPI would say 422 (this server
never answers 422), and the component schemas of the bodies the routers read by hand.
Built by atoll.up and controlplane.main (create_app); the routers talk only to SandboxManager.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import time
import urllib.parse

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from atoll.controlplane import (
    audit,
    auth,
    context,
    docs_pages,
    http,
    routes_audit,
    routes_exec,
    routes_fileops,
    routes_files,
    routes_grant,
    routes_procs,
    routes_pty,
    routes_sandboxes,
    routes_secrets,
    routes_snapshots,
    routes_stores,
    routes_system,
    routes_templates,
    routes_tenants,
    routes_usage,
    routes_watch,
    routes_workers,
    schemas,
    ui_pages,
)
from atoll.controlplane import db as dbm
from atoll.controlplane import stores as stores_mod
from atoll.controlplane.context import Context
from atoll.controlplane.lifecycle import SandboxManager
from atoll.controlplane.previews import Previews
from atoll.controlplane.secrets import SecretStore
from atoll.core import errors, grants, secretbox
from atoll.shared import ptyrelay

log = logging.getLogger(__name__)

DEFAULT_MAX_EXEC_OUTPUT_BYTES = 1024 * 1024  # per stream of a non-streamed exec (ATOLL_MAX_EXEC_OUTPUT_KB)
# /metrics carries per-tenant usage labels (controlplane.metering): an admin key reads it, unless
# ATOLL_METRICS_PUBLIC=1 (read when this module is imported, i.e. at the server's start)
PUBLIC_PATHS = {"/healthz", "/openapi.json"} | (
    {"/metrics"}
    if os.environ.get("ATOLL_METRICS_PUBLIC", "").lower() in ("1", "true", "yes", "on")
    else set()
)
# and docs_pages.is_public: /docs, /redoc; ui_pages.is_public: /ui, its assets, /favicon.ico


def _public(path: str) -> bool:
    return path in PUBLIC_PATHS or docs_pages.is_public(path) or ui_pages.is_public(path)


SLASHED_NAMES = ("/v1/snapshots/",)
"""Paths whose last part is a name that may hold '/' (sent encoded as %2F by the SDK): a snapshot's."""
BEARER = "bearerAuth"  # the security scheme's name in /openapi.json


def finish_openapi(doc: dict) -> dict:
    """FastAPI's document (changed in place, and returned) made true to this server; see the module
    docstring. Every `$ref` in the result resolves (tests/component/test_openapi.py checks)."""
    components = doc.setdefault("components", {})
    error_ref = http.ref(schemas.ErrorBody)
    found = components.setdefault("schemas", {})
    for name, schema in http.component_schemas().items():
        found.setdefault(name, schema)
    components["securitySchemes"] = {
        BEARER: {
            "type": "http",
            "scheme": "bearer",
            "description": "The admin API key: ATOLL_API_KEY, or the one in $ATOLL_HOME/admin.key",
        }
    }

    def error(description: str) -> dict:
        return {"description": description, "content": {"application/json": {"schema": error_ref}}}

    internal = "internal_error: a bug; the server logged it under the request id (retryable)"
    for path, operations in doc.get("paths", {}).items():
        for op in operations.values():
            answers = op.setdefault("responses", {})
            answers.pop("422", None)  # a failed validation is 400 invalid_request (validation_error)
            if op.get("parameters") or op.get("requestBody"):
                answers.setdefault("400", error("invalid_request: a parameter or the body is malformed"))
            if path not in PUBLIC_PATHS:
                op["security"] = [{BEARER: []}]
                answers.setdefault("401", error("unauthorized: missing or wrong API key"))
            if "500" in answers:
                answers["500"]["description"] += "; or " + internal
            else:
                answers["500"] = error(internal)
    used = set()

    def refs(node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str):
                    used.add(v.rsplit("/", 1)[-1])
                else:
                    refs(v)
        elif isinstance(node, list):
            for v in node:
                refs(v)

    refs(doc.get("paths", {}))
    refs({k: v for k, v in found.items() if k not in ("HTTPValidationError", "ValidationError")})
    for name in ("HTTPValidationError", "ValidationError"):  # only FastAPI's 422s named them
        if name not in used:
            found.pop(name, None)
    return doc


def _bearer(scope) -> bytes:
    for k, v in scope["headers"]:
        if k == b"authorization":
            scheme, _, token = v.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


GRANT_PATH = re.compile(r"/v1/sandboxes/(sb-[0-9a-z]{16})/grant")


def _e2b_access(scope) -> tuple[str, str] | None:
    """(sandbox id, token) of a `POST /v1/sandboxes/{id}/grant` that carries `Authorization:
    E2B-Access <token>` (the E2B edge with only an envd access token); else None."""
    m = GRANT_PATH.fullmatch(scope["path"])
    if m is None or scope.get("method") != "POST":
        return None
    for k, v in scope["headers"]:
        if k == b"authorization":
            scheme, _, token = v.partition(b" ")
            if scheme.lower() != grants.E2B_ACCESS_SCHEME.lower().encode():
                return None
            return m.group(1), token.strip().decode("latin-1")
    return None


def _drive_token(scope) -> tuple[str, str] | None:
    """(drive name, token) of a request to a drive's file routes that carries `Authorization:
    E2B-Volume <token>` (a drive token, E2B's volume token); else None."""
    m = grants.DRIVE_FILES_PATH.fullmatch(scope["path"])
    if m is None:
        return None
    for k, v in scope["headers"]:
        if k == b"authorization":
            scheme, _, token = v.partition(b" ")
            if scheme.lower() != grants.E2B_VOLUME_SCHEME.lower().encode():
                return None
            return m.group("name"), token.strip().decode("latin-1")
    return None


WORKER_PATHS = re.compile(
    r"/v1/workers/(register|certificate)|/v1/workers/[^/]+/(heartbeat|stopping)|/v1/ca\.crt"
)
"""What a `worker` key may call: the worker protocol's server side."""
ADMIN_PATHS = re.compile(r"/v1/(tenants|keys|workers|audit|leases)(/.*)?|/metrics")
"""What only an admin key may call (a tenant key gets 403 forbidden)."""


def _query_tenant(scope) -> str | None:
    """The request's `?tenant_id=` (an admin acts in that tenant), or None."""
    for k, v in urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")):
        if k == "tenant_id":
            return v
    return None


def _scope_refusal(p: auth.Principal, path: str) -> str | None:
    """Why the key's scope does not allow `path` (None: allowed)."""
    if p.scope == "worker":
        if not WORKER_PATHS.fullmatch(path):
            return "a worker key may call only the worker protocol (register, heartbeat); use a tenant or admin key"
    elif WORKER_PATHS.fullmatch(path) and path != "/v1/ca.crt" and p.scope != "admin":
        return "the worker protocol needs a worker (or admin) key"
    elif p.scope == "tenant" and ADMIN_PATHS.fullmatch(path):
        return f"{path} needs an admin key; this is a tenant key"
    return None


async def _refuse_websocket(scope, send) -> None:
    """A WebSocket handshake without the key: 401 with atoll's error body where the server can
    send one (the ASGI websocket.http.response extension), else a plain refusal (403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        body = http.dumps(
            {
                "error": {
                    "code": "unauthorized",
                    "message": "missing or wrong API key; send 'Authorization: Bearer <key>'",
                    "retryable": False,
                }
            }
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "websocket.http.response.start", "status": 401, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": 1008})


WS_AUTH_MESSAGE_S = 10.0
"""Seconds a WebSocket opened with `?auth=message` has to send its key."""


def _message_auth(scope) -> bool:
    """A WebSocket handshake with `?auth=message` and no Authorization header: its key comes in the
    first message (a browser's WebSocket cannot send headers; the dashboard, atoll.ui, opens its
    terminals so)."""
    if not any(k == b"authorization" for k, _ in scope["headers"]):
        query = urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1"))
        return ("auth", "message") in query
    return False


async def _key_from_first_message(scope, receive, send, keys: auth.Keys):
    """Accept the handshake, read the first message, `{"authorization": "Bearer <key>"}`, and check
    the key. A good key: (principal, receive, send) for the route, which sees a fresh handshake
    (its accept is swallowed: this one is already sent). A wrong one, or none within
    WS_AUTH_MESSAGE_S: an `{"error"}` text message, a close with 4401, and None."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return None
    await send({"type": "websocket.accept"})
    principal = None
    try:
        first = await asyncio.wait_for(receive(), WS_AUTH_MESSAGE_S)
    except TimeoutError:
        first = {}
    if first.get("type") == "websocket.disconnect":
        return None
    try:
        body = json.loads(first.get("text") or first.get("bytes") or b"")
        scheme, _, token = str(body.get("authorization", "")).partition(" ")
        if scheme.lower() == "bearer":
            principal = keys.check(token.strip().encode("latin-1", "replace"))
    except (ValueError, AttributeError):
        principal = None
    why = "missing, wrong, revoked or expired API key" if principal is None else None
    if principal is not None:
        why = _scope_refusal(principal, scope["path"])
    if why is not None:
        hint = 'the first message must be {"authorization": "Bearer <key>"}'
        await send({"type": "websocket.send", "text": ptyrelay.error_text("unauthorized", f"{why}; {hint}")})
        await send({"type": "websocket.close", "code": 4401})
        return None
    replayed = False

    async def receive_after():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "websocket.connect"}
        return await receive()

    async def send_after(msg):
        if msg["type"] == "websocket.accept":
            return None
        if msg["type"] == "websocket.http.response.start":  # refused after the accept: close instead
            return await send({"type": "websocket.close", "code": 4000 + msg.get("status", 500)})
        if msg["type"] == "websocket.http.response.body":
            return None
        return await send(msg)

    return principal, receive_after, send_after


def create_app(
    manager: SandboxManager,
    *,
    api_key: str,
    max_file_bytes: int,
    max_exec_output_bytes: int = DEFAULT_MAX_EXEC_OUTPUT_BYTES,
    previews: Previews | None = None,
    audit_retention_days: int = audit.DEFAULT_RETENTION_DAYS,
) -> FastAPI:
    app = FastAPI(
        title="atoll",
        version=context.VERSION,
        description=(
            "Execution substrate for AI agents: gVisor sandboxes with memory-preserving standby, "
            "on one or more workers. Authenticate with `Authorization: Bearer <admin key>`."
        ),
        swagger_ui_parameters={"persistAuthorization": True},
        docs_url=None,  # docs_pages serves /docs and /redoc with local assets
        redoc_url=None,
    )
    docs_pages.install(app)
    ui_pages.install(app)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = finish_openapi(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if manager.secrets is None:  # a test's manager: secrets sealed with a key of this process only
        manager.secrets = SecretStore(manager.db, secretbox.new_key())
    if previews is None:
        previews = Previews(manager, secretbox.new_key(), "atoll.localhost", 7081)
    app.state.ctx = Context(manager, max_file_bytes, max_exec_output_bytes, manager.secrets, previews)
    m = manager.m
    keys = auth.Keys(manager.db, manager.secrets.key, api_key)
    keys.ensure_default()
    manager.keys = keys
    app.state.audit = audit.AuditLog(manager.db, manager.secrets.key, audit_retention_days)

    e2b_key = grants.e2b_access_key(manager.secrets.key)  # k_e2b: derived here, never stored
    app.state.e2b_key = e2b_key

    def _access_principal(sid: str, token: str) -> auth.Principal | None:
        """The principal of an envd access token presented for sandbox `sid`'s grant: that
        sandbox's tenant, for that one route (None: not its token)."""
        if not grants.check_e2b_access_token(e2b_key, sid, token):
            return None
        try:
            tenant = manager.get(sid).tenant_id
        except errors.NotFound:
            tenant = None  # the route answers 404 as for any caller
        return auth.e2b_access(tenant)

    def _drive_principal(name: str, token: str) -> auth.Principal | None:
        """The principal of a drive token presented on drive `name`'s file routes: the drive's
        tenant (None: not that drive's token)."""
        tenant = grants.drive_token_tenant(token)
        if tenant is None or not auth.TENANT_ID_RE.fullmatch(tenant):
            return None
        try:
            rec = manager.stores.record("drive", name, tenant)
        except errors.AtollError:
            return None
        if not grants.check_drive_token(e2b_key, tenant, name, stores_mod.created_unix(rec), token):
            return None
        return auth.drive_token(tenant)

    async def request_context(scope, receive, send, inner):
        """Pure ASGI middleware (BaseHTTPMiddleware costs ~1 ms a request): request id, auth,
        duration metric, and a JSON 500 if anything escapes."""
        if scope["type"] == "websocket":  # terminals (routes_pty): the handshake needs the key too
            if _public(scope["path"]):
                return await inner(scope, receive, send)
            if _message_auth(scope):  # a browser: the key comes in the first message
                got = await _key_from_first_message(scope, receive, send, keys)
                if got is None:
                    return None
                p, receive, send = got
            else:
                p = keys.check(_bearer(scope))
            if p is None or _scope_refusal(p, scope["path"]):
                return await _refuse_websocket(scope, send)
            token = auth.set_current(p)
            try:
                with keys.tracking(p):
                    return await inner(scope, receive, send)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or not keys.was_cut(task):
                    raise
                task.uncancel()
                log.info("terminal closed: its key was revoked or expired", extra={"path": scope["path"]})
                with contextlib.suppress(Exception):
                    await send({"type": "websocket.close", "code": 1008, "reason": "key revoked or expired"})
                return None
            finally:
                auth.reset_current(token)
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        rid = "req_" + secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = rid
        t0 = time.perf_counter()
        path = scope["path"]
        principal = None
        raw_path = scope.get("raw_path") or b""
        if (b"%2f" in raw_path or b"%2F" in raw_path) and not path.startswith(SLASHED_NAMES):
            # An id ending in an encoded '/' (`…/pty/..%2f`) decodes to a path with a trailing
            # slash, which the router would answer with a 307 to the path without it (`…/pty/..`),
            # and a client that follows it removes the dot segment: a DELETE of the sandbox.
            # Snapshot names may hold '/': their routes take the rest of the path and never redirect.
            resp = http.error_response(
                400,
                "invalid_request",
                f"the URL path {errors.shown(path)} has an encoded '/' (%2F) in a segment; no atoll id "
                "or name but a snapshot's contains '/' — send the id as GET /v1/sandboxes (or the list "
                "it came from) shows it",
                rid,
            )
            return await resp(scope, receive, send)
        if not _public(path):
            access = _e2b_access(scope)
            drive = _drive_token(scope) if access is None else None
            if access is not None:
                principal = _access_principal(*access)
            elif drive is not None:
                principal = _drive_principal(*drive)
            else:
                principal = keys.check(_bearer(scope))
            scope["state"]["principal"] = principal  # also for a refusal: the audit names the key
            if principal is None:
                if access is not None:
                    unknown = (
                        f"wrong or missing envd access token for sandbox {access[0]} (Authorization: "
                        f"{grants.E2B_ACCESS_SCHEME} <token>, the envdAccessToken of that sandbox)"
                    )
                elif drive is not None:
                    unknown = (
                        f"wrong drive token for drive {drive[0][:64]!r} (Authorization: "
                        f"{grants.E2B_VOLUME_SCHEME} <token>, from POST /v1/drives/{{name}}/token; a "
                        "drive made again under the same name has a new token)"
                    )
                else:
                    unknown = (
                        "missing, wrong, revoked or expired API key; send 'Authorization: Bearer <key>' "
                        "(the admin key is ATOLL_API_KEY or $ATOLL_HOME/admin.key)"
                    )
                resp = http.error_response(401, "unauthorized", unknown, rid)
                return await resp(scope, receive, send)
            why = _scope_refusal(principal, path)
            if why is not None:
                return await http.error_response(403, "forbidden", why, rid)(scope, receive, send)
            if principal.admin and b"tenant_id=" in scope.get("query_string", b""):
                tid = _query_tenant(scope)
                if tid is not None and not auth.TENANT_ID_RE.fullmatch(tid):
                    resp = http.error_response(
                        400,
                        "invalid_request",
                        f"tenant_id {tid[:80]!r} is not a tenant id (tn-… or default)",
                        rid,
                    )
                    return await resp(scope, receive, send)
                principal = auth.for_tenant(principal, tid)
                scope["state"]["principal"] = principal
        ctx_token = auth.set_current(principal)
        status = {"code": 500, "started": False}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                headers = message.get("headers", [])
                if not any(k.lower() == b"x-request-id" for k, _ in headers):  # error answers carry it
                    message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            with keys.tracking(principal) if principal is not None else contextlib.nullcontext():
                await inner(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or not keys.was_cut(task):
                raise
            task.uncancel()  # cut by auth.Keys: its key was revoked or expired under it
            log.info("request cut: its key was revoked or expired", extra={"request_id": rid, "path": path})
            if not status["started"]:
                resp = http.error_response(
                    401, "unauthorized", "the API key was revoked or expired during the request", rid
                )
                await resp(scope, receive, send)
            status["code"] = 401
        except Exception:  # noqa: BLE001 - last line of defence: never a traceback to the client
            log.exception("unhandled error", extra={"request_id": rid, "path": path})
            if not status["started"]:
                resp = http.error_response(
                    500, "internal_error", f"internal error; the server logged it as {rid}", rid, True
                )
                await resp(scope, receive, send)
        finally:
            auth.reset_current(ctx_token)
        route = scope.get("route")
        m.requests.labels(route=getattr(route, "path", "unmatched"), status=str(status["code"])).observe(
            time.perf_counter() - t0
        )

    @app.exception_handler(errors.AtollError)
    async def atoll_error(request: Request, exc: errors.AtollError):
        rid = getattr(request.state, "request_id", "req_unknown")
        if exc.status >= 500 or exc.detail:
            level = logging.ERROR if exc.status >= 500 and exc.status not in (503, 507) else logging.INFO
            log.log(
                level,
                "request failed: %s",
                exc.message,
                extra={"request_id": rid, "path": request.url.path, "detail": exc.detail},
            )
        resp = http.error_response(exc.status, exc.code, exc.message, rid, exc.retryable)
        retry_after = getattr(exc, "retry_after", None)
        if retry_after is not None:
            resp.headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
        return resp

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        rid = getattr(request.state, "request_id", "req_unknown")
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ())) or "request"
            parts.append(f"{loc}: {err.get('msg')} (got {http.excerpt(err.get('input'))})")
        return http.error_response(400, "invalid_request", "invalid request: " + "; ".join(parts), rid)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        rid = getattr(request.state, "request_id", "req_unknown")
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        msg = f"{request.method} {request.url.path}: {exc.detail}; see /openapi.json for the API"
        return http.error_response(exc.status_code, code, msg, rid)

    @app.exception_handler(sa_exc.DataError)
    async def unstorable(request: Request, exc: sa_exc.DataError):
        # PostgreSQL refuses what SQLite takes: a NUL character in text (in a name, a filter, a
        # path), text longer than its column. The caller's value, not a server fault.
        rid = getattr(request.state, "request_id", "req_unknown")
        cause = dbm.cause(exc)
        log.warning(
            "request refused by the database: %s", cause, extra={"request_id": rid, "path": request.url.path}
        )
        return http.error_response(
            400,
            "invalid_request",
            f"a value in this request cannot be stored or looked up in the records ({cause}); "
            "remove NUL characters and keep names and fields within their documented lengths",
            rid,
        )

    @app.exception_handler(sa_exc.OperationalError)
    @app.exception_handler(sa_exc.InterfaceError)
    async def database_down(request: Request, exc: sa_exc.DBAPIError):
        # the database cannot be reached (PostgreSQL restarting, its network cut) or, on SQLite,
        # stayed locked past the busy timeout: not a fault of this request or a bug; the pool's
        # pre-ping reconnects once it is back
        rid = getattr(request.state, "request_id", "req_unknown")
        log.warning(
            "request failed: the records database is unavailable: %s",
            dbm.cause(exc),
            extra={"request_id": rid, "path": request.url.path},
        )
        resp = http.error_response(
            503,
            "database_unavailable",
            "the records database cannot be reached right now; nothing was changed by this call "
            "unless it had committed it already — retry in a moment (with the same Idempotency-Key "
            "for a create)",
            rid,
            True,
        )
        resp.headers["Retry-After"] = "1"
        return resp

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception):
        rid = getattr(request.state, "request_id", "req_unknown")
        log.error("unhandled error", exc_info=exc, extra={"request_id": rid, "path": request.url.path})
        return http.error_response(
            500, "internal_error", f"internal error; the server logged it as {rid}", rid, True
        )

    for module in (
        routes_system,
        routes_watch,  # before routes_sandboxes: /v1/sandboxes/watch is not a sandbox id
        routes_sandboxes,
        routes_exec,
        routes_grant,
        routes_procs,
        routes_files,
        routes_fileops,
        routes_pty,
        routes_workers,
        routes_secrets,
        routes_snapshots,
        routes_templates,
        routes_stores,
        routes_tenants,
        routes_audit,
        routes_usage,
    ):
        app.include_router(module.router)

    class RequestContext:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            await request_context(scope, receive, send, self.inner)

    app.add_middleware(RequestContext)
    app.add_middleware(audit.AuditMiddleware, audit=app.state.audit, admin_key=api_key)  # outermost
    return app
