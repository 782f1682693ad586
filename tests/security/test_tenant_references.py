"""Tenant B naming tenant A's templates, builds, pools, volumes and usage (issue 20, the security
battery), in process (FakeAtoll: the real control plane over a fake worker).

tests/component/test_tenant_isolation.py walks every route with a sandbox id or a secret, volume or
drive name in its path; this module covers what that walk leaves out: the template routes
(`/v1/templates/{name}`, its builds' logs and its pool), A's names and ids inside B's request
bodies (a create from A's template, which must not claim from A's warm pool; a build `from` A's
template; a create mounting A's volume; the logs of A's build under B's own template of the same
name), and usage. Each answer of B's must be exactly the answer for a name or id that does not
exist, and nothing of A's may change."""

from __future__ import annotations

import asyncio

import httpx

from tests.component.conftest import create
from tests.component.test_templates import build, wait_status

SPEC = {"name": "web", "from": "base", "run": ["echo hi"]}


def _as(fake, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=fake.transport, base_url="http://atoll", headers={"Authorization": f"Bearer {key}"}
    )


async def _key(c: httpx.AsyncClient, name: str) -> tuple[str, str]:
    tid = (await c.post("/v1/tenants", json={"name": name})).json()["id"]
    return tid, (await c.post(f"/v1/tenants/{tid}/keys", json={})).json()["key"]


def _code(r: httpx.Response) -> tuple[int, str | None]:
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else None
    return r.status_code, (body.get("error") or {}).get("code") if isinstance(body, dict) else None


async def _same_as_missing(b: httpx.AsyncClient, method: str, theirs: str, missing: str, **kw) -> None:
    r_theirs = await b.request(method, theirs, **kw)
    r_missing = await b.request(method, missing, **kw)
    assert r_theirs.status_code != 403 and r_theirs.status_code < 500, (method, theirs, r_theirs.text)
    assert _code(r_theirs) == _code(r_missing), (method, theirs, r_theirs.text, r_missing.text)


async def _pool_ready(a: httpx.AsyncClient, want: int) -> dict:
    for _ in range(500):
        pool = (await a.get("/v1/templates/web/pool")).json()
        if pool["ready"] >= want:
            return pool
        await asyncio.sleep(0.01)
    raise AssertionError(f"A's pool never reached {want} ready: {pool}")


async def test_b_names_as_template_build_pool_and_volume_as_if_they_did_not_exist(fake):
    c = fake.http
    a_tid, a_key = await _key(c, "ref-a")
    _, b_key = await _key(c, "ref-b")
    async with _as(fake, a_key) as a, _as(fake, b_key) as b:
        built = await build(a, SPEC)
        await wait_status(a, "web", "ready")
        build_id = built["build_id"]
        assert (await a.put("/v1/templates/web/pool", json={"min": 1, "max": 1})).status_code == 200
        pool = await _pool_ready(a, 1)
        assert (await a.post("/v1/volumes", json={"name": "data", "size_mb": 64})).status_code == 201
        a_sid = await create(a)

        # the template routes with A's template name (and A's build id)
        for method, path, kw in (
            ("GET", "/v1/templates/{}", {}),
            ("DELETE", "/v1/templates/{}", {}),
            ("GET", "/v1/templates/{}/builds/" + build_id + "/logs", {}),
            ("GET", "/v1/templates/{}/pool", {}),
            ("PUT", "/v1/templates/{}/pool", {"json": {"min": 0, "max": 0}}),
        ):
            await _same_as_missing(b, method, path.format("web"), path.format("nosuch"), **kw)
        # A's names inside B's bodies
        await _same_as_missing(
            b,
            "POST",
            "/v1/sandboxes",
            "/v1/sandboxes",
            json={"template": "web", "idle_timeout_s": 0},
        )
        r_theirs = await b.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0})
        r_missing = await b.post("/v1/sandboxes", json={"template": "nosuch", "idle_timeout_s": 0})
        assert r_theirs.status_code == 404 and _code(r_theirs)[1] == _code(r_missing)[1], r_theirs.text
        r_theirs = await b.post("/v1/templates", json={**SPEC, "name": "mine", "from": "web"})
        r_missing = await b.post("/v1/templates", json={**SPEC, "name": "mine", "from": "nosuch"})
        assert r_theirs.status_code in (400, 404) and _code(r_theirs) == _code(r_missing), r_theirs.text
        r_theirs = await b.post("/v1/sandboxes", json={"volumes": [{"name": "data", "path": "/data"}]})
        r_missing = await b.post("/v1/sandboxes", json={"volumes": [{"name": "nosuch", "path": "/data"}]})
        assert r_theirs.status_code == 404 and _code(r_theirs) == _code(r_missing), r_theirs.text
        # B's own template of the same name is B's, and A's build id is no build of it
        await build(b, SPEC)
        await wait_status(b, "web", "ready")
        r = await b.get(f"/v1/templates/web/builds/{build_id}/logs")
        assert r.status_code == 404, r.text
        b_sid = (await b.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0})).json()["id"]
        # usage and lists: B sees its own only, also when it names A's tenant
        for params in ({}, {"tenant_id": a_tid}):
            usage = (await b.get("/v1/usage", params={"group_by": "sandbox", **params})).json()
            assert a_sid not in {i.get("sandbox_id") for i in usage["items"]}, usage
            listed = (await b.get("/v1/sandboxes", params=params)).json()["items"]
            assert {s["id"] for s in listed} == {b_sid}, listed
            templates = [t["name"] for t in (await b.get("/v1/templates", params=params)).json()["items"]]
            assert templates.count("web") == 1, templates  # B's own, not A's as well
            volumes = [v["name"] for v in (await b.get("/v1/volumes", params=params)).json()["items"]]
            assert volumes == [], volumes
        usage = (await b.get("/v1/usage", params={"group_by": "tenant"})).json()
        assert len({i.get("tenant_id") for i in usage["items"]}) <= 1, usage

        # nothing of A's changed: its template, build, pool (still full, no member claimed by B),
        # volume and sandbox
        t = (await a.get("/v1/templates/web")).json()
        assert t["status"] == "ready" and t["build_id"] == build_id, t
        after = (await a.get("/v1/templates/web/pool")).json()
        assert after["min"] == 1 and after["ready"] == pool["ready"] and after["claimed"] == pool["claimed"]
        a_pooled = {r.id for r in fake.manager.live() if r.pooled and r.template == "web"}
        assert b_sid not in a_pooled
        assert (await a.get("/v1/volumes/data")).json()["attached_to"] is None
        assert (await a.get(f"/v1/sandboxes/{a_sid}")).json()["state"] == "running"
