"""The edge's file routes, in the API's shapes: GET/PUT/DELETE …/files, GET …/files/stat,
…/files/list, …/files/watch (NDJSON, the worker's keep-alives passed on), GET/PUT …/files/tar, POST
…/files/mkdir, …/files/move and …/files/chmod. Paths are checked and resolved from the sandbox's
workdir exactly as the API does (core.filepaths); uploads are capped by the server's
ATOLL_MAX_FILE_MB (the grant's defaults) and streamed both ways. Part of edge.service.Edge.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import typing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from atoll.core import errors, filepaths, inputs, wire
from atoll.core import worker_api as api
from atoll.edge import calls, upstream

log = logging.getLogger(__name__)

TAR = "application/x-tar"
MAX_PATH_CHARS = 4096


def _text_path(value: typing.Any, name: str) -> str:
    """A path given in a JSON body (move, chmod): text of 1 to MAX_PATH_CHARS characters."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_PATH_CHARS:
        raise errors.InvalidRequest(
            f"{name} must be a path: text of 1 to {MAX_PATH_CHARS} characters, got {str(value)[:60]!r}"
        )
    return value


def _path_param(
    name: str, path: str | None, workdir: str | None, path_b64: str | None = None
) -> dict[str, str]:
    """The worker's query parameter for a path checked and resolved as the API does
    (core.filepaths): `<name>`, or `<name>_b64` for a path that is not UTF-8."""
    target = filepaths.check_path(path, path_b64, workdir)
    if isinstance(target, bytes):
        return {f"{name}_b64": base64.b64encode(target).decode("ascii")}
    return {name: target}


def _mode(value: typing.Any) -> int:
    """Permission bits as the API takes them: an integer or octal text ("755", "0o644")."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise errors.InvalidRequest(
            f"mode must be an integer or octal text such as '755', not {type(value).__name__}"
        )
    if isinstance(value, str):
        t = value.strip().lower().removeprefix("0o")
        if not t or any(ch not in "01234567" for ch in t):
            raise errors.InvalidRequest(f"mode {value[:20]!r} is not octal text such as '755' or '0644'")
        value = int(t, 8)
    if not 0 <= value <= 0o7777:
        raise errors.InvalidRequest(
            f"mode {value} is outside 0..0o7777 (4095); give permission bits such as '755'"
        )
    return value


def _watch_line(obj: dict) -> dict:
    ev = wire.load(api.FileEvent, obj, "watch event")
    line: dict[str, typing.Any] = {"type": ev.type, "path": ev.path, "is_dir": ev.is_dir}
    if ev.from_path is not None:
        line["from"] = ev.from_path
    return line


class FileRoutes(calls.Base):
    """The file routes of the edge."""

    async def _file(self, request: Request) -> tuple[str, str, upstream.Grant, dict[str, str]]:
        """(auth, sid, grant, the worker's path parameters) of a files call: `path` or `path_b64`
        checked and resolved from the sandbox's workdir exactly as the API does (core.filepaths)."""
        auth, sid = calls.auth(request), calls.sid(request)
        q = request.query_params
        g = await self.grants.get(auth, sid)
        return auth, sid, g, _path_param("path", q.get("path"), g.defaults.get("workdir"), q.get("path_b64"))

    async def _download(self, request: Request, sub: str, media_type: str) -> Response:
        """A file or tar download relayed chunk by chunk (Content-Length when the worker knows it)."""
        auth, sid, _, params = await self._file(request)
        opening = self.call(auth, sid, "GET", sub, params=params)
        r = await opening.__aenter__()
        length = r.headers.get("content-length")

        async def body() -> typing.AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            except Exception as e:  # noqa: BLE001 - the headers are sent: the download is cut short
                log.warning("edge download broke: %s", getattr(e, "message", e), extra={"sandbox_id": sid})
            finally:
                await opening.__aexit__(None, None, None)

        headers = {"Content-Length": length} if length and length.isdigit() else {}
        return StreamingResponse(body(), media_type=media_type, headers=headers)

    async def _upload(self, request: Request, sub: str, what: str) -> typing.Any:
        """A file or tar upload streamed to the worker, capped by the server's ATOLL_MAX_FILE_MB;
        the worker's JSON answer (None for 204)."""
        auth, sid, g, params = await self._file(request)
        limit = int(g.defaults.get("max_file_bytes") or 0) or None
        declared = request.headers.get("content-length")
        if limit and declared and declared.isdigit() and int(declared) > limit:
            raise errors.PayloadTooLarge(
                f"{what} is {declared} bytes; the limit is {limit} (ATOLL_MAX_FILE_MB)"
            )

        async def chunks() -> typing.AsyncIterator[bytes]:
            n = 0
            async for chunk in request.stream():
                n += len(chunk)
                if limit and n > limit:
                    raise errors.PayloadTooLarge(f"{what} exceeds {limit} bytes (ATOLL_MAX_FILE_MB)")
                if chunk:
                    yield chunk

        headers = {"Content-Type": "application/octet-stream"}
        if declared and declared.isdigit():
            headers["Content-Length"] = declared
        return await self.call_json(
            auth,
            sid,
            "PUT",
            sub,
            params=params,
            content=chunks(),
            headers=headers,
            timeout=None,
            replayable=False,
        )

    async def read_file(self, request: Request) -> Response:
        return await self._download(request, "files", "application/octet-stream")

    async def write_file(self, request: Request) -> Response:
        await self._upload(request, "files", "file body")
        return Response(status_code=204)

    async def read_tar(self, request: Request) -> Response:
        return await self._download(request, "files/tar", TAR)

    async def write_tar(self, request: Request) -> Response:
        answer = await self._upload(request, "files/tar", "tar body")
        return JSONResponse(dataclasses.asdict(wire.load(api.TarWritten, answer, "tar answer")))

    async def make_dir(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        answer = await self.call_json(auth, sid, "POST", "files/mkdir", params=params)
        shown = params.get("path") or base64.b64decode(params["path_b64"]).decode("utf-8", "replace")
        return JSONResponse({"path": shown, "created": bool(answer["created"])})

    async def move_file(self, request: Request) -> Response:
        auth, sid = calls.auth(request), calls.sid(request)
        req = await calls.json_body(request)
        if set(req) != {"from", "to"}:
            raise errors.InvalidRequest('the move request is {"from": PATH, "to": PATH} (both, nothing else)')
        g = await self.grants.get(auth, sid)
        params: dict[str, str] = {}
        for name in ("from", "to"):
            params.update(_path_param(name, _text_path(req[name], name), g.defaults.get("workdir")))
        stat = await self.call_json(auth, sid, "POST", "files/move", params=params)
        return JSONResponse(dataclasses.asdict(wire.load(api.FileStat, stat, "stat answer")))

    async def chmod_file(self, request: Request) -> Response:
        auth, sid = calls.auth(request), calls.sid(request)
        req = await calls.json_body(request)
        if set(req) != {"path", "mode"}:
            raise errors.InvalidRequest(
                'the chmod request is {"path": PATH, "mode": "755"} (both, nothing else)'
            )
        mode = _mode(req["mode"])
        g = await self.grants.get(auth, sid)
        params = _path_param("path", _text_path(req["path"], "path"), g.defaults.get("workdir"))
        params["mode"] = str(mode)
        stat = await self.call_json(auth, sid, "POST", "files/chmod", params=params)
        return JSONResponse(dataclasses.asdict(wire.load(api.FileStat, stat, "stat answer")))

    async def watch_files(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        params["recursive"] = "1" if inputs.flag(request.query_params.get("recursive"), "recursive") else "0"
        return await self.lines(auth, sid, "GET", "files/watch", _watch_line, params=params)

    async def delete_file(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        await self.call_json(auth, sid, "DELETE", "files", params=params)
        return Response(status_code=204)

    async def stat_file(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        return JSONResponse(await self.call_json(auth, sid, "GET", "files/stat", params=params))

    async def list_files(self, request: Request) -> Response:
        auth, sid, _, params = await self._file(request)
        return JSONResponse({"items": await self.call_json(auth, sid, "GET", "files/list", params=params)})
