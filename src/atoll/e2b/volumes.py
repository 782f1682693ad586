"""E2B volumes on the E2B port, mapped onto atoll's drives (docs/e2b-compat.md §6.2, §6.5).

- **Control** (`X-API-KEY`, forwarded with the caller's key like every control call of e2b.app):
  `POST /volumes {name}` makes a drive of the key's tenant of `ATOLL_E2B_VOLUME_MB` (1024) MiB;
  `GET /volumes` lists the tenant's drives; `GET /volumes/{id}` and `DELETE /volumes/{id}`. The
  `volumeID` is the drive's name; the `token` is the drive token the API answers
  (`POST /v1/drives/{name}/token`, core.grants.drive_token), which opens that drive's file routes
  and nothing else.
- **Content** (`/volumecontent/{id}/path|dir|file`, `Authorization: Bearer <volume token>`; the
  SDK's `E2B_VOLUME_API_URL` points here): each call is forwarded to the drive's file routes with
  `Authorization: E2B-Volume <token>` — the API checks the token against the drive, so this module
  holds no key and decides nothing. File bodies are streamed both ways.

Entries are E2B's `VolumeEntryStat` {name, type file|directory|symlink|unknown, path, size, mode
(permission bits), uid, gid, atime, mtime, ctime (ISO 8601, UTC), target?}. Errors are E2B's
`{code, message}` (e2b.app). Mounted by e2b.app.create_app.
"""

from __future__ import annotations

import datetime as dt
import typing
import urllib.parse

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from atoll.core import grants
from atoll.e2b import control, forward
from atoll.shared import http11

MAX_LIST_PAGES = 100
"""`GET /volumes` follows atoll's cursors this many pages at most (E2B's list is not paged)."""
FILE_TIMEOUT_S = 3600
"""A file transfer's bound (the SDK's own is an hour too)."""
TYPES = {"file": "file", "dir": "directory", "symlink": "symlink"}


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


def entry(e: dict) -> dict:
    """atoll's store entry (schemas.StoreEntry) as E2B's VolumeEntryStat."""
    out = {
        "name": e["name"],
        "type": TYPES.get(e["type"], "unknown"),
        "path": e["path"],
        "size": e["size"],
        "mode": e["mode"],
        "uid": e["uid"],
        "gid": e["gid"],
        "atime": _iso(e["atime"]),
        "mtime": _iso(e["mtime"]),
        "ctime": _iso(e["ctime"]),
    }
    if e.get("target") is not None:
        out["target"] = e["target"]
    return out


def _vid(request: Request) -> str:
    return urllib.parse.quote(request.path_params["vid"], safe="")


def _token(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise control.E2BError(
            401,
            "missing volume token: send 'Authorization: Bearer <token>' (Volume.create/connect "
            "give it; the SDK sends it)",
        )
    return f"{grants.E2B_VOLUME_SCHEME} {token.strip()}"


def _path(request: Request) -> str:
    path = request.query_params.get("path")
    if path is None or path == "":
        raise control.E2BError(400, "path is required: the path in the volume, e.g. /data/a.txt")
    return path if path.startswith("/") else "/" + path


def _int(request: Request, name: str, top: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or int(raw) > top:
        raise control.E2BError(400, f"{name} must be a whole number from 0 to {top}, not {raw[:20]!r}")
    return int(raw)


def _attrs(request: Request) -> dict:
    got = {
        "mode": _int(request, "mode", 0o7777),
        "uid": _int(request, "uid", 0xFFFFFFFE),
        "gid": _int(request, "gid", 0xFFFFFFFE),
    }
    return {k: v for k, v in got.items() if v is not None}


class Volumes:
    """The volume routes over the E2B app's channel to the API (its e2b.forward.Forwarder)."""

    def __init__(self, c: forward.Forwarder, volume_mb: int):
        self.c = c
        self.volume_mb = volume_mb

    async def _token_of(self, key: str, name: str) -> str:
        r = await self.c.call(key, "POST", f"/v1/drives/{urllib.parse.quote(name, safe='')}/token")
        return r.json()["token"]

    # ---- control ------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        key = forward.api_key(request)
        body = await forward.read_body(request, optional=False)
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise control.E2BError(400, f"name must be a non-empty string (the volume's name), not {name!r}")
        r = await self.c.call(key, "POST", "/v1/drives", json_body={"name": name, "size_mb": self.volume_mb})
        name = r.json()["name"]
        return JSONResponse(
            {"volumeID": name, "name": name, "token": await self._token_of(key, name)}, status_code=201
        )

    async def list(self, request: Request) -> Response:
        key = forward.api_key(request)
        out: list[dict] = []
        cursor = None
        for _ in range(MAX_LIST_PAGES):
            params = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
            page = (await self.c.call(key, "GET", "/v1/drives", params=params)).json()
            out += [{"volumeID": d["name"], "name": d["name"]} for d in page.get("items") or []]
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return JSONResponse(out)

    async def get(self, request: Request) -> Response:
        key = forward.api_key(request)
        r = await self.c.call(key, "GET", f"/v1/drives/{_vid(request)}")
        name = r.json()["name"]
        return JSONResponse({"volumeID": name, "name": name, "token": await self._token_of(key, name)})

    async def destroy(self, request: Request) -> Response:
        key = forward.api_key(request)
        await self.c.call(key, "DELETE", f"/v1/drives/{_vid(request)}")
        return Response(status_code=204)

    # ---- content ------------------------------------------------------------------------------------
    async def _content(
        self, request: Request, method: str, route: str, *, params: dict, json_body: typing.Any = None
    ) -> typing.Any:
        auth = _token(request)
        r = await self.c.call(
            "",
            method,
            f"/v1/drives/{_vid(request)}/files{route}",
            params=params,
            json_body=json_body,
            headers={"Authorization": auth},
        )
        return r.json() if r.content else None

    async def stat(self, request: Request) -> Response:
        e = await self._content(request, "GET", "/stat", params={"path": _path(request)})
        return JSONResponse(entry(e))

    async def list_dir(self, request: Request) -> Response:
        depth = _int(request, "depth", 16)
        params = {"path": _path(request), **({"depth": str(depth)} if depth else {})}
        page = await self._content(request, "GET", "/list", params=params)
        return JSONResponse([entry(e) for e in page["items"]])

    async def make_dir(self, request: Request) -> Response:
        force = request.query_params.get("force", "").lower() in ("true", "1")
        body = {"parents": force, **_attrs(request)}
        e = await self._content(request, "POST", "/mkdir", params={"path": _path(request)}, json_body=body)
        return JSONResponse(entry(e), status_code=201)

    async def set_attrs(self, request: Request) -> Response:
        body = await forward.read_body(request)
        for k in body:
            if k not in ("uid", "gid", "mode"):
                raise control.E2BError(400, f"unknown field {k[:40]!r}: send uid, gid and/or mode")
        e = await self._content(request, "PATCH", "", params={"path": _path(request)}, json_body=body)
        return JSONResponse(entry(e))

    async def remove(self, request: Request) -> Response:
        await self._content(request, "DELETE", "", params={"path": _path(request)})
        return Response(status_code=204)

    async def read_file(self, request: Request) -> Response:
        auth, path = _token(request), _path(request)
        opening = self.c.api.stream(
            "GET",
            f"/v1/drives/{_vid(request)}/files",
            params={"path": path},
            headers={"Authorization": auth},
            timeout=60,
        )
        try:
            resp = await opening.__aenter__()
        except http11.ChannelError as e:
            raise control.E2BError(
                503, f"atoll's API did not answer ({str(e)[:200]}); retry shortly"
            ) from None
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            finally:
                await opening.__aexit__(None, None, None)
            raise self.c.failed(forward.Answer(resp.status_code, resp.headers, content), "GET")

        async def chunks() -> typing.AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await opening.__aexit__(None, None, None)

        headers = (
            {"Content-Length": resp.headers["content-length"]} if "content-length" in resp.headers else {}
        )
        return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)

    async def write_file(self, request: Request) -> Response:
        auth, path, attrs = _token(request), _path(request), _attrs(request)
        files = f"/v1/drives/{_vid(request)}/files"
        try:
            r = await self.c.api.request(
                "PUT",
                files,
                params={"path": path},
                content=request.stream(),
                headers={"Authorization": auth, "Content-Type": "application/octet-stream"},
                timeout=FILE_TIMEOUT_S,
            )
        except http11.ChannelError as e:
            raise control.E2BError(
                503,
                f"atoll's API did not answer ({str(e)[:200]}); the file may have been written: look before "
                "writing it again",
                {"Should-Retry": "false"},
            ) from None
        if r.status_code != 200:
            raise self.c.failed(forward.Answer(r.status_code, r.headers, r.content), "PUT")
        if attrs:  # the owner and mode asked for, set right after the (atomic) write
            e = await self._content(request, "PATCH", "", params={"path": path}, json_body=attrs)
        else:
            e = await self._content(request, "GET", "/stat", params={"path": path})
        return JSONResponse(entry(e), status_code=201)

    def routes(self) -> list[Route]:
        vc = "/volumecontent/{vid}"
        return [
            Route("/volumes", self.create, methods=["POST"]),
            Route("/volumes", self.list, methods=["GET"]),
            Route("/volumes/{vid}", self.get, methods=["GET"]),
            Route("/volumes/{vid}", self.destroy, methods=["DELETE"]),
            Route(vc + "/path", self.stat, methods=["GET"]),
            Route(vc + "/path", self.set_attrs, methods=["PATCH"]),
            Route(vc + "/path", self.remove, methods=["DELETE"]),
            Route(vc + "/dir", self.list_dir, methods=["GET"]),
            Route(vc + "/dir", self.make_dir, methods=["POST"]),
            Route(vc + "/file", self.read_file, methods=["GET"]),
            Route(vc + "/file", self.write_file, methods=["PUT"]),
        ]
