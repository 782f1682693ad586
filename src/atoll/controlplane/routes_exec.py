"""Public routes that run things in a sandbox: exec (plain, streamed as ndjson, background) and its
background processes. A call resumes a sandbox in standby first and counts as activity while it runs.

The answers are atoll's own (core.worker_api types rendered here), whatever the guest agent speaks.
A plain exec answers when the command ends (output bounded by max_output_bytes per stream); with
`Accept: application/x-ndjson` every piece of output is one line `{"stdout": …}` / `{"stderr": …}`,
then `{"exit_code", "timed_out", "duration_ms"}`, or an `{"error": {…}}` line if the stream broke.
An API client that hangs up cancels the call, and the worker then kills the command.
Part of the app built by controlplane.app.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response, StreamingResponse

from atoll.controlplane import http, paging, schemas
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_sandboxes import ERROR_TEXTS, ERRORS, SandboxId
from atoll.core import errors
from atoll.core import worker_api as api

router = APIRouter(tags=["exec"])
# An answer the control plane reads whole from a remote worker is bounded (64 MiB).
ANSWER_TOO_LARGE = http.error_responses({413: "answer_too_large: the worker's answer is over 64 MiB"})
Pid = Annotated[
    str,
    Path(
        description="A background process's pid (POST …/exec with background, GET …/processes)",
        json_schema_extra={"pattern": "^[1-9][0-9]*$"},
    ),
]


@router.post(
    "/v1/sandboxes/{sid}/exec",
    openapi_extra=http.body_schema(schemas.ExecRequest),
    responses={
        200: {
            "description": "the command's result; `{pid, log_path}` for a background one; ndjson lines when streamed",
            "content": {
                "application/json": {
                    "schema": {"anyOf": [http.ref(schemas.ExecResult), http.ref(schemas.ProcessStarted)]}
                },
                http.NDJSON: {
                    "schema": {"type": "string"},
                    "description": (
                        "with `Accept: application/x-ndjson`: one JSON object a line, `{stdout}` or "
                        "`{stderr}` pieces, then `{exit_code, timed_out, duration_ms}` (or `{error}`)"
                    ),
                },
            },
        },
        **ERRORS,
        **http.error_responses(
            {413: "payload_too_large (the JSON body is over 1 MiB) or answer_too_large (the worker's answer)"}
        ),
    },
)
async def exec_command(request: Request, sid: SandboxId):
    c = ctx(request)
    rec = c.manager.get(sid)
    req = await http.read_json(request, schemas.ExecRequest)
    if req.max_output_bytes is not None and req.max_output_bytes > c.max_exec_output_bytes:
        raise errors.InvalidRequest(
            f"max_output_bytes={req.max_output_bytes} is above this server's limit of "
            f"{c.max_exec_output_bytes} bytes per stream (ATOLL_MAX_EXEC_OUTPUT_KB); ask for less, or "
            "stream the output (Accept: application/x-ndjson), which has no limit"
        )
    spec = api.ExecSpec(
        cmd=req.cmd,
        max_output_bytes=req.max_output_bytes or c.max_exec_output_bytes,
        cwd=req.cwd,
        env=req.env,
        timeout_s=req.timeout_s,
        user=req.user or rec.user,
        stdin=req.stdin,
        shell=req.shell or typing.cast(typing.Any, rec.shell),
    )
    if req.background:
        async with c.manager.activity(sid) as worker:
            started = await worker.start_process(sid, spec)
        return http.json_response(dataclasses.asdict(started))
    if http.NDJSON in request.headers.get("accept", ""):
        return await _stream(request, sid, spec)
    async with c.manager.activity(sid) as worker:
        result = await http.unless_disconnected(request, worker.exec(sid, spec))
    return http.json_response(dataclasses.asdict(result))


async def _stream(request: Request, sid: str, spec: api.ExecSpec) -> StreamingResponse:
    """A streamed exec: counted as activity for as long as it flows. Until its first line an error
    is an ordinary error answer; after that, a broken stream ends with an in-band error line."""
    events, close = await http.open_held(ctx(request).manager, sid, lambda w: w.exec_stream(sid, spec))

    async def body() -> typing.AsyncIterator[bytes]:
        failure: BaseException | None = None
        try:
            async for ev in events:
                if isinstance(ev, api.ExecOutput):
                    yield http.dumps({ev.stream: ev.text}) + b"\n"
                else:
                    yield (
                        http.dumps(
                            {
                                "exit_code": ev.exit_code,
                                "timed_out": ev.timed_out,
                                "duration_ms": ev.duration_ms,
                            }
                        )
                        + b"\n"
                    )
        except Exception as e:  # noqa: BLE001 - the headers are sent: report it in-band
            failure = e
            yield http.broken_line(e, sid, "exec")
        finally:
            await close(failure)

    return StreamingResponse(body(), media_type=http.NDJSON)


@router.get(
    "/v1/sandboxes/{sid}/processes",
    openapi_extra=paging.OPENAPI,
    responses={200: {"model": schemas.ProcessList}, **ERRORS, **ANSWER_TOO_LARGE},
)
async def list_processes(request: Request, sid: SandboxId):
    """The background processes started in the sandbox, running or finished, oldest first."""
    p = paging.page(request, "/v1/sandboxes/{id}/processes")
    async with ctx(request).manager.activity(sid) as worker:
        procs = await worker.list_processes(sid)
    procs, nxt = paging.of_list(p, procs, lambda i: (i.started_at, i.pid))
    return http.json_response(paging.answer([dataclasses.asdict(i) for i in procs], nxt))


@router.delete(
    "/v1/sandboxes/{sid}/processes/{pid}",
    status_code=204,
    response_class=Response,
    responses={
        204: {"description": "killed (with its process group)"},
        **http.error_responses({**ERROR_TEXTS, 404: "sandbox_not_found or process_not_found"}),
    },
)
async def kill_process(request: Request, sid: SandboxId, pid: Pid):
    manager = ctx(request).manager
    manager.get(sid)
    if not (pid.isascii() and pid.isdigit()) or int(pid) <= 0:
        raise errors.InvalidRequest(
            f"pid {pid!r} is not a positive integer; list processes with GET …/processes"
        )
    async with manager.activity(sid) as worker:
        await worker.kill_process(sid, int(pid))
    return Response(status_code=204)
