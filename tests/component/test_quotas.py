"""Tenant quotas at the control plane (in process, fake worker): each refusal names the quota, its
limit and the use; concurrent creates never overshoot; a rate answers 429 with Retry-After;
lowering a quota below the use refuses new admissions and touches nothing running."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.databases  # each test runs on SQLite and on PostgreSQL


def _as(fake, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=fake.transport, base_url="http://atoll", headers={"Authorization": f"Bearer {key}"}
    )


async def _tenant(c: httpx.AsyncClient, name: str, **quotas) -> tuple[str, str]:
    r = await c.post("/v1/tenants", json={"name": name, "quotas": quotas})
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    return tid, (await c.post(f"/v1/tenants/{tid}/keys", json={})).json()["key"]


def _refused(r: httpx.Response, status: int = 403) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == "quota_exceeded", r.text
    return r.json()["error"]["message"]


async def test_max_running_holds_under_concurrent_creates(fake):
    tid, key = await _tenant(fake.http, "q-running", max_running=3)
    async with _as(fake, key) as t:
        rs = await asyncio.gather(*(t.post("/v1/sandboxes", json={"idle_timeout_s": 0}) for _ in range(10)))
        ok = [r for r in rs if r.status_code == 201]
        assert len(ok) == 3, [r.status_code for r in rs]
        msg = _refused(next(r for r in rs if r.status_code != 201))
        assert "max_running 3 reached" in msg and "running" in msg
        # a paused one frees its slot: standby does not count as running
        sid = ok[0].json()["id"]
        assert (await t.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
        assert (await t.post("/v1/sandboxes", json={"idle_timeout_s": 0})).status_code == 201
        _refused(await t.post("/v1/sandboxes", json={"idle_timeout_s": 0}))
    # the default tenant (the admin key) is not limited by another tenant's quota
    assert (await fake.http.post("/v1/sandboxes", json={"idle_timeout_s": 0})).status_code == 201


async def test_memory_and_lowering_a_quota_below_use(fake):
    tid, key = await _tenant(fake.http, "q-mem", max_memory_mb=1024)
    async with _as(fake, key) as t:
        a = await t.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 512})
        b = await t.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 512})
        assert a.status_code == b.status_code == 201
        msg = _refused(await t.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 256}))
        assert "max_memory_mb 1024" in msg and "1024 MB running" in msg
        r = await fake.http.patch(f"/v1/tenants/{tid}", json={"quotas": {"max_memory_mb": 256}})
        assert r.status_code == 200
        for sid in (a.json()["id"], b.json()["id"]):  # nothing running is touched
            assert (await t.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
            assert (await t.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200
        _refused(await t.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 128}))


async def test_creates_per_minute_is_a_429_with_retry_after(fake):
    _, key = await _tenant(fake.http, "q-rate", creates_per_minute=2)
    async with _as(fake, key) as t:
        for _ in range(2):
            assert (await t.post("/v1/sandboxes", json={"idle_timeout_s": 0})).status_code == 201
        r = await t.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        msg = _refused(r, 429)
        assert "creates_per_minute 2 reached" in msg and r.json()["error"]["retryable"] is True
        assert 1 <= int(r.headers["Retry-After"]) <= 60


async def test_volume_storage_and_pool_slots(fake):
    _, key = await _tenant(fake.http, "q-store", max_volume_gb=0.1)
    async with _as(fake, key) as t:
        assert (await t.post("/v1/volumes", json={"name": "a", "size_mb": 64})).status_code == 201
        msg = _refused(await t.post("/v1/drives", json={"name": "b", "size_mb": 64}))
        assert "max_volume_gb 0.1" in msg
        _refused(await t.post("/v1/volumes/a/clone", json={"name": "a2"}))
        assert (await t.get("/v1/volumes/a2")).status_code == 404  # nothing half-made


async def test_a_refused_create_takes_no_volume(fake):
    tid, key = await _tenant(fake.http, "q-vol", max_running=1)
    async with _as(fake, key) as t:
        assert (await t.post("/v1/volumes", json={"name": "v", "size_mb": 64})).status_code == 201
        assert (await t.post("/v1/sandboxes", json={"idle_timeout_s": 0})).status_code == 201
        _refused(await t.post("/v1/sandboxes", json={"volumes": [{"name": "v", "path": "/data"}]}))
        assert (await t.get("/v1/volumes/v")).json()["attached_to"] is None
