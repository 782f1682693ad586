"""Every route of /openapi.json against each key scope (issue 20, the security battery).

In process (FakeAtoll: the real control plane over a fake worker). Every route is classified here
by its OpenAPI tag (and, for the `system` tag, by path); a route with a tag this module does not
know fails the walk, so that a new route needs a decision. Then:

- a `tenant` key gets `403 forbidden` on every admin route (tenants, keys, workers, audit,
  /metrics) and on the worker protocol, and is let through (not 401/403) on every tenant route;
- a `worker` key gets `403 forbidden` on every route but the worker protocol (register,
  certificate, heartbeat, stopping) and the CA certificate, also on a terminal's WebSocket;
- an `admin` key created by the API is let through everywhere.

Tenant B against tenant A's ids on every route: tests/component/test_tenant_isolation.py."""

from __future__ import annotations

import re

import httpx
import pytest
import websockets

from atoll.testing import FakeAtoll, free_port
from tests.component.conftest import ENDLESS_ROUTES, create
from tests.component.test_worker_protocol import _serve

KEY = "scopes-admin-key"
ADMIN_TAGS = {"tenants", "workers", "audit"}
TENANT_TAGS = {
    "sandboxes",
    "exec",
    "files",
    "terminals",
    "secrets",
    "templates",
    "volumes",
    "drives",
    "snapshots",
    "usage",
}
WORKER_PROTOCOL = {
    "/v1/workers/register",
    "/v1/workers/certificate",
    "/v1/workers/{wid}/heartbeat",
    "/v1/workers/{wid}/stopping",
}
SYSTEM = {
    "/healthz": "public",
    "/metrics": "admin",
    "/v1/ca.crt": "any key",
    "/v1/leases": "admin",
    "/v1/whoami": "tenant",  # a tenant or admin key (a worker key calls only the worker protocol)
}
METHODS = ("get", "post", "put", "patch", "delete")


def _as(fake, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=fake.transport,
        base_url="http://atoll",
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )


NOBODY_SID = "sb-0000000000000000"


def _fill(path: str, sid: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: sid if m.group(1) == "sid" else "x1", path)


def _routes(doc: dict) -> list[tuple[str, str, str]]:
    """(method, path, class) for every operation: class is admin, tenant, worker, public or any key."""
    out = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method not in METHODS:
                continue
            tags = set(op.get("tags", ()))
            if path in WORKER_PROTOCOL:
                cls = "worker"
            elif "system" in tags:
                assert path in SYSTEM, f"classify the system route {path} in this module"
                cls = SYSTEM[path]
            elif tags <= ADMIN_TAGS and tags:
                cls = "admin"
            elif tags <= TENANT_TAGS and tags:
                cls = "tenant"
            else:
                raise AssertionError(
                    f"{method.upper()} {path} has tags {sorted(tags)} this walk does not know"
                )
            out.append((method, path, cls))
    return out


@pytest.fixture
async def keys(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY) as fake:
        c = fake.http
        tid = (await c.post("/v1/tenants", json={"name": "scoped"})).json()["id"]
        tenant = (await c.post(f"/v1/tenants/{tid}/keys", json={})).json()["key"]
        worker = (await c.post("/v1/keys", json={"scope": "worker"})).json()["key"]
        admin = (await c.post("/v1/keys", json={"scope": "admin"})).json()["key"]
        async with _as(fake, tenant) as t:
            sid = await create(t)
        yield fake, {"tenant": tenant, "worker": worker, "admin": admin}, sid


async def _call(c: httpx.AsyncClient, method: str, path: str) -> httpx.Response:
    body = {"json": {}} if method in ("post", "put", "patch") else {}
    return await c.request(method.upper(), path, params={"path": "/etc/hostname"}, **body)


def _refused(r: httpx.Response) -> bool:
    return r.status_code == 403 and r.json().get("error", {}).get("code") == "forbidden"


async def test_each_scope_reaches_exactly_its_routes(keys):
    fake, k, sid = keys
    routes = _routes((await fake.http.get("/openapi.json")).json())
    classes = {cls for _, _, cls in routes}
    assert {"admin", "tenant", "worker"} <= classes
    assert sum(cls == "admin" for _, _, cls in routes) >= 12  # tenants, keys, workers, audit, metrics
    wrong: list[str] = []
    for scope in ("tenant", "worker", "admin"):
        async with _as(fake, k[scope]) as c:
            for method, path, cls in routes:
                if scope == "tenant":
                    must_refuse = cls in ("admin", "worker")
                elif scope == "worker":
                    must_refuse = cls in ("admin", "tenant")
                else:
                    must_refuse = False
                if not must_refuse and (method.upper(), path) in ENDLESS_ROUTES:
                    continue  # let through it streams until the client leaves (the transport would wait)
                # a refusal is asked about the key's own sandbox; a call let through names none
                # (its 404 shows the scope passed, and no stream is left open, nothing changes)
                r = await _call(c, method, _fill(path, sid if must_refuse else NOBODY_SID))
                ok = _refused(r) if must_refuse else r.status_code not in (401, 403)
                if not ok:
                    wrong.append(
                        f"{scope} key {method.upper()} {path} ({cls}): {r.status_code} {r.text[:120]}"
                    )
                if scope == "worker" and must_refuse:
                    assert "worker key" in r.json()["error"]["message"], r.text
    assert not wrong, "\n".join(wrong)


async def test_a_worker_key_opens_no_terminal(keys, tmp_path):
    """The WebSocket of a terminal is not in /openapi.json: checked on its own, over a real socket."""
    fake, k, sid = keys
    async with _as(fake, k["tenant"]) as t:
        r = await t.post(f"/v1/sandboxes/{sid}/pty", json={"cols": 80, "rows": 24})
        assert r.status_code == 201, r.text
        pty_id = r.json()["pty_id"]
    port = free_port()
    async with _serve(fake.app, port):
        url = f"ws://127.0.0.1:{port}/v1/sandboxes/{sid}/pty/{pty_id}/ws"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {k['worker']}"}):
                pass
        # (a refused handshake answers 401 whatever the reason: controlplane.app._refuse_websocket)
        assert refused.value.response.status_code in (401, 403)
        # the same handshake with the tenant's key opens (so the refusal is the scope's)
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {k['tenant']}"}):
            pass
    fake.worker.ptys.close_all()
