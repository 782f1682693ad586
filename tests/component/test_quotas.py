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


async def _snap(t: httpx.AsyncClient, sid: str, **body) -> httpx.Response:
    return await t.post(f"/v1/sandboxes/{sid}/snapshots", json=body)


async def test_max_snapshots_counts_kept_snapshots_and_in_flight_takes(fake):
    tid, key = await _tenant(fake.http, "q-snaps", max_snapshots=2)
    async with _as(fake, key) as t:
        sids = [(await t.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"] for _ in range(4)]
        assert (await _snap(t, sids[0], name="a")).status_code == 201
        # concurrent takes for the one slot left: exactly one is kept, the others refused up front
        fake.worker.delay["snapshot"] = 0.2
        rs = await asyncio.gather(*(_snap(t, sid) for sid in sids[1:]))
        fake.worker.delay.pop("snapshot")
        assert sorted(r.status_code for r in rs) == [201, 403, 403], [r.text for r in rs]
        msg = _refused(next(r for r in rs if r.status_code == 403))
        assert "max_snapshots 2 reached" in msg and "delete one first" in msg
        msg = _refused(await _snap(t, sids[0], name="b"))
        assert "max_snapshots 2 reached: the tenant keeps 2 snapshots" in msg
        # refused takes checkpointed nothing and left nothing on the worker
        kept = (await t.get("/v1/snapshots")).json()["items"]
        assert len(kept) == 2 and sorted(fake.worker.snapshots) == sorted(s["id"] for s in kept)
        # the tenant's view shows the use against the quota
        use = (await fake.http.get(f"/v1/tenants/{tid}")).json()["use"]
        assert use["snapshots"] == 2 and use["running"] == 4 and use["snapshot_gb"] >= 0, use
        # a take that replaces a snapshot of the same name does not grow the count
        r = await _snap(t, sids[0], name="a", replace=True)
        assert r.status_code == 201, r.text
        assert (await fake.http.get(f"/v1/tenants/{tid}")).json()["use"]["snapshots"] == 2
        # lowering below the use is allowed; deleting makes room again
        assert (
            await fake.http.patch(f"/v1/tenants/{tid}", json={"quotas": {"max_snapshots": 1}})
        ).status_code == 200
        _refused(await _snap(t, sids[1]))
        for s in (await t.get("/v1/snapshots")).json()["items"]:
            assert (await t.delete(f"/v1/snapshots/{s['id']}")).status_code == 204
        assert (await _snap(t, sids[1])).status_code == 201
    # the admin key's tenant (default) has no quota
    sid = (await fake.http.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    for _ in range(3):
        assert (await _snap(fake.http, sid)).status_code == 201


async def test_takes_replacing_one_name_at_once_count_that_name_once(fake):
    """At max_snapshots, takes in flight that replace the same name (E2B's create_snapshot with a
    used name, twice at once) leave the count as it is: all are admitted, one snapshot keeps the
    name. A plain take beside a replace of a name that exists counts that name once too."""
    tid, key = await _tenant(fake.http, "q-snaprepl", max_snapshots=2)
    async with _as(fake, key) as t:
        sids = [(await t.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"] for _ in range(3)]
        assert (await _snap(t, sids[0], name="a")).status_code == 201
        assert (await _snap(t, sids[0], name="b")).status_code == 201
        fake.worker.delay["snapshot"] = 0.2
        rs = await asyncio.gather(*(_snap(t, sid, name="a", replace=True) for sid in sids))
        assert [r.status_code for r in rs] == [201, 201, 201], [r.text for r in rs]
        kept = (await t.get("/v1/snapshots")).json()["items"]
        assert sorted(s["name"] for s in kept) == ["a", "b"], kept
        # one slot left: a replace of "a" in flight does not take it from a plain take
        assert (
            await fake.http.patch(f"/v1/tenants/{tid}", json={"quotas": {"max_snapshots": 3}})
        ).status_code == 200
        rs = await asyncio.gather(_snap(t, sids[0], name="a", replace=True), _snap(t, sids[1]))
        fake.worker.delay.pop("snapshot")
        assert [r.status_code for r in rs] == [201, 201], [r.text for r in rs]
        assert len((await t.get("/v1/snapshots")).json()["items"]) == 3
        _refused(await _snap(t, sids[2]))


async def test_max_snapshot_gb_refuses_once_the_kept_bytes_reach_it(fake):
    tid, key = await _tenant(fake.http, "q-snapgb", max_snapshot_gb=0.3)
    async with _as(fake, key) as t:
        sid = (await t.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 256})).json()["id"]
        # files only: a few bytes; then one with its 256 MB of memory (under 0.3 GB kept before it)
        assert (await _snap(t, sid, memory=False)).status_code == 201
        assert (await _snap(t, sid, name="mem")).status_code == 201
        assert (await _snap(t, sid, memory=False)).status_code == 201  # 0.25 GB kept < 0.3
        assert (await _snap(t, sid, name="mem2")).status_code == 201  # over it now: 0.5 GB
        msg = _refused(await _snap(t, sid, memory=False))
        assert "max_snapshot_gb 0.3 reached" in msg and "0.50 GB" in msg and "delete one first" in msg
        # replacing "mem2" leaves its bytes out of the count: 0.25 GB kept, so the take is admitted
        assert (await _snap(t, sid, name="mem2", memory=False, replace=True)).status_code == 201
        shown = (await fake.http.get(f"/v1/tenants/{tid}")).json()["quotas"]
        assert shown == {"max_snapshot_gb": 0.3}
        r = await fake.http.patch(f"/v1/tenants/{tid}", json={"quotas": {"max_snapshot_gb": None}})
        assert r.json()["quotas"] == {}
        assert (await _snap(t, sid)).status_code == 201


async def test_a_snapshot_recorded_elsewhere_meanwhile_is_counted_under_the_write_lock(fake):
    """Another server sharing the database records a snapshot while this one checkpoints: the
    record write counts again under the lock, refuses, and the worker's copy is dropped."""
    from atoll.controlplane import db as dbm

    tid, key = await _tenant(fake.http, "q-snaprace", max_snapshots=1)
    async with _as(fake, key) as t:
        sid = (await t.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
        fake.worker.delay["snapshot"] = 0.3
        take = asyncio.ensure_future(_snap(t, sid, name="mine"))
        await asyncio.sleep(0.1)
        assert ("snapshot", sid) in fake.worker.calls  # admitted: the checkpoint is under way
        with fake.manager.db.session.begin() as s:
            s.add(
                dbm.SnapshotRecord(
                    id="snp-00000000000000ee",
                    tenant_id=tid,
                    name="theirs",
                    sandbox_id=sid,
                    template="base",
                    worker_id="elsewhere",
                    bytes=1,
                    memory=False,
                    memory_mb=0,
                    source={},
                )
            )
        msg = _refused(await take)
        assert "max_snapshots 1 reached" in msg
        assert [s["id"] for s in (await t.get("/v1/snapshots")).json()["items"]] == ["snp-00000000000000ee"]
        assert fake.worker.snapshots == {}


async def test_snapshot_quotas_are_checked_like_the_others(fake):
    for bad in ({"max_snapshots": -1}, {"max_snapshot_gb": "lots"}, {"max_snapshots": True}):
        r = await fake.http.post("/v1/tenants", json={"name": "q-bad", "quotas": bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    tid, _ = await _tenant(fake.http, "q-shown", max_snapshots=5, max_snapshot_gb=2.5)
    assert (await fake.http.get(f"/v1/tenants/{tid}")).json()["quotas"] == {
        "max_snapshots": 5,
        "max_snapshot_gb": 2.5,
    }
