"""GENERATED FILE - do not edit. `client.snapshots`: named snapshots of sandboxes (`sandbox.snapshot()` takes one), listed,

Generated from `_async/snapshots.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from __future__ import annotations

from .. import _base
from .._models import (
    Snapshot,
)
from ._parents import ClientLike


class Snapshots:
    """`client.snapshots`: named snapshots of sandboxes, kept on the worker that made them."""

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    def list(self, sandbox_id: str | None = None, name: str | None = None) -> list[Snapshot]:
        """Your snapshots, oldest first; only those of `sandbox_id`, or the one named `name`."""
        params = _base.without_none(sandbox_id=sandbox_id, name=name)
        return [Snapshot(item) for item in self._client._items("/v1/snapshots", params)]

    def get(self, snapshot_id: str) -> Snapshot:
        """One snapshot, by id or by name (a name is looked up in your tenant; with an admin key,
        in `default`)."""
        response = self._client._request("GET", _base.snapshot_path(snapshot_id))
        return Snapshot(_base.json_body(response))

    def delete(self, snapshot_id: str) -> None:
        """Remove it, named by id or by name (sandboxes made from it live on); NotFound if there
        is none."""
        self._client._request("DELETE", _base.snapshot_path(snapshot_id))
