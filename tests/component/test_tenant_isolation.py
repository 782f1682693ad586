"""Tenant B probing tenant A's resources on every route of the API (in process, fake worker).

For every path of /openapi.json that names a sandbox, secret, volume, drive or template, and every
method on it, tenant B's request naming A's resource must get exactly the answer it gets for a
resource that does not exist (so ids and names cannot be probed: 404, never 403), and nothing of
A's changes. Names are per tenant: B makes a secret and a volume of A's names. Admin keys see
both tenants and filter with ?tenant_id=."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.component.conftest import create

NOBODY_SID = "sb-0000000000000000"


def _as(fake, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=fake.transport, base_url="http://atoll", headers={"Authorization": f"Bearer {key}"}
    )


async def _tenant(c: httpx.AsyncClient, name: str) -> tuple[str, str]:
    tid = (await c.post("/v1/tenants", json={"name": name})).json()["id"]
    key = (await c.post(f"/v1/tenants/{tid}/keys", json={})).json()["key"]
    return tid, key


def _code(r: httpx.Response) -> tuple[int, str | None]:
    json_answer = r.headers.get("content-type", "").startswith("application/json")
    return r.status_code, r.json().get("error", {}).get("code") if json_answer else None


def _fill(path: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), "1"), path)


@pytest.fixture
async def two(fake):
    c = fake.http
    a_id, a_key = await _tenant(c, "tenant-a")
    b_id, b_key = await _tenant(c, "tenant-b")
    async with _as(fake, a_key) as a, _as(fake, b_key) as b:
        sid = await create(a)
        assert (
            await a.post("/v1/secrets", json={"name": "tok", "value": "s3cr3t", "hosts": ["example.com"]})
        ).status_code == 201
        assert (await a.post("/v1/volumes", json={"name": "data", "size_mb": 64})).status_code == 201
        assert (await a.post("/v1/drives", json={"name": "shared", "size_mb": 64})).status_code == 201
        yield fake, a, b, (a_id, b_id), sid


async def test_b_gets_what_a_missing_resource_gets_on_every_route(two):
    fake, a, b, _, sid = two
    paths = (await fake.http.get("/openapi.json")).json()["paths"]
    probed = 0
    for path, ops in paths.items():
        kinds = {
            "sid": ("sid", sid, NOBODY_SID),
            "/v1/secrets/{name}": ("name", "tok", "nosuch"),
            "/v1/volumes/{name}": ("name", "data", "nosuch"),
            "/v1/drives/{name}": ("name", "shared", "nosuch"),
        }
        key = "sid" if "{sid}" in path else next((k for k in kinds if path.startswith(k)), None)
        if key is None:
            continue
        param, theirs, missing = kinds[key]
        for method in ops:
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            args = {"params": {"path": "/etc/hostname"}}
            if method in ("post", "put", "patch"):
                args["json"] = {}
            r_theirs = await b.request(method.upper(), _fill(path, {param: theirs}), **args)
            r_missing = await b.request(method.upper(), _fill(path, {param: missing}), **args)
            assert r_theirs.status_code != 403, (method, path, r_theirs.text)
            assert r_theirs.status_code < 500, (method, path, r_theirs.text)
            assert _code(r_theirs) == _code(r_missing), (method, path, r_theirs.text, r_missing.text)
            probed += 1
    assert probed > 40  # every sandbox route and the stores' and secrets' ones
    # nothing of A's changed: its sandbox runs, its secret, volume and drive are there
    assert (await a.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    assert (await a.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200
    for p in ("/v1/secrets/tok", "/v1/volumes/data", "/v1/drives/shared"):
        assert (await a.get(p)).status_code == 200, p


async def test_names_are_per_tenant_and_lists_show_only_ones_own(two):
    fake, a, b, (a_id, b_id), sid = two
    assert (
        await b.post("/v1/secrets", json={"name": "tok", "value": "other", "hosts": ["example.org"]})
    ).status_code == 201
    assert (await b.post("/v1/volumes", json={"name": "data", "size_mb": 64})).status_code == 201
    b_sid = await create(b)
    assert [s["id"] for s in (await b.get("/v1/sandboxes")).json()["items"]] == [b_sid]
    assert [s["id"] for s in (await a.get("/v1/sandboxes")).json()["items"]] == [sid]
    assert (await b.get("/v1/secrets/tok")).json()["hosts"] == ["example.org"]
    assert (await a.get("/v1/secrets/tok")).json()["hosts"] == ["example.com"]
    assert [v["name"] for v in (await b.get("/v1/volumes")).json()["items"]] == ["data"]
    # B's sandbox cannot mount A's drive: it is not B's (404, as a drive that does not exist)
    r = await b.post("/v1/sandboxes", json={"drives": [{"name": "shared", "path": "/mnt/s"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "drive_not_found", r.text
    # B's secret binding names B's secret
    r = await b.post("/v1/sandboxes", json={"secrets": {"TOKEN": "tok"}, "idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    # the admin sees both tenants, and one with ?tenant_id=
    c = fake.http
    every = {s["id"] for s in (await c.get("/v1/sandboxes")).json()["items"]}
    assert {sid, b_sid} <= every
    only_a = {s["id"] for s in (await c.get("/v1/sandboxes", params={"tenant_id": a_id})).json()["items"]}
    assert only_a == {sid}
    r = await c.post(
        "/v1/secrets", params={"tenant_id": b_id}, json={"name": "adm", "value": "v", "hosts": ["x.org"]}
    )
    assert r.status_code == 201 and r.json()["tenant_id"] == b_id
    assert (await b.get("/v1/secrets/adm")).status_code == 200
    r = await c.get("/v1/sandboxes", params={"tenant_id": "../../x"})
    assert r.status_code == 400
    # a tenant key naming another tenant is refused
    r = await b.post("/v1/sandboxes", json={"tenant_id": a_id})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
