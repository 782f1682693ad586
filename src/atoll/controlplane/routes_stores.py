"""Public routes of volumes and drives: create, list, get, delete, clone, tar, and files.

`/v1/volumes` and `/v1/drives` are the same routes for the two kinds (controlplane.stores keeps the
records and who holds what; the bytes live on a worker, worker.host.stores). File paths are
`?path=` absolute from the store's root (no `..`; a symlink on the way is refused by the worker).
Part of the app built by controlplane.app.
"""

from __future__ import annotations

import dataclasses
import typing

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from atoll.controlplane import http, paging, schemas
from atoll.controlplane import stores as stores_mod
from atoll.controlplane.context import ctx
from atoll.core import errors, grants, worker_api

router = APIRouter()

PATH = Query(None, description="Absolute path from the store's root, e.g. /build/out.tar (no '..')")
PATH_B64 = Query(None, description="The path's exact bytes in base64 (for names that are not UTF-8)")


DEPTH = Query(
    None, description="How many levels down to list: 1 (the default, the directory's own entries) to 16"
)


def _depth(depth: str | None) -> int:
    if depth is None or depth == "":
        return 1
    if not depth.isdigit() or not 1 <= int(depth) <= worker_api.MAX_LIST_DEPTH:
        raise errors.InvalidRequest(
            f"depth must be a whole number from 1 to {worker_api.MAX_LIST_DEPTH}, not {depth[:20]!r}"
        )
    return int(depth)


def _path(path: str | None, path_b64: str | None, *, root_ok: bool = False) -> str | bytes:
    if root_ok and path is None and path_b64 is None:
        return "/"
    if path is not None and path != "" and not path.startswith("/"):
        raise errors.InvalidPath(f"path {path!r} must be absolute from the store's root, such as /{path}")
    return http.check_path(path, path_b64, "/")


async def _download(opening: typing.AsyncContextManager, media_type: str) -> StreamingResponse:
    download = await opening.__aenter__()

    async def chunks() -> typing.AsyncIterator[bytes]:
        try:
            async for chunk in download.chunks:
                yield chunk
        finally:
            await opening.__aexit__(None, None, None)

    headers = {"Content-Length": str(download.size)} if download.size is not None else {}
    return StreamingResponse(chunks(), media_type=media_type, headers=headers)


def _routes(kind: str) -> None:
    plural = f"/v1/{kind}s"
    model = schemas.Volume if kind == "volume" else schemas.Drive
    listing = schemas.VolumeList if kind == "volume" else schemas.DriveList
    tags = [f"{kind}s"]
    in_use = f"{kind}_in_use"
    errs = http.error_responses(
        {
            400: "invalid_request or invalid_path (a bad name, size_mb or path; the message names it)",
            404: f"{kind}_not_found, or file_not_found",
            409: f"{kind}_exists, {in_use} (the message names the holder), or invalid_state",
            413: "payload_too_large",
            503: "worker_unavailable: the worker keeping it cannot be reached now",
            507: "store_full: its size_mb is used up",
        }
    )

    @router.post(
        plural,
        status_code=201,
        tags=tags,
        openapi_extra=http.body_schema(schemas.CreateStore),
        responses={
            201: {"model": model},
            **errs,
        },
        name=f"create_{kind}",
    )
    async def create(request: Request):
        body = await http.read_json(request, schemas.CreateStore)
        return http.json_response(
            await ctx(request).manager.stores.create(kind, body.name, body.size_mb), 201
        )

    @router.get(
        plural,
        tags=tags,
        openapi_extra=paging.OPENAPI,
        responses={200: {"model": listing}, **errs},
        name=f"list_{kind}s",
    )
    async def list_(request: Request):
        svc = ctx(request).manager.stores
        recs, nxt = paging.of_list(
            paging.page(request, plural), svc.records(kind), lambda r: (r.name, r.tenant_id)
        )
        return http.json_response(paging.answer([await svc.view(r) for r in recs], nxt))

    @router.get(plural + "/{name}", tags=tags, responses={200: {"model": model}, **errs}, name=f"get_{kind}")
    async def get(request: Request, name: str):
        svc = ctx(request).manager.stores
        return http.json_response(await svc.view(svc.record(kind, name)))

    @router.delete(
        plural + "/{name}",
        status_code=204,
        response_class=Response,
        tags=tags,
        responses={204: {"description": "deleted with its data"}, **errs},
        name=f"delete_{kind}",
    )
    async def delete(request: Request, name: str):
        await ctx(request).manager.stores.delete(kind, name)
        return Response(status_code=204)

    @router.post(
        plural + "/{name}/clone",
        status_code=201,
        tags=tags,
        openapi_extra=http.body_schema(schemas.CloneStore),
        responses={
            201: {"model": model},
            **errs,
        },
        name=f"clone_{kind}",
    )
    async def clone(request: Request, name: str):
        """A point-in-time copy (allowed while attached: what its sandbox has written back)."""
        body = await http.read_json(request, schemas.CloneStore)
        return http.json_response(await ctx(request).manager.stores.clone(kind, name, body.name), 201)

    @router.get(
        plural + "/{name}/tar",
        tags=tags,
        response_class=StreamingResponse,
        responses={
            200: {"content": {"application/x-tar": {}}, "description": "the whole tree, members relative"},
            **errs,
        },
        name=f"export_{kind}",
    )
    async def export(request: Request, name: str):
        svc = ctx(request).manager.stores
        rec = svc.record(kind, name)
        return await _download(
            svc.worker(rec).read_store_tar(kind, stores_mod.wname(rec)), "application/x-tar"
        )

    @router.put(
        plural + "/{name}/tar",
        tags=tags,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
        responses={
            200: {"model": schemas.TarWritten},
            **errs,
        },
        name=f"import_{kind}",
    )
    async def import_(request: Request, name: str):
        """Unpack a tar into the store's root (a volume: only while no sandbox has it)."""
        c = ctx(request)
        svc = c.manager.stores
        async with svc.importing(kind, name) as rec:  # a volume: 409 volume_in_use while a sandbox has it
            limit = max(c.max_file_bytes, rec.size_mb * 1024 * 1024 * 2)
            chunks, size = http.limited_body(request, limit, "tar body")
            written = await svc.worker(rec).write_store_tar(kind, stores_mod.wname(rec), chunks, size)
        return http.json_response(dataclasses.asdict(written))

    if kind != "drive":
        return

    @router.put(
        plural + "/{name}/files",
        tags=tags,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
        responses={200: {"model": schemas.FileStat}, **errs},
        name=f"write_{kind}_file",
    )
    async def write_file(
        request: Request, name: str, path: str | None = PATH, path_b64: str | None = PATH_B64
    ):
        """Write a file (parents made) atomically: every sandbox sees the whole new file at once."""
        c = ctx(request)
        target = _path(path, path_b64)
        svc = c.manager.stores
        rec = svc.record(kind, name)
        chunks, size = http.limited_body(request, c.max_file_bytes, "file body")
        st = await svc.worker(rec).write_store_file(kind, stores_mod.wname(rec), target, chunks, size)
        return http.json_response(dataclasses.asdict(st))

    @router.get(
        plural + "/{name}/files",
        tags=tags,
        response_class=StreamingResponse,
        responses={200: {"content": {"application/octet-stream": {}}}, **errs},
        name=f"read_{kind}_file",
    )
    async def read_file(
        request: Request, name: str, path: str | None = PATH, path_b64: str | None = PATH_B64
    ):
        svc = ctx(request).manager.stores
        rec = svc.record(kind, name)
        target = _path(path, path_b64)
        return await _download(
            svc.worker(rec).read_store_file(kind, stores_mod.wname(rec), target), "application/octet-stream"
        )

    @router.get(
        plural + "/{name}/files/list",
        tags=tags,
        responses={200: {"model": schemas.StoreEntryList}, **errs},
        name=f"list_{kind}_files",
    )
    async def list_files(
        request: Request,
        name: str,
        path: str | None = PATH,
        path_b64: str | None = PATH_B64,
        depth: str | None = DEPTH,
    ):
        svc = ctx(request).manager.stores
        target = _path(path, path_b64, root_ok=True)
        levels = _depth(depth)
        rec = svc.record(kind, name)
        entries = await svc.worker(rec).list_store_files(kind, stores_mod.wname(rec), target, levels)
        return http.json_response({"items": [dataclasses.asdict(e) for e in entries]})

    @router.post(
        plural + "/{name}/token",
        tags=tags,
        responses={200: {"model": schemas.DriveToken}, **errs},
        name=f"{kind}_token",
    )
    async def token(request: Request, name: str):
        """A token that opens this drive's file routes only (E2B's volume token), sent as
        `Authorization: E2B-Volume <token>`: good while the drive exists, not revoked with a key."""
        rec = ctx(request).manager.stores.record(kind, name)
        tok = grants.drive_token(
            request.app.state.e2b_key, rec.tenant_id, rec.name, stores_mod.created_unix(rec)
        )
        return http.json_response({"name": rec.name, "token": tok, "scheme": grants.E2B_VOLUME_SCHEME})

    @router.get(
        plural + "/{name}/files/stat",
        tags=tags,
        responses={200: {"model": schemas.StoreEntry}, **errs},
        name=f"stat_{kind}_file",
    )
    async def stat_file(
        request: Request, name: str, path: str | None = PATH, path_b64: str | None = PATH_B64
    ):
        """One path's type, size, mode, owner and times (a symlink as itself, with its target)."""
        svc = ctx(request).manager.stores
        target = _path(path, path_b64, root_ok=True)
        rec = svc.record(kind, name)
        st = await svc.worker(rec).stat_store_file(kind, stores_mod.wname(rec), target)
        return http.json_response(dataclasses.asdict(st))

    @router.post(
        plural + "/{name}/files/mkdir",
        status_code=201,
        tags=tags,
        openapi_extra=http.body_schema(schemas.StoreMakeDir, required=False),
        responses={201: {"model": schemas.StoreEntry}, **errs},
        name=f"make_{kind}_dir",
    )
    async def make_dir(request: Request, name: str, path: str | None = PATH, path_b64: str | None = PATH_B64):
        """Make a directory (an existing one is kept), with the given mode and owner."""
        target = _path(path, path_b64)
        body = await http.read_json(request, schemas.StoreMakeDir, optional=True)
        svc = ctx(request).manager.stores
        rec = svc.record(kind, name)
        st = await svc.worker(rec).make_store_dir(
            kind, stores_mod.wname(rec), target, body.parents, body.mode, body.uid, body.gid
        )
        return http.json_response(dataclasses.asdict(st), 201)

    @router.patch(
        plural + "/{name}/files",
        tags=tags,
        openapi_extra=http.body_schema(schemas.StoreFileAttrs),
        responses={200: {"model": schemas.StoreEntry}, **errs},
        name=f"set_{kind}_file_attrs",
    )
    async def set_attrs(
        request: Request, name: str, path: str | None = PATH, path_b64: str | None = PATH_B64
    ):
        """Set a path's mode and owner (chmod/chown of the entry itself, never a link's target)."""
        target = _path(path, path_b64)
        body = await http.read_json(request, schemas.StoreFileAttrs)
        svc = ctx(request).manager.stores
        rec = svc.record(kind, name)
        st = await svc.worker(rec).set_store_file_attrs(
            kind, stores_mod.wname(rec), target, body.mode, body.uid, body.gid
        )
        return http.json_response(dataclasses.asdict(st))

    @router.delete(
        plural + "/{name}/files",
        status_code=204,
        response_class=Response,
        tags=tags,
        responses={204: {"description": "removed (a directory with what is in it)"}, **errs},
        name=f"delete_{kind}_file",
    )
    async def delete_file(
        request: Request, name: str, path: str | None = PATH, path_b64: str | None = PATH_B64
    ):
        svc = ctx(request).manager.stores
        rec = svc.record(kind, name)
        await svc.worker(rec).delete_store_file(kind, stores_mod.wname(rec), _path(path, path_b64))
        return Response(status_code=204)


_routes("volume")
_routes("drive")
