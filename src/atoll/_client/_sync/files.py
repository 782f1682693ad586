"""GENERATED FILE - do not edit. `sandbox.files` and `Watch`: files and trees of a sandbox, and watches of them.

Generated from `_async/files.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
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


class Files:
    """`sandbox.files`: read and write files inside the sandbox by absolute path.

    A path is a `str`, or `bytes` for names that are not UTF-8 (`FileEntry.raw_path` of a listing
    gives them; they are sent as `path_b64`).
    """

    def __init__(self, sandbox: SandboxLike) -> None:
        self._sandbox = sandbox

    @property
    def _client(self) -> ClientLike:
        return self._sandbox._client

    def write(self, path: str | bytes, data: _base.UploadData) -> None:
        """Create or replace the file at `path`.

        `data` may be bytes, str (UTF-8), an open file or an iterable of chunks; files and
        iterables are streamed to the server in chunks rather than loaded whole.
        """
        self._client._request(
            "PUT",
            self._sandbox._path("files"),
            params=_base.path_params(path),
            content=_base.request_body(data),
            headers=_base.upload_headers(data),
        )

    def read(self, path: str | bytes) -> bytes:
        """The whole content of the file at `path`."""
        response = self._client._request("GET", self._sandbox._path("files"), params=_base.path_params(path))
        return response.content

    def stream(self, path: str | bytes, chunk_size: int = _base.CHUNK_SIZE) -> Iterator[bytes]:
        """Iterate over the content of the file at `path` without holding it all in memory."""
        with self._client._stream(
            "GET", self._sandbox._path("files"), params=_base.path_params(path)
        ) as response:
            for chunk in response.iter_bytes(chunk_size):  # noqa: UP028 - async has no `yield from`
                yield chunk

    def read_to(self, path: str | bytes, fileobj: IO[bytes]) -> int:
        """Copy the file at `path` into an open binary file; returns the number of bytes."""
        total = 0
        for chunk in self.stream(path):
            fileobj.write(chunk)
            total += len(chunk)
        return total

    def list(self, path: str | bytes = "/") -> list[FileEntry]:
        """The entries of the directory at `path`."""
        response = self._client._request(
            "GET", self._sandbox._path("files", "list"), params=_base.path_params(path)
        )
        return [FileEntry(item) for item in _base.items(response)]

    def remove(self, path: str | bytes) -> None:
        self._client._request("DELETE", self._sandbox._path("files"), params=_base.path_params(path))

    # ---- issue 9: stat, exists, mkdir, move, chmod, watch, directories as tar streams ------------
    def stat(self, path: str | bytes) -> FileStat:
        """The path's type ("file", "dir", "symlink", "other"), size, mode, mtime and symlink target
        (lstat: a symlink is not followed). Raises `atoll.errors.FileNotFound` when it is missing."""
        response = self._client._request(
            "GET", self._sandbox._path("files", "stat"), params=_base.path_params(path)
        )
        return FileStat(_base.json_body(response))

    def exists(self, path: str | bytes) -> bool:
        """Whether anything (a file, directory or symlink, even a dangling one) is at `path`."""
        try:
            self.stat(path)
        except errors.FileNotFound:
            return False
        return True

    def mkdir(self, path: str | bytes) -> bool:
        """Create the directory and its parents (mkdir -p); False when it existed already."""
        response = self._client._request(
            "POST", self._sandbox._path("files", "mkdir"), params=_base.path_params(path)
        )
        return bool(_base.json_body(response).get("created"))

    def move(self, src: str, dst: str) -> FileStat:
        """Rename or move `src` to `dst` (parents of `dst` are created; a file replaces a file)."""
        response = self._client._request(
            "POST", self._sandbox._path("files", "move"), json={"from": src, "to": dst}
        )
        return FileStat(_base.json_body(response))

    def chmod(self, path: str, mode: int | str) -> FileStat:
        """Set the permission bits: an int such as 0o755, or octal text such as "755"."""
        response = self._client._request(
            "POST", self._sandbox._path("files", "chmod"), json={"path": path, "mode": mode}
        )
        return FileStat(_base.json_body(response))

    def watch(self, path: str | bytes, recursive: bool = True) -> Watch:
        """Watch a directory: returns once the watch is in place (so nothing written after is
        missed); iterate it for `FileEvent`s, and close it (or use it as a context manager)."""
        params = {**_base.path_params(path), "recursive": "true" if recursive else "false"}
        watch = Watch(self._client._stream("GET", self._sandbox._path("files", "watch"), params=params))
        watch._open()
        return watch

    def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str | bytes) -> dict[str, Any]:
        """Upload a local directory tree into `remote_dir` (created) as one tar stream: files, empty
        directories, symlinks and hard links. Returns the counts written: files, dirs, links, bytes."""
        if not os.path.isdir(local_dir):  # said before anything is sent
            raise NotADirectoryError(f"upload_dir: {os.fspath(local_dir)!r} is not a local directory")
        chunks = _tar.tar_chunks(local_dir)
        response = self._client._request(
            "PUT",
            self._sandbox._path("files", "tar"),
            params=_base.path_params(remote_dir),
            content=_base.request_body(chunks),
            headers={"Content-Type": "application/x-tar"},
        )
        return _base.json_body(response)

    def download_dir(self, remote_dir: str | bytes, local_dir: str | os.PathLike[str]) -> int:
        """Download the tree under `remote_dir` into `local_dir` (created), extracted safely
        (tarfile's "data" filter: nothing lands outside `local_dir`). Returns the member count."""
        with tempfile.TemporaryFile() as spool:
            with self._client._stream(
                "GET", self._sandbox._path("files", "tar"), params=_base.path_params(remote_dir)
            ) as response:
                for chunk in response.iter_bytes(_base.CHUNK_SIZE):
                    spool.write(chunk)
            spool.seek(0)
            return _tar.extract(spool, local_dir)


class Watch:
    """An open `sandbox.files.watch(dir)`: iterate it for `FileEvent`s; `aclose()` ends it (the
    watch inside the sandbox ends too). A broken stream raises the mapped `AtollError`."""

    def __init__(self, stream: Any) -> None:
        self._cm = stream
        self._lines: Any = None
        self.closed = False

    def _open(self) -> None:
        response = self._cm.__enter__()
        self._lines = ndjson.lines(response.iter_bytes())
        try:
            first = self._next_event()
        except BaseException:
            self.close()
            raise
        if first.type != "ready":
            self.close()
            raise errors.AtollError(f"the watch stream began with {first.data!r}, not its ready line")

    def _next_event(self) -> FileEvent:
        obj = _base.json_line(self._lines.__next__())  # blank keep-alives are skipped
        if "error" in obj:
            raise _base.stream_error(obj)
        return FileEvent(obj)

    def __iter__(self) -> Watch:
        return self

    def __next__(self) -> FileEvent:
        if self.closed:
            raise StopIteration
        try:
            event = self._next_event()
        except StopIteration:
            self.close()
            raise
        if event.type == "overflow":
            self.close()
        return event

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._cm.__exit__(None, None, None)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
