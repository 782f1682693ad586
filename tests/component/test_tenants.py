"""Tenants and API keys at the control plane (in process, fake worker): keys shown once and
checked by their hash, revocation and expiry effective at the next request, scopes (a tenant key
on admin routes, a worker key on the public API), the admin key unchanged, and bad input."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest
import sqlalchemy as sa

from atoll.controlplane import auth

pytestmark = pytest.mark.databases  # each test runs on SQLite and on PostgreSQL


def _as(fake, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=fake.transport, base_url="http://atoll", headers={"Authorization": f"Bearer {key}"}
    )


def _err(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    return r.json()["error"]["message"]


async def _tenant(c: httpx.AsyncClient, name: str, **quotas) -> tuple[str, str]:
    r = await c.post("/v1/tenants", json={"name": name, "quotas": quotas})
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    r = await c.post(f"/v1/tenants/{tid}/keys", json={})
    assert r.status_code == 201, r.text
    return tid, r.json()["key"]


async def test_a_tenant_key_works_until_revoked_and_is_stored_only_as_a_hash(fake):
    c = fake.http
    tid, key = await _tenant(c, "acme", max_running=3)
    t = (await c.get(f"/v1/tenants/{tid}")).json()
    assert t["name"] == "acme" and t["quotas"] == {"max_running": 3}
    assert key.startswith("atk_ak-")
    with fake.manager.db.session() as s:
        rows = list(s.scalars(sa.select(auth.KeyRecord)))
    assert len(rows) == 1 and key not in str(rows[0].__dict__) and key.split("_", 2)[2] not in rows[0].digest
    async with _as(fake, key) as tc:
        assert (await tc.get("/v1/sandboxes")).status_code == 200
        _err(await tc.get("/v1/tenants"), 403, "forbidden")
        _err(await tc.post("/v1/keys", json={"scope": "admin"}), 403, "forbidden")
        _err(await tc.get("/v1/workers"), 403, "forbidden")
        kid = rows[0].id
        assert (await c.delete(f"/v1/keys/{kid}")).status_code == 204
        _err(await tc.get("/v1/sandboxes"), 401, "unauthorized")  # the very next request
    keys = (await c.get("/v1/keys", params={"tenant_id": tid})).json()["items"]
    assert [k["id"] for k in keys] == [kid] and keys[0]["revoked_at"] and "key" not in keys[0]
    async with _as(fake, key[:-1] + ("A" if key[-1] != "A" else "B")) as bad:
        _err(await bad.get("/v1/sandboxes"), 401, "unauthorized")


async def test_expired_keys_and_scopes(fake):
    c = fake.http
    r = await c.post("/v1/keys", json={"scope": "worker"})
    assert r.status_code == 201
    async with _as(fake, r.json()["key"]) as wc:
        msg = _err(await wc.get("/v1/sandboxes"), 403, "forbidden")
        assert "worker key" in msg
        assert (await wc.get("/v1/ca.crt")).status_code in (200, 404)
    r = await c.post("/v1/keys", json={"scope": "admin"})
    async with _as(fake, r.json()["key"]) as ac:
        assert (await ac.get("/v1/tenants")).status_code == 200
    soon = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)).isoformat()
    r = await c.post("/v1/keys", json={"scope": "admin", "expires_at": soon})
    kid, key = r.json()["id"], r.json()["key"]
    with fake.manager.db.session.begin() as s:  # time passes
        s.get(auth.KeyRecord, kid).expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    async with _as(fake, key) as ec:
        _err(await ec.get("/v1/sandboxes"), 401, "unauthorized")


async def test_bad_input(fake):
    c = fake.http
    for body in (
        {"name": "Bad Name"},
        {"name": "x" * 64},
        {"name": "ok", "quotas": {"max_running": -1}},
        {"name": "ok", "quotas": {"max_running": 10**12}},
        {"name": "ok", "quotas": {"nope": 1}},
        {"name": "../etc"},
    ):
        r = await c.post("/v1/tenants", json=body)
        assert r.status_code == 400, (body, r.text)
    await _tenant(c, "dup")
    _err(await c.post("/v1/tenants", json={"name": "dup"}), 409, "tenant_exists")
    _err(await c.post("/v1/keys", json={"scope": "root"}), 400, "invalid_request")
    _err(await c.post("/v1/keys", json={"scope": "tenant"}), 400, "invalid_request")
    past = "2001-01-01T00:00:00Z"
    assert "past" in _err(await c.post("/v1/keys", json={"expires_at": past}), 400, "invalid_request")
    _err(await c.post("/v1/keys", json={"expires_at": "tomorrow"}), 400, "invalid_request")
    _err(await c.delete("/v1/keys/ak-nope"), 404, "key_not_found")
    _err(await c.get("/v1/tenants/tn-nope"), 404, "tenant_not_found")
    _err(await c.post("/v1/tenants/tn-0000000000000000/keys", json={}), 404, "tenant_not_found")
    for token in ("", "atk_", "atk_ak-0000000000000000_" + "A" * 43, "x" * 5000):
        async with _as(fake, token) as bad:
            _err(await bad.get("/v1/sandboxes"), 401, "unauthorized")


async def test_quota_changes_and_tenant_deletion(fake):
    c = fake.http
    tid, _ = await _tenant(c, "gone", max_running=2)
    r = await c.patch(f"/v1/tenants/{tid}", json={"quotas": {"max_running": 0, "max_memory_mb": 512}})
    assert r.status_code == 200 and r.json()["quotas"] == {"max_running": 0, "max_memory_mb": 512}
    r = await c.patch(f"/v1/tenants/{tid}", json={"quotas": {"max_running": None}})
    assert r.json()["quotas"] == {"max_memory_mb": 512}
    # a count is whole, on PATCH as on create (2.5 snapshots or sandboxes is no limit anyone meant)
    for key in ("max_running", "max_memory_mb", "creates_per_minute", "max_pool_slots", "max_snapshots"):
        for make in ((lambda q: c.patch(f"/v1/tenants/{tid}", json={"quotas": q})), None):
            if make is None:
                r = await c.post("/v1/tenants", json={"name": "frac", "quotas": {key: 2.5}})
            else:
                r = await make({key: 2.5})
            assert key in _err(r, 400, "invalid_request")
        r = await c.patch(f"/v1/tenants/{tid}", json={"quotas": {key: 3.0}})
        assert r.status_code == 200 and r.json()["quotas"][key] == 3, r.text
    r = await c.patch(f"/v1/tenants/{tid}", json={"quotas": {"max_snapshot_gb": 2.5, "max_standby_gb": 0.5}})
    assert r.status_code == 200 and r.json()["quotas"]["max_snapshot_gb"] == 2.5, r.text
    r = await c.patch(
        f"/v1/tenants/{tid}",
        json={
            "quotas": dict.fromkeys(("max_running", "creates_per_minute", "max_pool_slots", "max_snapshots"))
        },
    )
    assert r.status_code == 200, r.text
    msg = _err(await c.delete(f"/v1/tenants/{tid}"), 409, "tenant_in_use")
    assert "key ak-" in msg  # its key is still valid
    for k in (await c.get("/v1/keys", params={"tenant_id": tid})).json()["items"]:
        await c.delete(f"/v1/keys/{k['id']}")
    assert (await c.delete(f"/v1/tenants/{tid}")).status_code == 204
    _err(await c.get(f"/v1/tenants/{tid}"), 404, "tenant_not_found")
    _err(await c.delete("/v1/tenants/default"), 400, "invalid_request")


def test_whole_quotas_are_the_schemas_integer_quotas():
    """PATCH's check (auth.WHOLE_QUOTAS) and create's schema (schemas.Quotas) agree on which quotas
    are counts, and both know every quota."""
    from atoll.controlplane import auth, schemas

    fields = schemas.Quotas.model_fields
    assert set(fields) == set(auth.QUOTA_KEYS)
    assert {k for k, f in fields.items() if f.annotation == int | None} == auth.WHOLE_QUOTAS
