"""GENERATED FILE - do not edit. `client.tenants` and `client.keys`: tenants (each with its quotas) and API keys (admin key only).

Generated from `_async/tenants.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any, Literal

from .. import _base
from ._parents import ClientLike


def _id_path(kind: str, value: str, *rest: str) -> str:
    return "/".join([f"/v1/{kind}s/{_base.segment(value, f'{kind} id')}", *rest])


def _expiry(expires_at: dt.datetime | str | None) -> dict[str, Any]:
    if expires_at is None:
        return {}
    if isinstance(expires_at, dt.datetime):
        if expires_at.tzinfo is None:
            raise ValueError("expires_at must be timezone-aware (e.g. datetime.now(timezone.utc) + ...)")
        return {"expires_at": expires_at.isoformat()}
    return {"expires_at": expires_at}


class Tenants:
    """`client.tenants`: create, list, get, change and delete tenants, and make their keys.

    A tenant is a dict `{id, name, quotas, created_at, updated_at}`; quotas left out are
    unlimited (keys: max_running, max_memory_mb, max_standby_gb, max_volume_gb,
    creates_per_minute, max_pool_slots, build_minutes_per_day, max_snapshots, max_snapshot_gb)."""

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    def create(self, name: str, quotas: Mapping[str, float | None] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"name": name}
        if quotas is not None:
            body["quotas"] = dict(quotas)
        response = self._client._request("POST", "/v1/tenants", json=body)
        return _base.json_body(response)

    def list(self) -> list[dict[str, Any]]:
        """Every tenant, oldest first (the pages followed)."""
        return self._client._items("/v1/tenants")

    def get(self, tenant_id: str) -> dict[str, Any]:
        response = self._client._request("GET", _id_path("tenant", tenant_id))
        return _base.json_body(response)

    def update(
        self, tenant_id: str, *, name: str | None = None, quotas: Mapping[str, float | None] | None = None
    ) -> dict[str, Any]:
        """Rename it, or change quotas (a quota set to None is removed: unlimited). A quota lowered
        below the current use refuses new admissions; nothing running is stopped."""
        body: dict[str, Any] = {}
        if name is not None:
            body["name"] = name
        if quotas is not None:
            body["quotas"] = dict(quotas)
        response = self._client._request("PATCH", _id_path("tenant", tenant_id), json=body)
        return _base.json_body(response)

    def delete(self, tenant_id: str) -> None:
        """Delete an empty tenant (one that still owns anything is refused, listing what)."""
        self._client._request("DELETE", _id_path("tenant", tenant_id))

    def create_key(self, tenant_id: str, expires_at: dt.datetime | str | None = None) -> dict[str, Any]:
        """A `tenant` key: `{id, key, scope, tenant_id, expires_at, ...}`; `key` is shown this once."""
        response = self._client._request(
            "POST", _id_path("tenant", tenant_id, "keys"), json=_expiry(expires_at)
        )
        return _base.json_body(response)


class Keys:
    """`client.keys`: admin and worker keys, every key's listing (by id) and revocation."""

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    def create(
        self, scope: Literal["admin", "worker"] = "admin", expires_at: dt.datetime | str | None = None
    ) -> dict[str, Any]:
        """An `admin` key (every tenant) or a `worker` key (`atoll worker` registers with it):
        `{id, key, scope, ...}`; `key` is shown this once. Tenant keys: `tenants.create_key`."""
        response = self._client._request("POST", "/v1/keys", json={"scope": scope, **_expiry(expires_at)})
        return _base.json_body(response)

    def list(self, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """Every key by id (never the key itself), oldest first; `tenant_id` for one tenant's."""
        return self._client._items("/v1/keys", {"tenant_id": tenant_id} if tenant_id else None)

    def revoke(self, key_id: str) -> None:
        """Revoke a key: the next request with it answers 401."""
        self._client._request("DELETE", _id_path("key", key_id))
