"""The public REST API (FastAPI): sandboxes, exec, processes, files, standby, templates, health, metrics.

Errors are always `{"error": {"code", "message", "request_id", "retryable"}}`; internal causes are
logged with the request id, never sent to the caller. Bodies are parsed by hand (size-limited,
malformed JSON → 400 invalid_request) and validated with the models in controlplane.schemas.
Built by atoll.up (create_app); talks only to controlplane.lifecycle.SandboxManager.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import os
import secrets
import time
import typing

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atoll.controlplane import schemas
from atoll.controlplane.lifecycle import SandboxManager
from atoll.core import errors
from atoll.core.lifecycle import Tier

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 1024 * 1024
DEFAULT_MAX_EXEC_OUTPUT_BYTES = 1024 * 1024  # per stream of a non-streamed exec (ATOLL_MAX_EXEC_OUTPUT_KB)
NDJSON = "application/x-ndjson"
PUBLIC_PATHS = {"/healthz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def _error(status: int, code: str, message: str, request_id: str, retryable: bool = False) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, "request_id": request_id, "retryable": retryable}},
        status_code=status,
        headers={"X-Request-Id": request_id},
    )


def _body_schema(model: type[pydantic.BaseModel]) -> dict:
    return {"requestBody": {"content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _read_json(request: Request, model: type[pydantic.BaseModel], *, optional: bool = False):
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_JSON_BYTES:
        raise errors.PayloadTooLarge(
            f"request body is {declared} bytes; JSON bodies are limited to {MAX_JSON_BYTES} bytes"
        )
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > MAX_JSON_BYTES:
            raise errors.PayloadTooLarge(
                f"request body exceeds {MAX_JSON_BYTES} bytes, the limit for JSON bodies"
            )
    if not buf.strip():
        if optional:
            return model()
        raise errors.InvalidRequest(f"request body is empty; send a JSON object ({model.__name__})")
    try:
        data = json.loads(buf)
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.InvalidRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise errors.InvalidRequest(
            f"request body is nested too deeply to parse; send a JSON object ({model.__name__}) "
            "without deeply nested arrays or objects"
        ) from None
    if not isinstance(data, dict):
        raise errors.InvalidRequest(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        parts = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "body"
            parts.append(f"{loc}: {err['msg']} (got {_excerpt(err.get('input'))})")
        raise errors.InvalidRequest("invalid request body: " + "; ".join(parts)) from None


def _excerpt(value: typing.Any) -> str:
    """The start of a rejected value for an error message (a deeply nested one by its type only)."""
    try:
        return json.dumps(value, default=str)[:100]
    except (RecursionError, ValueError):
        return f"a deeply nested {type(value).__name__}"


async def _unless_disconnected(request: Request, aw: typing.Awaitable) -> typing.Any:
    """Await `aw` unless the API client hangs up first: then cancel it (the worker resets its
    connection to the guest agent, which kills the command) instead of running on unobserved."""
    task = asyncio.ensure_future(aw)

    async def hangup() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hangup())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise errors.InvalidRequest("the client disconnected; the command was stopped")
        return task.result()
    finally:
        watcher.cancel()


def _check_path(path: str | None, path_b64: str | None = None) -> str | bytes:
    """The target of a files call: `path` (text), or `path_b64` (the exact bytes, standard or URL-safe
    base64, as GET …/files/list gives them) for names that are not UTF-8; bytes go to the agent
    percent-encoded as they are."""
    if path_b64 is not None:
        if path:
            raise errors.InvalidPath("give either 'path' or 'path_b64', not both")
        try:
            raw = base64.b64decode(
                path_b64.replace(" ", "+").replace("-", "+").replace("_", "/"), validate=True
            )
        except (ValueError, binascii.Error):
            raise errors.InvalidPath(
                f"path_b64 {path_b64[:100]!r} is not base64; pass the path_b64 of a GET …/files/list entry "
                "or base64 of the path's bytes"
            ) from None
        if b"\x00" in raw:
            raise errors.InvalidPath("path_b64 decodes to a path that contains a NUL byte")
        if not raw.startswith(b"/"):
            raise errors.InvalidPath(f"path_b64 decodes to {raw[:100]!r}, which is not an absolute path")
        if b".." in raw.split(b"/"):
            raise errors.InvalidPath(f"path_b64 decodes to {raw[:100]!r}, which contains '..'")
        if len(raw) > 4096:
            raise errors.InvalidPath(f"path_b64 decodes to {len(raw)} bytes; the limit is 4096")
        return raw
    if path is None or path == "":
        raise errors.InvalidPath(
            "query parameter 'path' is required: an absolute path inside the sandbox, e.g. /home/user/a.txt "
            "(or 'path_b64', its bytes in base64, for names that are not UTF-8)"
        )
    if "\x00" in path:
        raise errors.InvalidPath("path contains a NUL byte")
    if not path.startswith("/"):
        raise errors.InvalidPath(
            f"path {path!r} is relative; give an absolute path inside the sandbox, e.g. /{path}"
        )
    if any(part == ".." for part in path.split("/")):
        raise errors.InvalidPath(
            f"path {path!r} contains '..'; give the absolute path without parent references"
        )
    if len(path) > 4096:
        raise errors.InvalidPath(f"path is {len(path)} characters; the limit is 4096")
    return path


def _host_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


def create_app(
    manager: SandboxManager,
    *,
    api_key: str,
    max_file_bytes: int,
    max_exec_output_bytes: int = DEFAULT_MAX_EXEC_OUTPUT_BYTES,
) -> FastAPI:
    app = FastAPI(
        title="atoll",
        version="0.1.0",
        description="Execution substrate for AI agents: gVisor sandboxes with memory-preserving standby.",
    )
    m = manager.m
    key_bytes = api_key.encode()

    async def request_context(scope, receive, send, inner):
        """Pure ASGI middleware (BaseHTTPMiddleware costs ~1 ms a request): request id, auth,
        duration metric, and a JSON 500 if anything escapes."""
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        rid = "req_" + secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = rid
        t0 = time.perf_counter()
        path = scope["path"]
        if path not in PUBLIC_PATHS:
            token = b""
            for k, v in scope["headers"]:
                if k == b"authorization":
                    scheme, _, token = v.partition(b" ")
                    if scheme.lower() != b"bearer":
                        token = b""
                    break
            if not hmac.compare_digest(token.strip(), key_bytes):
                resp = _error(
                    401,
                    "unauthorized",
                    "missing or wrong API key; send 'Authorization: Bearer <key>' "
                    "(the admin key is ATOLL_API_KEY or $ATOLL_HOME/admin.key)",
                    rid,
                )
                return await resp(scope, receive, send)
        status = {"code": 500, "started": False}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())],
                }
            await send(message)

        try:
            await inner(scope, receive, send_wrapper)
        except Exception:  # noqa: BLE001 - last line of defence: never a traceback to the client
            log.exception("unhandled error", extra={"request_id": rid, "path": path})
            if not status["started"]:
                resp = _error(
                    500, "internal_error", f"internal error; the server logged it as {rid}", rid, True
                )
                await resp(scope, receive, send)
        route = scope.get("route")
        m.requests.labels(route=getattr(route, "path", "unmatched"), status=str(status["code"])).observe(
            time.perf_counter() - t0
        )

    @app.exception_handler(errors.AtollError)
    async def atoll_error(request: Request, exc: errors.AtollError):
        rid = getattr(request.state, "request_id", "req_unknown")
        if exc.status >= 500 or exc.detail:
            log.log(
                logging.ERROR
                if exc.status >= 500 and exc.status != 507
                else logging.INFO,  # 507: the user's full disk
                "request failed: %s",
                exc.message,
                extra={"request_id": rid, "path": request.url.path, "detail": exc.detail},
            )
        return _error(exc.status, exc.code, exc.message, rid, exc.retryable)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        rid = getattr(request.state, "request_id", "req_unknown")
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        msg = f"{request.method} {request.url.path}: {exc.detail}; see /openapi.json for the API"
        return _error(exc.status_code, code, msg, rid)

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception):
        rid = getattr(request.state, "request_id", "req_unknown")
        log.error("unhandled error", exc_info=exc, extra={"request_id": rid, "path": request.url.path})
        return _error(500, "internal_error", f"internal error; the server logged it as {rid}", rid, True)

    # ---- public ----------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz():
        """200 once atoll can create sandboxes; 503 while the base template is still being prepared
        (its first build takes a minute), so that "wait for /healthz" means "ready to use"."""
        body = {
            "status": "ok",
            "version": app.version,
            "templates": {t["name"]: t["status"] for t in manager.worker.templates.status()},
        }
        if not manager.ready.is_set():
            body["status"] = "starting"
            return JSONResponse(body, status_code=503)
        if manager.startup_error:
            body["status"], body["error"] = "degraded", manager.startup_error
        return body

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(m.render(), media_type="text/plain; version=0.0.4")

    # ---- templates -------------------------------------------------------------------------
    @app.get("/v1/templates")
    async def list_templates():
        return {"items": manager.worker.templates.status()}

    # ---- sandboxes -------------------------------------------------------------------------
    @app.post("/v1/sandboxes", status_code=201, openapi_extra=_body_schema(schemas.CreateSandbox))
    async def create_sandbox(request: Request):
        req = await _read_json(request, schemas.CreateSandbox, optional=True)
        host_mb = _host_memory_mb()
        if req.memory_mb > host_mb:
            raise errors.InvalidRequest(
                f"memory_mb={req.memory_mb} is more than this worker's memory ({host_mb} MB); "
                f"ask for at most {host_mb} MB (less leaves room for other sandboxes)"
            )
        rec = await manager.create(req)
        return JSONResponse(schemas.sandbox_view(rec), status_code=201)

    @app.get("/v1/sandboxes")
    async def list_sandboxes(request: Request, state: str | None = None):
        md = {k[len("metadata.") :]: v for k, v in request.query_params.items() if k.startswith("metadata.")}
        return {"items": [schemas.sandbox_view(r) for r in manager.list(state, md)]}

    @app.get("/v1/sandboxes/{sid}")
    async def get_sandbox(sid: str):
        return schemas.sandbox_view(manager.get(sid))

    @app.delete("/v1/sandboxes/{sid}", status_code=204)
    async def delete_sandbox(sid: str):
        await manager.delete(sid)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sid}/pause", openapi_extra=_body_schema(schemas.PauseRequest))
    async def pause_sandbox(sid: str, request: Request):
        manager.get(sid)
        req = await _read_json(request, schemas.PauseRequest, optional=True)
        return schemas.sandbox_view(await manager.pause(sid, Tier(req.tier)))

    @app.post("/v1/sandboxes/{sid}/resume")
    async def resume_sandbox(sid: str):
        return schemas.sandbox_view(await manager.resume(sid))

    # ---- exec ------------------------------------------------------------------------------
    @app.post("/v1/sandboxes/{sid}/exec", openapi_extra=_body_schema(schemas.ExecRequest))
    async def exec_command(sid: str, request: Request):
        rec = manager.get(sid)
        req = await _read_json(request, schemas.ExecRequest)
        if req.max_output_bytes is not None and req.max_output_bytes > max_exec_output_bytes:
            raise errors.InvalidRequest(
                f"max_output_bytes={req.max_output_bytes} is above this server's limit of "
                f"{max_exec_output_bytes} bytes per stream (ATOLL_MAX_EXEC_OUTPUT_KB); ask for less, or "
                "stream the output (Accept: application/x-ndjson), which has no limit"
            )
        payload = req.model_dump()
        payload["user"] = req.user or rec.user
        payload["max_output_bytes"] = req.max_output_bytes or max_exec_output_bytes
        # The agent answers a background exec once it is spawned; a foreground one when it ends (a
        # call without timeout_s is watched by the worker's health checks instead of a deadline).
        if req.background:
            agent_timeout: float | None = 30.0
        else:
            agent_timeout = None if req.timeout_s is None else req.timeout_s + 30
        if NDJSON in request.headers.get("accept", "") and not req.background:
            stream = manager.worker.agent_stream(
                sid, "POST", "/exec", json=payload, headers={"Accept": NDJSON}, timeout=agent_timeout
            )
            return await _relay(sid, stream, media_type=NDJSON, what="exec stream", in_band_errors=True)
        # A plain exec: the agent answers when the command ends; its answer is already the API's
        # JSON (bounded by max_output_bytes) and is passed on without re-encoding.
        stream = manager.worker.agent_stream(sid, "POST", "/exec", json=payload, timeout=agent_timeout)
        return await _relay(sid, stream, media_type="application/json", what="exec answer", request=request)

    async def _relay(
        sid: str,
        stream_cm: typing.AsyncContextManager,
        *,
        media_type: str,
        what: str,
        request: Request | None = None,
        in_band_errors: bool = False,
    ) -> StreamingResponse:
        """Pass an agent answer on piece by piece, never holding it whole, counted as activity for
        as long as it flows. Until the agent's headers arrive an error is an ordinary error answer
        (and, with `request`, an API client that hangs up cancels the call); once ours are sent, a
        broken stream either ends with an in-band ndjson error line (`in_band_errors`) or is cut short."""
        cm = manager.activity(sid)
        await cm.__aenter__()
        try:
            opening = stream_cm.__aenter__()
            resp = await (_unless_disconnected(request, opening) if request is not None else opening)
        except BaseException as e:
            await cm.__aexit__(type(e), e, e.__traceback__)
            raise

        async def body() -> typing.AsyncIterator[bytes]:
            failure: BaseException | None = None
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except Exception as e:  # noqa: BLE001 - the headers are sent
                failure = e
                if isinstance(e, errors.AtollError):
                    code, message = e.code, e.message
                else:
                    code, message = "runtime_error", f"the {what} from the sandbox broke"
                log.warning("%s broke: %s", what, message, extra={"sandbox_id": sid, "detail": repr(e)})
                if not in_band_errors:
                    raise
                yield (json.dumps({"error": {"code": code, "message": message}}) + "\n").encode()
            finally:
                await stream_cm.__aexit__(None, None, None)
                # a SandboxDied passed on marks the sandbox failed (see SandboxManager.activity)
                await cm.__aexit__(type(failure) if failure else None, failure, None)

        headers = {}
        if "content-length" in resp.headers:
            headers["Content-Length"] = resp.headers["content-length"]
        return StreamingResponse(body(), media_type=media_type, headers=headers)

    @app.get("/v1/sandboxes/{sid}/processes")
    async def list_processes(sid: str):
        async with manager.activity(sid):
            r = await manager.worker.agent_request(sid, "GET", "/processes")
            return r.json()

    @app.delete("/v1/sandboxes/{sid}/processes/{pid}", status_code=204)
    async def kill_process(sid: str, pid: str):
        manager.get(sid)
        if not (pid.isascii() and pid.isdigit()) or int(pid) <= 0:
            raise errors.InvalidRequest(
                f"pid {pid!r} is not a positive integer; list processes with GET …/processes"
            )
        async with manager.activity(sid):
            await manager.worker.agent_request(sid, "DELETE", f"/processes/{int(pid)}")
        return Response(status_code=204)

    # ---- files -----------------------------------------------------------------------------
    @app.put("/v1/sandboxes/{sid}/files", status_code=204)
    async def write_file(sid: str, request: Request, path: str | None = None, path_b64: str | None = None):
        manager.get(sid)
        target = _check_path(path, path_b64)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_file_bytes:
            raise errors.PayloadTooLarge(
                f"file body is {declared} bytes; the limit is {max_file_bytes} (ATOLL_MAX_FILE_MB)"
            )

        async def limited() -> typing.AsyncIterator[bytes]:
            n = 0
            async for chunk in request.stream():
                n += len(chunk)
                if n > max_file_bytes:
                    raise errors.PayloadTooLarge(
                        f"file body exceeds {max_file_bytes} bytes (ATOLL_MAX_FILE_MB)"
                    )
                yield chunk

        headers = {"Content-Length": declared} if declared and declared.isdigit() else {}
        async with manager.activity(sid):
            await manager.worker.agent_request(
                sid,
                "PUT",
                "/files",
                params={"path": target},
                content=limited(),
                headers=headers,
                timeout=None,
            )
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sid}/files")
    async def read_file(sid: str, path: str | None = None, path_b64: str | None = None):
        manager.get(sid)
        target = _check_path(path, path_b64)
        stream = manager.worker.agent_stream(sid, "GET", "/files", params={"path": target}, timeout=None)
        return await _relay(sid, stream, media_type="application/octet-stream", what="file download")

    @app.get("/v1/sandboxes/{sid}/files/list")
    async def list_files(sid: str, path: str | None = None, path_b64: str | None = None):
        manager.get(sid)
        target = _check_path(path, path_b64)
        async with manager.activity(sid):
            r = await manager.worker.agent_request(sid, "GET", "/files/list", params={"path": target})
            return r.json()

    @app.delete("/v1/sandboxes/{sid}/files", status_code=204)
    async def delete_file(sid: str, path: str | None = None, path_b64: str | None = None):
        manager.get(sid)
        target = _check_path(path, path_b64)
        async with manager.activity(sid):
            await manager.worker.agent_request(sid, "DELETE", "/files", params={"path": target})
        return Response(status_code=204)

    class RequestContext:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            await request_context(scope, receive, send, self.inner)

    app.add_middleware(RequestContext)
    return app
