"""Public routes for terminals (PTY sessions): open, list, kill, and the WebSocket that attaches.

`POST /v1/sandboxes/{sid}/pty` starts a session (the worker's guest agent keeps it, attached or
not); `GET /v1/sandboxes/{sid}/pty/{pty_id}/ws` attaches: binary messages are terminal bytes both
ways (the session's scrollback first), client text messages `{"resize": [cols, rows]}`; the
server sends text `{"exit_code": N}` when the program ends and closes normally (1000), or text
`{"error": {...}}` for a bad message without ending the session. A client message over
MAX_MESSAGE_BYTES closes the socket with 1009 (message too big) and leaves the session running.
Behind it is the worker's frame
stream (guest.agent.ptyframes, `WorkerAPI.attach_pty`). A sandbox in standby is resumed; the open socket
holds `manager.activity` for its life (an open terminal is activity). Errors before the attach are
sent as one `{"error"}` text message, then a close with code 4000 + the HTTP status (4404...).
Part of the app built by controlplane.app (which authenticates the handshake).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Annotated

from fastapi import APIRouter, Path, Request, WebSocket
from fastapi.responses import Response

from atoll.controlplane import http, paging, schemas
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_sandboxes import ERROR_TEXTS, ERRORS, SandboxId
from atoll.core import errors
from atoll.core import worker_api as api
from atoll.guest.agent import ptyframes
from atoll.shared import ptyrelay

log = logging.getLogger(__name__)
router = APIRouter(tags=["terminals"])
PtyId = Annotated[
    str, Path(description="A terminal's id (POST …/pty)", json_schema_extra={"pattern": "^pty_[0-9a-f]{12}$"})
]
MAX_MESSAGE_BYTES = ptyrelay.MAX_MESSAGE_BYTES  # controlplane.main gives it to uvicorn (ws_max_size)


def _check_pty_id(sid: str, pty_id: str) -> None:
    if not ptyframes.is_pty_id(pty_id):
        raise errors.PtyNotFound(
            f"no terminal {errors.shown(pty_id)} in sandbox {sid} (ids look like pty_0123456789ab); "
            f"list them with GET /v1/sandboxes/{sid}/pty"
        )


@router.post(
    "/v1/sandboxes/{sid}/pty",
    status_code=201,
    openapi_extra=http.body_schema(schemas.PtyRequest, required=False),
    responses={201: {"model": schemas.PtyCreated}, **ERRORS},
)
async def open_pty(request: Request, sid: SandboxId):
    """Start a terminal session (resumes a sandbox in standby); attach to it with the WebSocket."""
    c = ctx(request)
    rec = c.manager.get(sid)
    req = await http.read_json(request, schemas.PtyRequest, optional=True)
    spec = api.PtySpec(
        cols=req.cols,
        rows=req.rows,
        term=req.term,
        cmd=req.cmd,
        cwd=req.cwd,
        env=req.env,
        user=req.user or rec.user,
    )
    async with c.manager.activity(sid) as worker:
        started = await worker.open_pty(sid, spec)
    return http.json_response(dataclasses.asdict(started), status=201)


@router.get(
    "/v1/sandboxes/{sid}/pty",
    openapi_extra=paging.OPENAPI,
    responses={200: {"model": schemas.PtyList}, **ERRORS},
)
async def list_ptys(request: Request, sid: SandboxId):
    """The sandbox's terminal sessions: running ones, and finished ones for a while; oldest first."""
    p = paging.page(request, "/v1/sandboxes/{id}/pty")
    async with ctx(request).manager.activity(sid) as worker:
        items = await worker.list_ptys(sid)
    items, nxt = paging.of_list(p, items, lambda i: (i.created_at, i.pty_id))
    return http.json_response(paging.answer([dataclasses.asdict(i) for i in items], nxt))


@router.delete(
    "/v1/sandboxes/{sid}/pty/{pty_id}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "killed (its process tree) and forgotten"},
        **http.error_responses({**ERROR_TEXTS, 404: "sandbox_not_found or pty_not_found"}),
    },
)
async def kill_pty(request: Request, sid: SandboxId, pty_id: PtyId):
    manager = ctx(request).manager
    manager.get(sid)
    _check_pty_id(sid, pty_id)
    async with manager.activity(sid) as worker:
        await worker.kill_pty(sid, pty_id)
    return Response(status_code=204)


@router.websocket("/v1/sandboxes/{sid}/pty/{pty_id}/ws")
async def attach_pty(websocket: WebSocket, sid: str, pty_id: str):
    manager = ctx(websocket).manager  # type: ignore[arg-type]
    activity = None
    try:
        manager.get(sid)
        _check_pty_id(sid, pty_id)
        activity = manager.activity(sid)
        worker = await activity.__aenter__()
        stream = await worker.attach_pty(sid, pty_id)
    except errors.AtollError as e:
        if activity is not None:
            await activity.__aexit__(type(e), e, None)
        await websocket.accept()
        await websocket.send_text(ptyrelay.error_text(e.code, e.message))
        await websocket.close(code=4000 + e.status)
        return
    failure: BaseException | None = None
    try:
        await websocket.accept()
        await ptyrelay.relay(websocket, stream, sid, pty_id)
    except errors.AtollError as e:  # raised under the relay (the sandbox died, say)
        failure = e
        with contextlib.suppress(Exception):
            await websocket.send_text(ptyrelay.error_text(e.code, e.message))
            await websocket.close(code=4000 + e.status)
    finally:
        stream.close()
        await activity.__aexit__(type(failure) if failure else None, failure, None)
