"""Public route that hands the data path of a sandbox to the edge: `POST /v1/sandboxes/{id}/grant`.

It resumes a sandbox in standby (the same path an exec takes) and answers its worker's URL and a
short-lived grant (core.grants) minted with that worker's token, which this server knows for every
worker it calls (held or borrowed). The edge (`atoll edge`) then sends the sandbox's exec, file
and process calls to the worker itself, so their bytes never pass through a server and a server
restart does not cut a stream. The edge never learns a worker token. `atoll up`'s worker lives in
the server's process; `atoll up` serves its seam on a loopback listener of its own (atoll.up) so
that it has a URL and a token too, and only this route uses them (a worker without them is 409
invalid_state).

Besides an API key, the route takes `Authorization: E2B-Access <token>`, the sandbox's envd access
token (core.grants; controlplane.app checks it and makes the sandbox's tenant the caller, for this
route and this sandbox only): the E2B edge's envd calls carry nothing else. A caller with a key
gets that token in the answer (`e2b_access_token`), for the E2B edge to hand out as
`envdAccessToken`. The answer carries the sandbox's `compat` (E2B's auto-resume), and a body
`{"resume": false}` asks for a grant without resuming: a sandbox in standby is then 409
invalid_state (the E2B port's envd calls to a paused sandbox without auto-resume, which E2B
answers 502, docs/e2b-compat.md §6.4).
Part of the app built by controlplane.app.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from atoll.controlplane import auth, http, schemas
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_sandboxes import ERRORS, SandboxId
from atoll.core import errors, grants, inputs

router = APIRouter(tags=["exec"])


async def _resume_wanted(request: Request) -> bool:
    """The body's `resume` (default true); an empty body is {}."""
    raw = await request.body()
    inputs.check_json_size(len(raw))
    body = inputs.json_object(raw) or {}
    unknown = set(body) - {"resume"}
    if unknown:
        raise errors.InvalidRequest(f"unknown fields {sorted(unknown)} in the grant request; known: resume")
    resume = body.get("resume", True)
    if not isinstance(resume, bool):
        raise errors.InvalidRequest(f"resume must be true or false, not {resume!r}")
    return resume


@router.post(
    "/v1/sandboxes/{sid}/grant",
    responses={200: {"model": schemas.Grant}, **ERRORS},
    openapi_extra={
        "requestBody": {
            "required": False,
            "content": {"application/json": {"schema": schemas.GrantRequest.model_json_schema()}},
        }
    },
)
async def grant_data_path(request: Request, sid: SandboxId):
    """A grant for the sandbox's data verbs on its worker, good for 60 s (resumes it if in standby,
    unless the body says `{"resume": false}`: then 409 invalid_state). Meant for the edge; what it
    allows is what the key that asked may do to this sandbox. Also takes `Authorization: E2B-Access
    <envd access token>` of this sandbox instead of a key."""
    c = ctx(request)
    resume = await _resume_wanted(request)
    async with c.manager.activity(sid, resume=resume) as worker:
        rec = c.manager.get(sid)
        token, url = getattr(worker, "token", None), getattr(worker, "url", None)
        if not token or not url:
            raise errors.Conflict(
                f"sandbox {sid}'s worker runs inside this server's process and serves no URL of its own "
                "(`atoll up` gives it one on loopback once it has started; a test's in-process worker has "
                "none), so there is no data path apart from this server: call the API",
                code="invalid_state",
            )
        grant, expires = grants.mint(token, sid, time.time())
    return http.json_response(
        {
            "sandbox_id": sid,
            "worker": {
                "id": rec.worker_id,
                "name": getattr(worker, "name", ""),
                "url": url,
                "tunnel_port": getattr(worker, "tunnel_port", 0),
            },
            "grant": grant,
            "expires_at": expires,
            "e2b_access_token": None
            if auth.is_e2b_access(auth.current())
            else grants.e2b_access_token(request.app.state.e2b_key, sid),
            "defaults": {
                "workdir": rec.workdir,
                "user": rec.user,
                "shell": rec.shell,
                "max_output_bytes": c.max_exec_output_bytes,
                "max_file_bytes": c.max_file_bytes,
            },
            "compat": rec.compat,
        }
    )
