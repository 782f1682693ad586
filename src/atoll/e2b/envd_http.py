"""envd's plain-HTTP file routes (the `e2b` SDKs' `files.read` / `files.write` / `write_files`)
over atoll's seam for one sandbox, answered as envd answers (docs/e2b-compat.md §4.4):

- `GET /files?path=P[&username=U]`: the file's bytes, streamed from `read_file` as they come
  (never held whole); `Accept-Encoding: gzip` is answered in identity, which the SDKs accept;
- `POST /files?path=P[&username=U]` with a multipart body: each part named `file` is one file,
  written to `path` (one file) or to the part's filename (several), parsed as it arrives
  (python-multipart's push parser) and streamed into `write_file`;
- `POST /files?path=P` with `application/octet-stream` (envd ≥ 0.5.7), `Content-Encoding: gzip`
  unpacked on the fly;
- the answer to a write is the non-empty JSON array of `{"name", "type": "file", "path"}` the SDKs
  check; errors are `{"code": <HTTP status>, "message"}` (404 → `FileNotFoundException`, 400, 507
  → `NotEnoughSpaceException`);
- a relative path resolves against the user's home (`username`'s, else the sandbox user's).

Known gap: files are written as atoll's guest agent writes them (root); `username` only picks the
home a relative path resolves against. `X-Metadata-*` headers (envd ≥ 0.6.2) are not served.

Built by the E2B edge with the worker and sandbox a call was routed to, like
`envd_files.FilesystemService`; the edge mounts `routes()` (or calls `handle`) for `/files`.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import re
import typing
import zlib

from python_multipart import MultipartParser
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import parse_options_header
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from atoll.core import errors
from atoll.core import worker_api as api

PIPE_CHUNKS = 8
"""Chunks of one upload buffered between the request body and the sandbox's write."""
MAX_PART_HEADER_BYTES = 16 * 1024
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,31}$")


def _error(status: int, message: str) -> JSONResponse:
    """envd's error body: an integer code (the HTTP status) and a message."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _atoll_error(e: errors.AtollError) -> JSONResponse:
    if getattr(e, "paused", False):  # edge.seam.SandboxPaused: envd's answer for a paused sandbox
        return _error(502, e.message)
    return _error(e.status if 400 <= e.status < 600 else 500, f"{e.code}: {e.message}")


class _BadUpload(Exception):
    """A malformed upload: answered 400 with this text."""


class _Pipe:
    """Chunks from the request body into one `write_file` call, with backpressure: a put waits
    while the write is behind, and fails at once if the write failed."""

    def __init__(self, worker: api.WorkerAPI, sid: str, path: str):
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(PIPE_CHUNKS)
        self.task = asyncio.ensure_future(worker.write_file(sid, path, self._chunks(), None))

    async def _chunks(self) -> typing.AsyncIterator[bytes]:
        while (chunk := await self.queue.get()) is not None:
            yield chunk

    async def put(self, chunk: bytes | None) -> None:
        put = asyncio.ensure_future(self.queue.put(chunk))
        done, _ = await asyncio.wait({put, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if put not in done:
            put.cancel()
            await self.task  # raises the write's error
            raise _BadUpload("the file was written before its upload ended")

    async def finish(self) -> None:
        await self.put(None)
        await self.task

    async def abort(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


class FilesHTTP:
    """The `/files` routes for one sandbox."""

    def __init__(self, worker: api.WorkerAPI, sandbox_id: str, *, home: str = "/root"):
        self.worker, self.sid, self.home = worker, sandbox_id, home

    def routes(self) -> list[Route]:
        return [Route("/files", self.handle, methods=["GET", "POST"])]

    async def handle(self, request: Request) -> Response:
        if request.method == "GET":
            return await self.download(request)
        if request.method == "POST":
            return await self.upload(request)
        return _error(405, f"{request.method} /files is not served; use GET or POST")

    def _path(self, raw: str, username: str | None) -> str:
        if not raw:
            raise _BadUpload("path is empty; give the file's path (absolute, or relative to the home)")
        if "\x00" in raw:
            raise _BadUpload(f"path {raw!r} contains a NUL byte")
        if username and not _USER.match(username):
            raise _BadUpload(f"username {username!r} is not a user name (letters, digits, ._-)")
        home = self.home if not username else ("/root" if username == "root" else f"/home/{username}")
        return posixpath.normpath(raw if raw.startswith("/") else posixpath.join(home, raw))

    async def download(self, request: Request) -> Response:
        try:
            path = self._path(request.query_params.get("path", ""), request.query_params.get("username"))
        except _BadUpload as e:
            return _error(400, str(e))
        stack = contextlib.AsyncExitStack()
        try:
            download = await stack.enter_async_context(self.worker.read_file(self.sid, path))
        except errors.FileNotFound:
            await stack.aclose()
            return _error(404, f"path {path!r} does not exist")
        except errors.AtollError as e:
            await stack.aclose()
            return _atoll_error(e)

        async def body() -> typing.AsyncIterator[bytes]:
            async with stack:
                async for chunk in download.chunks:
                    yield chunk

        headers = {"Content-Length": str(download.size)} if download.size is not None else {}
        return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)

    async def upload(self, request: Request) -> Response:
        username = request.query_params.get("username")
        query_path = request.query_params.get("path")
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", "gzip", ""):
            return _error(400, f"Content-Encoding {encoding!r} is not supported; send identity or gzip")
        ctype, options = parse_options_header(request.headers.get("content-type", ""))
        body = _unzipped(request.stream()) if encoding == "gzip" else request.stream()
        try:
            if ctype == b"multipart/form-data":
                boundary = options.get(b"boundary")
                if not boundary:
                    raise _BadUpload("a multipart/form-data body needs a boundary in its Content-Type")
                written = await self._multipart(body, boundary, query_path, username)
            else:
                path = self._path(query_path or "", username)
                pipe = _Pipe(self.worker, self.sid, path)
                try:
                    async for chunk in body:
                        if chunk:
                            await pipe.put(chunk)
                    await pipe.finish()
                except BaseException:
                    await pipe.abort()
                    raise
                written = [path]
        except _BadUpload as e:
            return _error(400, str(e))
        except errors.AtollError as e:
            return _atoll_error(e)
        return JSONResponse([{"name": posixpath.basename(p), "type": "file", "path": p} for p in written])

    async def _multipart(
        self, body: typing.AsyncIterator[bytes], boundary: bytes, query_path: str | None, username: str | None
    ) -> list[str]:
        # python-multipart's parser calls back synchronously; the callbacks record what they saw
        # and each chunk's records are then played against the sandbox, in order
        seen: list[tuple[str, bytes]] = []
        header: dict[str, bytes] = {}
        field = bytearray()
        value = bytearray()

        def part_begin() -> None:
            header.clear()

        def header_end() -> None:
            header[field.decode("latin-1").lower()] = bytes(value)
            field.clear()
            value.clear()

        def headers_finished() -> None:
            seen.append(("headers", header.get("content-disposition", b"")))

        def part_data(data: bytes, start: int, end: int) -> None:
            seen.append(("data", bytes(data[start:end])))

        def part_end() -> None:
            seen.append(("end", b""))

        callbacks = {
            "on_part_begin": part_begin,
            "on_header_field": lambda d, s, e: field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: value.extend(d[s:e]),
            "on_header_end": header_end,
            "on_headers_finished": headers_finished,
            "on_part_data": part_data,
            "on_part_end": part_end,
        }
        parser = MultipartParser(
            boundary,
            typing.cast(typing.Any, callbacks),
            max_header_size=MAX_PART_HEADER_BYTES,
        )
        written: list[str] = []
        pipe: _Pipe | None = None
        path = ""
        try:
            async for chunk in body:
                try:
                    parser.write(chunk)
                except MultipartParseError as e:
                    raise _BadUpload(f"the multipart body is malformed: {e}") from None
                for kind, data in seen:
                    if kind == "headers":
                        _, opts = parse_options_header(data)
                        if opts.get(b"name") != b"file":
                            continue  # envd reads only the parts named "file"
                        filename = opts.get(b"filename", b"").decode("utf-8", "replace")
                        path = self._path(query_path or filename, username)
                        pipe = _Pipe(self.worker, self.sid, path)
                    elif kind == "data" and pipe is not None and data:
                        await pipe.put(data)
                    elif kind == "end" and pipe is not None:
                        await pipe.finish()
                        pipe = None
                        written.append(path)
                seen.clear()
            try:
                parser.finalize()
            except MultipartParseError as e:
                raise _BadUpload(f"the multipart body is malformed: {e}") from None
            if pipe is not None:
                raise _BadUpload("the multipart body ended inside a part")
        except BaseException:
            if pipe is not None:
                await pipe.abort()
            raise
        if not written:
            raise _BadUpload('the multipart body has no part named "file"; send the file as field "file"')
        return written


async def _unzipped(chunks: typing.AsyncIterator[bytes]) -> typing.AsyncIterator[bytes]:
    z = zlib.decompressobj(wbits=31)
    try:
        async for chunk in chunks:
            out = z.decompress(chunk)
            if out:
                yield out
        tail = z.flush()
        if not z.eof:
            raise _BadUpload("the gzip body is truncated")
    except zlib.error as e:
        raise _BadUpload(f"the body is not valid gzip: {e}") from None
    if tail:
        yield tail
