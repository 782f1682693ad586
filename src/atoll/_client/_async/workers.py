"""`client.workers`: the workers of the server.

Part of the hand-written async SDK; `scripts/unasync_sdk.py` generates its sync twin in `_sync/`.
"""

from __future__ import annotations

from typing import Any

from .. import _base
from ._parents import ClientLike


class AsyncWorkers:
    """`client.workers`: the workers of the server (name, state, capacity, what they hold)."""

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    async def list(self) -> list[dict[str, Any]]:
        return await self._client._items("/v1/workers")

    async def get(self, worker_id: str) -> dict[str, Any]:
        response = await self._client._request("GET", f"/v1/workers/{_base.segment(worker_id, 'worker id')}")
        return _base.json_body(response)

    async def drain(self, worker_id: str, *, evacuate: bool = True) -> dict[str, Any]:
        """Drain the worker: no new sandboxes go there, and (`evacuate`, the default) every
        sandbox on it moves to another worker in the background. Returns the worker; `get` shows
        the progress (`evacuation`, and `evacuated: True` once it holds none)."""
        response = await self._client._request(
            "POST",
            f"/v1/workers/{_base.segment(worker_id, 'worker id')}/drain",
            json={"draining": True, "evacuate": evacuate},
        )
        return _base.json_body(response)

    async def undrain(self, worker_id: str) -> dict[str, Any]:
        """Ready again (an evacuation in progress stops between sandboxes)."""
        response = await self._client._request(
            "POST", f"/v1/workers/{_base.segment(worker_id, 'worker id')}/drain", json={"draining": False}
        )
        return _base.json_body(response)
