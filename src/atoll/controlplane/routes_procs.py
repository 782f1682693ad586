"""Public routes of one background process as a handle: its record, its output from an offset
(re-read, or followed as NDJSON until it exits), its stdin, signals and waiting for its exit.
Each call resumes a sandbox in standby first and counts as activity while it runs; a follow or a
wait holds that activity for its whole life (so a watched process is never frozen), and ends when
the client goes away, leaving the process running. Part of the app built by controlplane.app;
the start (POST …/exec with background), the list and DELETE are in routes_exec.
"""

from __future__ import annotations

import dataclasses
import typing

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from atoll.controlplane import http, schemas
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_exec import Pid
from atoll.controlplane.routes_sandboxes import ERROR_TEXTS, SandboxId
from atoll.core import errors, inputs, signals
from atoll.core import worker_api as api

router = APIRouter(tags=["exec"])
PROC_ERRORS = http.error_responses({**ERROR_TEXTS, 404: "sandbox_not_found or process_not_found"})
STDIN_ERRORS = http.error_responses(
    {
        **ERROR_TEXTS,
        404: "sandbox_not_found or process_not_found",
        409: "process_exited (it takes no more input), stdin_closed (eof was sent, or stdin was given "
        "at start), invalid_state (it did not read for 30 s), sandbox_busy, sandbox_failed",
        413: f"payload_too_large: the body is over {api.MAX_STDIN_BYTES >> 20} MiB",
    }
)


@router.get(
    "/v1/sandboxes/{sid}/processes/{pid}",
    responses={200: {"model": schemas.ProcessInfo}, **PROC_ERRORS},
)
async def get_process(request: Request, sid: SandboxId, pid: Pid):
    """One process's record: `{pid, cmd, running, exit_code, stdin_open, output_bytes, …}`."""
    manager = ctx(request).manager
    manager.get(sid)
    n = inputs.pid(pid)
    async with manager.activity(sid) as worker:
        info = await worker.get_process(sid, n)
    return http.json_response(dataclasses.asdict(info))


@router.get(
    "/v1/sandboxes/{sid}/processes/{pid}/output",
    responses={
        200: {
            "description": (
                "NDJSON: `{stdout|stderr: text, offset}` pieces (offset = the byte offset after the "
                "piece: pass it back as ?offset= to resume), `{dropped, offset}` if output before the "
                "offset asked for is no longer kept, then `{exit_code, timed_out, duration_ms, offset}` "
                "once the process has exited (or an `{error}` line if the stream broke)"
            ),
            "content": {http.NDJSON: {"schema": {"type": "string"}}},
        },
        **PROC_ERRORS,
    },
)
async def process_output(
    request: Request,
    sid: SandboxId,
    pid: Pid,
    offset: str = Query(
        "0",
        description="Byte offset in the combined output to start at",
        json_schema_extra={"pattern": "^[0-9]+$"},
    ),
    follow: str | None = Query(None, description="1: wait for more output until the process exits"),
):
    manager = ctx(request).manager
    manager.get(sid)
    n = inputs.pid(pid)
    if not (offset.isascii() and offset.isdigit()):
        raise errors.InvalidRequest(
            f"offset {offset!r} is not a byte offset (an integer >= 0); use 0 or an offset from an earlier line"
        )
    start, following = int(offset), inputs.flag(follow, "follow")
    events, close = await http.open_held(manager, sid, lambda w: w.process_output(sid, n, start, following))

    async def body() -> typing.AsyncIterator[bytes]:
        failure: BaseException | None = None
        try:
            async for ev in events:
                yield http.dumps(api.process_line(ev)) + b"\n"
        except Exception as e:  # noqa: BLE001 - the headers are sent: report it in-band
            failure = e
            yield http.broken_line(e, sid, "output")
        finally:
            await close(failure)

    return StreamingResponse(body(), media_type=http.NDJSON)


@router.post(
    "/v1/sandboxes/{sid}/processes/{pid}/stdin",
    openapi_extra={
        "requestBody": {
            "required": False,
            "description": f"Raw bytes for the process's stdin (up to {api.MAX_STDIN_BYTES >> 20} MiB a call)",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    responses={200: {"model": schemas.StdinWritten}, **STDIN_ERRORS},
)
async def send_stdin(
    request: Request,
    sid: SandboxId,
    pid: Pid,
    eof: str | None = Query(None, description="1: close the process's stdin after this body (EOF)"),
):
    manager = ctx(request).manager
    manager.get(sid)
    n, closing = inputs.pid(pid), inputs.flag(eof, "eof")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > api.MAX_STDIN_BYTES:
        raise errors.PayloadTooLarge(
            f"stdin body is {declared} bytes; one call carries at most {api.MAX_STDIN_BYTES} — send it in parts"
        )
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > api.MAX_STDIN_BYTES:
            raise errors.PayloadTooLarge(
                f"stdin body exceeds {api.MAX_STDIN_BYTES} bytes, the most one call carries; send it in parts"
            )
    async with manager.activity(sid) as worker:
        written = await worker.send_stdin(sid, n, bytes(data), closing)
    return http.json_response({"written": written, "eof": closing})


@router.post(
    "/v1/sandboxes/{sid}/processes/{pid}/signal",
    openapi_extra=http.body_schema(schemas.SignalRequest),
    responses={200: {"model": schemas.ProcessInfo}, **PROC_ERRORS},
)
async def signal_process(request: Request, sid: SandboxId, pid: Pid):
    """Send a signal to the process's group (the command and its children, like a terminal's
    Ctrl-C for INT); answers its record as of just after."""
    manager = ctx(request).manager
    manager.get(sid)
    n = inputs.pid(pid)
    req = await http.read_json(request, schemas.SignalRequest)
    name = signals.normalize(req.signal)
    async with manager.activity(sid) as worker:
        await worker.signal_process(sid, n, name)
        info = await worker.get_process(sid, n)
    return http.json_response(dataclasses.asdict(info))


@router.post(
    "/v1/sandboxes/{sid}/processes/{pid}/wait",
    openapi_extra=http.body_schema(schemas.WaitRequest, required=False),
    responses={
        200: {"model": schemas.ProcessInfo, "description": "the record once it exited: `exit_code` is set"},
        **http.error_responses(
            {
                **ERROR_TEXTS,
                404: "sandbox_not_found or process_not_found",
                409: "process_running: still running after timeout_s (wait again); sandbox_busy, sandbox_failed",
            }
        ),
    },
)
async def wait_process(request: Request, sid: SandboxId, pid: Pid):
    manager = ctx(request).manager
    manager.get(sid)
    n = inputs.pid(pid)
    req = await http.read_json(request, schemas.WaitRequest, optional=True)
    async with manager.activity(sid) as worker:
        info = await http.unless_disconnected(request, worker.wait_process(sid, n, req.timeout_s))
    return http.json_response(dataclasses.asdict(info))
