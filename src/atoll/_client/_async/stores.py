"""`client.volumes` and `client.drives`: state that outlives a sandbox.

A volume is mounted by one sandbox at a time (`create(..., volumes=[{"name", "path"}])`); a drive
by many at once, and its files are reachable without a sandbox (`drive.files`). Both export and
import tar streams and clone. Part of the hand-written async SDK; `scripts/unasync_sdk.py`
generates its sync twin in `_sync/`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from .. import _base
from .._models import FileEntry, Record
from ._parents import ClientLike


def _store_path(kind: str, name: str, *rest: str) -> str:
    return _base.store_path(kind, name, *rest)


class AsyncStore(Record):
    """A volume or drive as the server shows it: `name`, `size_mb`, `used_mb`, `attached_to` (a
    volume: its holder's sandbox id or None; a drive: the list of sandboxes that mount it)."""

    __slots__ = ("_client", "_kind")

    def __init__(self, client: ClientLike, kind: str, data: dict[str, Any]) -> None:
        super().__init__(data)
        self._client = client
        self._kind = kind

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def size_mb(self) -> int:
        return int(self.data["size_mb"])

    @property
    def used_mb(self) -> float | None:
        return self.data.get("used_mb")

    @property
    def attached_to(self) -> Any:
        return self.data.get("attached_to")

    async def refresh(self) -> AsyncStore:
        response = await self._client._request("GET", _store_path(self._kind, self.name))
        self.data = _base.json_body(response)
        return self

    async def delete(self) -> None:
        await self._client._request("DELETE", _store_path(self._kind, self.name))

    async def clone(self, name: str) -> AsyncStore:
        """A point-in-time copy named `name` (allowed while a sandbox has it)."""
        response = await self._client._request(
            "POST", _store_path(self._kind, self.name, "clone"), json={"name": name}
        )
        return type(self)(self._client, self._kind, _base.json_body(response))

    async def export_tar(self) -> AsyncIterator[bytes]:
        """The whole tree as a tar stream (members relative to its root), chunk by chunk."""
        async with self._client._stream(
            "GET", _store_path(self._kind, self.name, "tar"), timeout=self._client.create_timeout
        ) as response:
            async for chunk in response.aiter_bytes(_base.CHUNK_SIZE):  # noqa: UP028 - async has no `yield from`
                yield chunk

    async def import_tar(self, data: _base.AsyncUploadData) -> dict[str, Any]:
        """Unpack a tar (bytes, a file or chunks) into the root; the counts written. A volume
        takes one only while no sandbox has it."""
        response = await self._client._request(
            "PUT",
            _store_path(self._kind, self.name, "tar"),
            content=_base.arequest_body(data),
            headers={"Content-Type": "application/x-tar"},
            timeout=self._client.create_timeout,
        )
        return _base.json_body(response)


class AsyncVolume(AsyncStore):
    """A volume: one sandbox at a time mounts it."""

    __slots__ = ()


class AsyncDriveFiles:
    """`drive.files`: the drive's files from the API (paths absolute from the drive's root); a
    file written here is visible to every sandbox that mounts the drive at once."""

    def __init__(self, client: ClientLike, name: str) -> None:
        self._client = client
        self._name = name

    async def write(self, path: str | bytes, data: _base.AsyncUploadData) -> None:
        await self._client._request(
            "PUT",
            _store_path("drive", self._name, "files"),
            params=_base.path_params(path),
            content=_base.arequest_body(data),
            headers=_base.upload_headers(data),
        )

    async def read(self, path: str | bytes) -> bytes:
        response = await self._client._request(
            "GET", _store_path("drive", self._name, "files"), params=_base.path_params(path)
        )
        return response.content

    async def list(self, path: str | bytes = "/") -> list[FileEntry]:
        response = await self._client._request(
            "GET", _store_path("drive", self._name, "files", "list"), params=_base.path_params(path)
        )
        return [FileEntry(item) for item in _base.items(response)]

    async def remove(self, path: str | bytes) -> None:
        await self._client._request(
            "DELETE", _store_path("drive", self._name, "files"), params=_base.path_params(path)
        )


class AsyncDrive(AsyncStore):
    """A drive: a shared tree many sandboxes mount at once."""

    __slots__ = ("files",)

    def __init__(self, client: ClientLike, kind: str, data: dict[str, Any]) -> None:
        super().__init__(client, kind, data)
        self.files = AsyncDriveFiles(client, self.name)


class AsyncVolumes:
    """`client.volumes`: create, get, list and delete volumes."""

    _kind = "volume"

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    def _wrap(self, data: dict[str, Any]) -> Any:
        return AsyncVolume(self._client, self._kind, data)

    async def create(self, name: str, size_mb: int) -> Any:
        """A new one of `size_mb` MB (writes past it fail with ENOSPC)."""
        response = await self._client._request(
            "POST",
            f"/v1/{self._kind}s",
            json={"name": name, "size_mb": size_mb},
            timeout=self._client.create_timeout,
        )
        return self._wrap(_base.json_body(response))

    async def get(self, name: str) -> Any:
        response = await self._client._request("GET", _store_path(self._kind, name))
        return self._wrap(_base.json_body(response))

    async def list(self) -> list[Any]:
        return [self._wrap(item) for item in await self._client._items(f"/v1/{self._kind}s")]

    async def delete(self, name: str) -> None:
        await self._client._request("DELETE", _store_path(self._kind, name))


class AsyncDrives(AsyncVolumes):
    """`client.drives`: create, get, list and delete drives."""

    _kind = "drive"

    def _wrap(self, data: dict[str, Any]) -> Any:
        return AsyncDrive(self._client, self._kind, data)
