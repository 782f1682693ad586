"""Public routes of the fuller files API (issue 9): stat, mkdir -p, move, chmod, watch (NDJSON) and
many files at once as a tar stream (upload into a directory, download a directory).

Paths are resolved like the other file routes (`http.check_path`: absolute, or relative to the
sandbox's working directory; `path_b64` for exact bytes where a query carries the path). Every call
resumes a sandbox in standby and counts as activity; an open watch or tar download holds that
activity for as long as it streams. Part of the app built by controlplane.app.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import typing

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from atoll.controlplane import http, schemas
from atoll.controlplane.context import ctx
from atoll.controlplane.routes_files import FILE_ERROR_TEXTS, FILE_ERRORS, PATH, PATH_B64
from atoll.controlplane.routes_sandboxes import SandboxId
from atoll.core import worker_api as api

router = APIRouter(tags=["files"])

WATCH_KEEPALIVE_S = 10.0
"""A blank line this often on a quiet watch: a client that went away is noticed (and the watch
inside the sandbox ended) within this long."""
TAR = "application/x-tar"


def _stat(st: api.FileStat) -> typing.Any:
    return http.json_response(dataclasses.asdict(st))


@router.get(
    "/v1/sandboxes/{sid}/files/stat",
    responses={200: {"model": schemas.FileStat}, **FILE_ERRORS},
)
async def stat_file(
    request: Request, sid: SandboxId, path: str | None = PATH, path_b64: str | None = PATH_B64
):
    """lstat of a path: type (file, dir, symlink, other), size, mode, mtime and a symlink's target.
    A missing path is 404 file_not_found (the SDK's `exists` is built on that)."""
    manager = ctx(request).manager
    target = http.check_path(path, path_b64, manager.get(sid).workdir)
    async with manager.activity(sid) as worker:
        return _stat(await worker.stat_file(sid, target))


@router.post(
    "/v1/sandboxes/{sid}/files/mkdir",
    responses={200: {"model": schemas.MkdirResult}, **FILE_ERRORS},
)
async def make_dir(
    request: Request, sid: SandboxId, path: str | None = PATH, path_b64: str | None = PATH_B64
):
    """mkdir -p: parents are created; an existing directory is fine (`created: false`); a file in the
    way is 400 invalid_path."""
    manager = ctx(request).manager
    target = http.check_path(path, path_b64, manager.get(sid).workdir)
    async with manager.activity(sid) as worker:
        created = await worker.make_dir(sid, target)
    shown = target.decode("utf-8", "replace") if isinstance(target, bytes) else target
    return http.json_response({"path": shown, "created": created})


@router.post(
    "/v1/sandboxes/{sid}/files/move",
    openapi_extra=http.body_schema(schemas.FileMoveRequest),
    responses={200: {"model": schemas.FileStat, "description": "the stat of the new path"}, **FILE_ERRORS},
)
async def move_file(request: Request, sid: SandboxId):
    """Rename or move `from` to `to`, also across directories; the parents of `to` are created. A
    file replaces a file at `to`; a directory is never merged or replaced (400: delete `to` first).
    A missing `from` is 404; moving a directory into itself is 400."""
    body = await http.read_json(request, schemas.FileMoveRequest)
    manager = ctx(request).manager
    workdir = manager.get(sid).workdir
    src = http.check_path(body.from_, None, workdir)
    dst = http.check_path(body.to, None, workdir)
    async with manager.activity(sid) as worker:
        return _stat(await worker.move_file(sid, src, dst))


@router.post(
    "/v1/sandboxes/{sid}/files/chmod",
    openapi_extra=http.body_schema(schemas.FileChmodRequest),
    responses={200: {"model": schemas.FileStat, "description": "the stat after the change"}, **FILE_ERRORS},
)
async def chmod_file(request: Request, sid: SandboxId):
    """Set a path's permission bits: `mode` as an integer or octal text ("755")."""
    body = await http.read_json(request, schemas.FileChmodRequest)
    manager = ctx(request).manager
    target = http.check_path(body.path, None, manager.get(sid).workdir)
    async with manager.activity(sid) as worker:
        return _stat(await worker.chmod_file(sid, target, int(body.mode)))


def _event_line(ev: api.FileEvent) -> bytes:
    obj: dict[str, typing.Any] = {"type": ev.type, "path": ev.path, "is_dir": ev.is_dir}
    if ev.from_path is not None:
        obj["from"] = ev.from_path
    return http.dumps(obj) + b"\n"


@router.get(
    "/v1/sandboxes/{sid}/files/watch",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {http.NDJSON: {"schema": http.ref(schemas.FileEvent)}},
            "description": "one FileEvent per line, the first `ready`; blank lines keep a quiet watch alive",
        },
        **FILE_ERRORS,
    },
)
async def watch_files(
    request: Request,
    sid: SandboxId,
    path: str | None = PATH,
    path_b64: str | None = PATH_B64,
    recursive: bool = Query(False, description="also watch every directory below, new ones too"),
):
    """A directory's changes as NDJSON, from inotify inside the sandbox, each sent as it happens.
    404 file_not_found before the stream starts when the directory does not exist. The watch counts
    as the sandbox's activity while open and ends (inside the sandbox too) when the client leaves."""
    manager = ctx(request).manager
    target = http.check_path(path, path_b64, manager.get(sid).workdir)
    events, close = await http.open_held(manager, sid, lambda w: w.watch_files(sid, target, recursive))

    async def body() -> typing.AsyncIterator[bytes]:
        failure: BaseException | None = None
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = nxt or asyncio.ensure_future(anext(events))
                done, _ = await asyncio.wait({nxt}, timeout=WATCH_KEEPALIVE_S)
                if not done:
                    yield b"\n"
                    continue
                try:
                    ev = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                yield _event_line(ev)
        except Exception as e:  # noqa: BLE001 - the headers are sent: report it in-band
            failure = e
            yield http.broken_line(e, sid, "watch")
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
            await close(failure)

    return StreamingResponse(body(), media_type=http.NDJSON)


@router.put(
    "/v1/sandboxes/{sid}/files/tar",
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "a tar archive (plain, gzip, bzip2 or xz), up to ATOLL_MAX_FILE_MB MiB, streamed "
            "(any Content-Type, e.g. application/x-tar)",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    responses={
        200: {"model": schemas.TarWritten},
        **http.error_responses(
            {
                **FILE_ERROR_TEXTS,
                400: "invalid_request: not a tar, or a member with '..', an absolute path, a link leading "
                "outside the directory, or a device/fifo (the whole tar is refused, nothing written); "
                "invalid_path: a bad path",
                413: "payload_too_large: the body is over ATOLL_MAX_FILE_MB",
                507: "disk_full: the sandbox's disk_mb is used up",
            }
        ),
    },
)
async def write_tar(
    request: Request, sid: SandboxId, path: str | None = PATH, path_b64: str | None = PATH_B64
):
    """Unpack a tar into directory `path` (created). Every member is checked before anything is
    written; one that points outside `path` refuses the whole tar with 400."""
    c = ctx(request)
    target = http.check_path(path, path_b64, c.manager.get(sid).workdir)
    chunks, size = http.limited_body(request, c.max_file_bytes, "tar body")
    async with c.manager.activity(sid) as worker:
        written = await worker.write_tar(sid, target, chunks, size)
    return http.json_response(dataclasses.asdict(written))


@router.get(
    "/v1/sandboxes/{sid}/files/tar",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {TAR: {"schema": {"type": "string", "format": "binary"}}},
            "description": "the directory's contents (names relative to it, PAX), streamed",
        },
        **FILE_ERRORS,
    },
)
async def read_tar(
    request: Request, sid: SandboxId, path: str | None = PATH, path_b64: str | None = PATH_B64
):
    """A directory as a tar stream, built while it is sent (never whole in memory): files, dirs
    (empty ones too) and symlinks as themselves, names with their exact bytes."""
    manager = ctx(request).manager
    target = http.check_path(path, path_b64, manager.get(sid).workdir)
    download, close = await http.open_held(manager, sid, lambda w: w.read_tar(sid, target))

    return StreamingResponse(http.relayed(sid, download.chunks, close, "tar"), media_type=TAR)
