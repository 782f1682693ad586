"""Public routes of a sandbox's files: upload, download (both streamed, never held whole), list, delete.

A path is `?path=` (absolute, or relative to the sandbox's working directory; no `..`) or
`?path_b64=` (its exact bytes, for names that are not UTF-8), checked by `http.check_path`. A call resumes a sandbox in standby first. Part of the app built by controlplane.app.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from atoll.controlplane import http, schemas
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_sandboxes import ERROR_TEXTS, SandboxId

router = APIRouter(tags=["files"])

PATH = Query(
    None,
    description="Path inside the sandbox: absolute, or relative to its working directory (its template's "
    "workdir, else /), e.g. /root/a.txt; at most 4096 characters once resolved",
)
PATH_B64 = Query(
    None,
    description="The path's exact bytes in base64 (for names that are not UTF-8; see `path_b64` in listings)",
)
FILE_ERROR_TEXTS = {
    **ERROR_TEXTS,
    400: "invalid_request or invalid_path (a missing, relative or malformed path), or io_error",
    403: "permission_denied or read_only_path",
    404: "sandbox_not_found or file_not_found",
}
FILE_ERRORS = http.error_responses(FILE_ERROR_TEXTS)


@router.put(
    "/v1/sandboxes/{sid}/files",
    status_code=204,
    response_class=Response,
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "The file's content (up to ATOLL_MAX_FILE_MB MiB), streamed",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    responses={
        204: {"description": "written (parents created; an existing file keeps its mode)"},
        **http.error_responses(
            {
                **FILE_ERROR_TEXTS,
                413: "payload_too_large: the body is over ATOLL_MAX_FILE_MB",
                507: "disk_full: the sandbox's disk_mb is used up",
            }
        ),
    },
)
async def write_file(
    request: Request, sid: SandboxId, path: str | None = PATH, path_b64: str | None = PATH_B64
):
    c = ctx(request)
    target = http.check_path(path, path_b64, c.manager.get(sid).workdir)
    chunks, size = http.limited_body(request, c.max_file_bytes, "file body")
    async with c.manager.activity(sid) as worker:
        await worker.write_file(sid, target, chunks, size)
    return Response(status_code=204)


@router.get(
    "/v1/sandboxes/{sid}/files",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            "description": "the file's content, streamed",
        },
        **FILE_ERRORS,
    },
)
async def read_file(
    request: Request, sid: SandboxId, path: str | None = PATH, path_b64: str | None = PATH_B64
):
    manager = ctx(request).manager
    target = http.check_path(path, path_b64, manager.get(sid).workdir)
    download, close = await http.open_held(manager, sid, lambda w: w.read_file(sid, target))
    if download.size == 0:
        # its headers are the whole answer: the sandbox is released before they are sent (a pause
        # right after must not find this read in progress; http.relayed does so for the last chunk)
        failure: BaseException | None = None
        try:
            async for _ in download.chunks:
                pass
        except BaseException as e:
            failure = e
            raise
        finally:
            await close(failure)
        return Response(b"", media_type="application/octet-stream")
    headers = {"Content-Length": str(download.size)} if download.size is not None else {}
    return StreamingResponse(
        http.relayed(sid, download.chunks, close, "file"),
        media_type="application/octet-stream",
        headers=headers,
    )


@router.get(
    "/v1/sandboxes/{sid}/files/list",
    responses={
        200: {"model": schemas.FileList},
        **http.error_responses(
            {**FILE_ERROR_TEXTS, 413: "answer_too_large: the worker's answer is over 64 MiB"}
        ),
    },
)
async def list_files(
    request: Request, sid: SandboxId, path: str | None = PATH, path_b64: str | None = PATH_B64
):
    """The entries of a directory, sorted by name; `name_b64`/`path_b64` carry the exact bytes."""
    manager = ctx(request).manager
    target = http.check_path(path, path_b64, manager.get(sid).workdir)
    async with manager.activity(sid) as worker:
        entries = await worker.list_files(sid, target)
    return http.json_response({"items": [dataclasses.asdict(e) for e in entries]})


@router.delete(
    "/v1/sandboxes/{sid}/files",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "removed (a directory with everything in it)"}, **FILE_ERRORS},
)
async def delete_file(
    request: Request, sid: SandboxId, path: str | None = PATH, path_b64: str | None = PATH_B64
):
    manager = ctx(request).manager
    target = http.check_path(path, path_b64, manager.get(sid).workdir)
    async with manager.activity(sid) as worker:
        await worker.delete_file(sid, target)
    return Response(status_code=204)
