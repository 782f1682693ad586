"""GENERATED FILE - do not edit. `client.volumes` and `client.drives`: state that outlives a sandbox.

Generated from `_async/stores.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .. import _base
from .._models import FileEntry, Record
from ._parents import ClientLike


def _store_path(kind: str, name: str, *rest: str) -> str:
    return _base.store_path(kind, name, *rest)


class Store(Record):
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

    def refresh(self) -> Store:
        response = self._client._request("GET", _store_path(self._kind, self.name))
        self.data = _base.json_body(response)
        return self

    def delete(self) -> None:
        self._client._request("DELETE", _store_path(self._kind, self.name))

    def clone(self, name: str) -> Store:
        """A point-in-time copy named `name` (allowed while a sandbox has it)."""
        response = self._client._request(
            "POST", _store_path(self._kind, self.name, "clone"), json={"name": name}
        )
        return type(self)(self._client, self._kind, _base.json_body(response))

    def export_tar(self) -> Iterator[bytes]:
        """The whole tree as a tar stream (members relative to its root), chunk by chunk."""
        with self._client._stream(
            "GET", _store_path(self._kind, self.name, "tar"), timeout=self._client.create_timeout
        ) as response:
            for chunk in response.iter_bytes(_base.CHUNK_SIZE):  # noqa: UP028 - async has no `yield from`
                yield chunk

    def import_tar(self, data: _base.UploadData) -> dict[str, Any]:
        """Unpack a tar (bytes, a file or chunks) into the root; the counts written. A volume
        takes one only while no sandbox has it."""
        response = self._client._request(
            "PUT",
            _store_path(self._kind, self.name, "tar"),
            content=_base.request_body(data),
            headers={"Content-Type": "application/x-tar"},
            timeout=self._client.create_timeout,
        )
        return _base.json_body(response)


class Volume(Store):
    """A volume: one sandbox at a time mounts it."""

    __slots__ = ()


class DriveFiles:
    """`drive.files`: the drive's files from the API (paths absolute from the drive's root); a
    file written here is visible to every sandbox that mounts the drive at once."""

    def __init__(self, client: ClientLike, name: str) -> None:
        self._client = client
        self._name = name

    def write(self, path: str | bytes, data: _base.UploadData) -> None:
        self._client._request(
            "PUT",
            _store_path("drive", self._name, "files"),
            params=_base.path_params(path),
            content=_base.request_body(data),
            headers=_base.upload_headers(data),
        )

    def read(self, path: str | bytes) -> bytes:
        response = self._client._request(
            "GET", _store_path("drive", self._name, "files"), params=_base.path_params(path)
        )
        return response.content

    def list(self, path: str | bytes = "/") -> list[FileEntry]:
        response = self._client._request(
            "GET", _store_path("drive", self._name, "files", "list"), params=_base.path_params(path)
        )
        return [FileEntry(item) for item in _base.items(response)]

    def remove(self, path: str | bytes) -> None:
        self._client._request(
            "DELETE", _store_path("drive", self._name, "files"), params=_base.path_params(path)
        )


class Drive(Store):
    """A drive: a shared tree many sandboxes mount at once."""

    __slots__ = ("files",)

    def __init__(self, client: ClientLike, kind: str, data: dict[str, Any]) -> None:
        super().__init__(client, kind, data)
        self.files = DriveFiles(client, self.name)


class Volumes:
    """`client.volumes`: create, get, list and delete volumes."""

    _kind = "volume"

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    def _wrap(self, data: dict[str, Any]) -> Any:
        return Volume(self._client, self._kind, data)

    def create(self, name: str, size_mb: int) -> Any:
        """A new one of `size_mb` MB (writes past it fail with ENOSPC)."""
        response = self._client._request(
            "POST",
            f"/v1/{self._kind}s",
            json={"name": name, "size_mb": size_mb},
            timeout=self._client.create_timeout,
        )
        return self._wrap(_base.json_body(response))

    def get(self, name: str) -> Any:
        response = self._client._request("GET", _store_path(self._kind, name))
        return self._wrap(_base.json_body(response))

    def list(self) -> list[Any]:
        return [self._wrap(item) for item in self._client._items(f"/v1/{self._kind}s")]

    def delete(self, name: str) -> None:
        self._client._request("DELETE", _store_path(self._kind, name))


class Drives(Volumes):
    """`client.drives`: create, get, list and delete drives."""

    _kind = "drive"

    def _wrap(self, data: dict[str, Any]) -> Any:
        return Drive(self._client, self._kind, data)
