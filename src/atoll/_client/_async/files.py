"""`sandbox.files` and `AsyncWatch`: files and trees of a sandbox, and watches of them.

Part of the hand-written async SDK; `scripts/unasync_sdk.py` generates its sync twin in `_sync/`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from typing import IO, Any

from atoll import errors
from atoll.shared import ndjson

from .. import _base, _tar
from .._models import (
    FileEntry,
    FileEvent,
    FileStat,
)
from ._parents import ClientLike, SandboxLike


class AsyncFiles:
    """`sandbox.files`: read and write files inside the sandbox by absolute path.

    A path is a `str`, or `bytes` for names that are not UTF-8 (`FileEntry.raw_path` of a listing
    gives them; they are sent as `path_b64`).
    """

    def __init__(self, sandbox: SandboxLike) -> None:
        self._sandbox = sandbox

    @property
    def _client(self) -> ClientLike:
        return self._sandbox._client

    async def write(self, path: str | bytes, data: _base.AsyncUploadData) -> None:
        """Create or replace the file at `path`.

        `data` may be bytes, str (UTF-8), an open file or an iterable of chunks; files and
        iterables are streamed to the server in chunks rather than loaded whole.
        """
        await self._client._request(
            "PUT",
            self._sandbox._path("files"),
            params=_base.path_params(path),
            content=_base.arequest_body(data),
            headers=_base.upload_headers(data),
        )

    async def read(self, path: str | bytes) -> bytes:
        """The whole content of the file at `path`."""
        response = await self._client._request(
            "GET", self._sandbox._path("files"), params=_base.path_params(path)
        )
        return response.content

    async def stream(self, path: str | bytes, chunk_size: int = _base.CHUNK_SIZE) -> AsyncIterator[bytes]:
        """Iterate over the content of the file at `path` without holding it all in memory."""
        async with self._client._stream(
            "GET", self._sandbox._path("files"), params=_base.path_params(path)
        ) as response:
            async for chunk in response.aiter_bytes(chunk_size):  # noqa: UP028 - async has no `yield from`
                yield chunk

    async def read_to(self, path: str | bytes, fileobj: IO[bytes]) -> int:
        """Copy the file at `path` into an open binary file; returns the number of bytes."""
        total = 0
        async for chunk in self.stream(path):
            fileobj.write(chunk)
            total += len(chunk)
        return total

    async def list(self, path: str | bytes = "/") -> list[FileEntry]:
        """The entries of the directory at `path`."""
        response = await self._client._request(
            "GET", self._sandbox._path("files", "list"), params=_base.path_params(path)
        )
        return [FileEntry(item) for item in _base.items(response)]

    async def remove(self, path: str | bytes) -> None:
        await self._client._request("DELETE", self._sandbox._path("files"), params=_base.path_params(path))

    # ---- issue 9: stat, exists, mkdir, move, chmod, watch, directories as tar streams ------------
    async def stat(self, path: str | bytes) -> FileStat:
        """The path's type ("file", "dir", "symlink", "other"), size, mode, mtime and symlink target
        (lstat: a symlink is not followed). Raises `atoll.errors.FileNotFound` when it is missing."""
        response = await self._client._request(
            "GET", self._sandbox._path("files", "stat"), params=_base.path_params(path)
        )
        return FileStat(_base.json_body(response))

    async def exists(self, path: str | bytes) -> bool:
        """Whether anything (a file, directory or symlink, even a dangling one) is at `path`."""
        try:
            await self.stat(path)
        except errors.FileNotFound:
            return False
        return True

    async def mkdir(self, path: str | bytes) -> bool:
        """Create the directory and its parents (mkdir -p); False when it existed already."""
        response = await self._client._request(
            "POST", self._sandbox._path("files", "mkdir"), params=_base.path_params(path)
        )
        return bool(_base.json_body(response).get("created"))

    async def move(self, src: str, dst: str) -> FileStat:
        """Rename or move `src` to `dst` (parents of `dst` are created; a file replaces a file)."""
        response = await self._client._request(
            "POST", self._sandbox._path("files", "move"), json={"from": src, "to": dst}
        )
        return FileStat(_base.json_body(response))

    async def chmod(self, path: str, mode: int | str) -> FileStat:
        """Set the permission bits: an int such as 0o755, or octal text such as "755"."""
        response = await self._client._request(
            "POST", self._sandbox._path("files", "chmod"), json={"path": path, "mode": mode}
        )
        return FileStat(_base.json_body(response))

    async def watch(self, path: str | bytes, recursive: bool = True) -> AsyncWatch:
        """Watch a directory: returns once the watch is in place (so nothing written after is
        missed); iterate it for `FileEvent`s, and close it (or use it as a context manager)."""
        params = {**_base.path_params(path), "recursive": "true" if recursive else "false"}
        watch = AsyncWatch(self._client._stream("GET", self._sandbox._path("files", "watch"), params=params))
        await watch._open()
        return watch

    async def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str | bytes) -> dict[str, Any]:
        """Upload a local directory tree into `remote_dir` (created) as one tar stream: files, empty
        directories, symlinks and hard links. Returns the counts written: files, dirs, links, bytes."""
        if not os.path.isdir(local_dir):  # said before anything is sent
            raise NotADirectoryError(f"upload_dir: {os.fspath(local_dir)!r} is not a local directory")
        chunks = _tar.tar_chunks(local_dir)
        response = await self._client._request(
            "PUT",
            self._sandbox._path("files", "tar"),
            params=_base.path_params(remote_dir),
            content=_base.arequest_body(chunks),
            headers={"Content-Type": "application/x-tar"},
        )
        return _base.json_body(response)

    async def download_dir(self, remote_dir: str | bytes, local_dir: str | os.PathLike[str]) -> int:
        """Download the tree under `remote_dir` into `local_dir` (created), extracted safely
        (tarfile's "data" filter: nothing lands outside `local_dir`). Returns the member count."""
        with tempfile.TemporaryFile() as spool:
            async with self._client._stream(
                "GET", self._sandbox._path("files", "tar"), params=_base.path_params(remote_dir)
            ) as response:
                async for chunk in response.aiter_bytes(_base.CHUNK_SIZE):
                    spool.write(chunk)
            spool.seek(0)
            return _tar.extract(spool, local_dir)


class AsyncWatch:
    """An open `sandbox.files.watch(dir)`: iterate it for `FileEvent`s; `aclose()` ends it (the
    watch inside the sandbox ends too). A broken stream raises the mapped `AtollError`."""

    def __init__(self, stream: Any) -> None:
        self._cm = stream
        self._lines: Any = None
        self.closed = False

    async def _open(self) -> None:
        response = await self._cm.__aenter__()
        self._lines = ndjson.alines(response.aiter_bytes())
        try:
            first = await self._next_event()
        except BaseException:
            await self.aclose()
            raise
        if first.type != "ready":
            await self.aclose()
            raise errors.AtollError(f"the watch stream began with {first.data!r}, not its ready line")

    async def _next_event(self) -> FileEvent:
        obj = _base.json_line(await self._lines.__anext__())  # blank keep-alives are skipped
        if "error" in obj:
            raise _base.stream_error(obj)
        return FileEvent(obj)

    def __aiter__(self) -> AsyncWatch:
        return self

    async def __anext__(self) -> FileEvent:
        if self.closed:
            raise StopAsyncIteration
        try:
            event = await self._next_event()
        except StopAsyncIteration:
            await self.aclose()
            raise
        if event.type == "overflow":
            await self.aclose()
        return event

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self._cm.__aexit__(None, None, None)

    async def __aenter__(self) -> AsyncWatch:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
