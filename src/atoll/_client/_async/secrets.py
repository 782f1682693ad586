"""`client.secrets`: values sealed on the server, sent only by the egress gateway to their hosts.

Part of the hand-written async SDK; `scripts/unasync_sdk.py` generates its sync twin in `_sync/`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import _base
from .._models import (
    Secret,
)
from ._parents import ClientLike


class AsyncSecrets:
    """`client.secrets`: values sealed on the server, sent only by the egress gateway to their hosts."""

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    async def create(
        self, name: str, value: str, hosts: Sequence[str], *, allow_http: bool = False
    ) -> Secret:
        """Store a secret bound to `hosts` (names such as "api.example.com" or "*.example.com");
        the value is never returned by the server. The gateway puts it only in HTTPS requests to
        those hosts, unless `allow_http` (then plain HTTP too: clear text on the wire)."""
        response = await self._client._request(
            "POST",
            "/v1/secrets",
            json={"name": name, "value": value, "hosts": list(hosts), "allow_http": allow_http},
        )
        return Secret(_base.json_body(response))

    async def replace(
        self, name: str, value: str, hosts: Sequence[str], *, allow_http: bool = False
    ) -> Secret:
        """New value, hosts and allow_http (rotation); live sandboxes bound to it use them at once."""
        response = await self._client._request(
            "PUT",
            _base.secret_path(name),
            json={"value": value, "hosts": list(hosts), "allow_http": allow_http},
        )
        return Secret(_base.json_body(response))

    async def get(self, name: str) -> Secret:
        response = await self._client._request("GET", _base.secret_path(name))
        return Secret(_base.json_body(response))

    async def list(self) -> list[Secret]:
        return [Secret(item) for item in await self._client._items("/v1/secrets")]

    async def delete(self, name: str) -> None:
        await self._client._request("DELETE", _base.secret_path(name))
