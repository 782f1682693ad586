"""`client.workers`: the workers of the server.

Part of the hand-written async SDK; `scripts/unasync_sdk.py` generates its sync twin in `_sync/`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import _base

if TYPE_CHECKING:  # annotations only: these modules import this one
    from .client import AsyncClient


class AsyncWorkers:
    """`client.workers`: the workers of the server (name, state, capacity, what they hold)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[dict[str, Any]]:
        response = await self._client._request("GET", "/v1/workers")
        return _base.items(response)

    async def get(self, worker_id: str) -> dict[str, Any]:
        response = await self._client._request("GET", f"/v1/workers/{worker_id}")
        return _base.json_body(response)
