"""Metering (controlplane.metering, GET /v1/usage) over FakeAtoll: time in each state accrues into
the right field, CPU from worker UsageReports across runtime generations, restarts neither double
count nor leave gaps, groups add up to the total, tenant keys see only their tenant, bad ranges
are refused."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from atoll.controlplane import metering
from atoll.core import worker_api as api
from atoll.core.lifecycle import Tier
from atoll.testing import FakeAtoll

from .conftest import KEY, create

MB = 512  # the default memory limit of a sandbox (schemas.DEFAULT_MEMORY_MB)


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def metered(request, tmp_path, database_kind):
    """A control plane with a hand-driven meter clock; on PostgreSQL too in `databases` tests."""
    clock = Clock()
    url = request.getfixturevalue("database_url") if database_kind != "sqlite" else None
    f = FakeAtoll(tmp_path, api_key=KEY, tier_policy=False, database_url=url)
    f.meter.clock = clock
    async with f:
        yield f, clock


async def report(fake, sid: str, cpu: float, generation: int = 0) -> None:
    handle = next(iter(fake.manager.workers.handles.values()))
    await fake.manager.worker_event(
        handle, api.UsageReport((api.Usage(sid, cpu, 1 << 20, 3, generation=generation),))
    )


async def usage(fake, **params) -> dict:
    r = await fake.http.get("/v1/usage", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def item(body: dict, sid: str) -> dict:
    return next(i for i in body["items"] if i["sandbox_id"] == sid)


@pytest.mark.databases
async def test_time_in_each_state_accrues_into_its_field(metered):
    fake, clock = metered
    sid = await create(fake.http)
    rec = fake.manager.get(sid)
    fake.meter.tick(clock.t)
    clock.t += 60
    fake.meter.tick(clock.t)
    assert (await fake.http.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})).status_code == 200
    clock.t += 120
    fake.meter.tick(clock.t)
    assert (await fake.http.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
    clock.t += 30
    u = item(await usage(fake), sid)
    gb = rec.memory_mb / 1024
    assert u["memory_gb_seconds"] == pytest.approx(gb * 60, rel=0.01)
    assert u["standby_memory_gb_seconds"] == pytest.approx(gb * 120, rel=0.01)
    assert u["snapshot_disk_gb_seconds"] == pytest.approx(rec.disk_mb / 1024 * 30, rel=0.01)
    assert u["snapshot_gb_seconds"] == u["snapshot_disk_gb_seconds"]
    assert u["cpu_seconds"] == 0
    assert u["cost"] > 0


async def test_cpu_counts_each_generation_from_zero(metered):
    fake, clock = metered
    sid = await create(fake.http)
    for cpu, gen in ((10.0, 0), (25.0, 0), (25.0, 0), (4.0, 1), (9.0, 1), (3.0, 2)):
        await report(fake, sid, cpu, gen)
        clock.t += 5
        fake.meter.tick(clock.t)
    assert item(await usage(fake), sid)["cpu_seconds"] == pytest.approx(25 + 9 + 3)
    # an old worker without generations: a lower reading is a new runtime
    await report(fake, sid, 1.0, 2)
    clock.t += 5
    assert item(await usage(fake), sid)["cpu_seconds"] == pytest.approx(38)


@pytest.mark.databases
async def test_a_restart_neither_double_counts_nor_leaves_a_gap(metered):
    fake, clock = metered
    sid = await create(fake.http)
    gb = fake.manager.get(sid).memory_mb / 1024
    fake.meter.tick(clock.t, flush=True)
    await report(fake, sid, 7.0)
    clock.t += 40
    fake.meter.tick(clock.t, flush=True)
    fake.meter.tick(clock.t, flush=True)  # written twice: counted once
    clock.t += 15
    fake.meter.tick(clock.t)  # accrued, not written: lost with the process
    fake.meter.pending.clear()
    await report(fake, sid, 12.0)
    # a new server process: its meter continues from the written cursors
    again = metering.Meter(fake.manager, clock=clock)
    fake.app.state.meter, old = again, fake.meter
    old.clock = lambda: 0.0  # the old loop must no longer accrue anything
    old.tick = lambda *a, **k: None  # type: ignore[method-assign]
    clock.t += 45
    u = item(await usage(fake), sid)
    assert u["memory_gb_seconds"] == pytest.approx(gb * 100, rel=0.001)
    assert u["cpu_seconds"] == pytest.approx(12.0)


@pytest.mark.databases
async def test_groups_add_up_to_the_total_and_tenants_see_their_own(metered):
    fake, clock = metered
    a, b = await create(fake.http), await create(fake.http)
    r = await fake.http.post("/v1/tenants", json={"name": "acme"})
    tid = r.json()["id"]
    rec = fake.manager.get(b)
    rec.tenant_id = tid
    fake.manager.db.save(rec, fields=["tenant_id"])
    fake.meter.tick(clock.t)
    clock.t += 400  # spans interval boundaries
    await report(fake, a, 3.0)
    await report(fake, b, 5.0)
    clock.t += 2
    total = None
    for group in ("sandbox", "day", "tenant"):
        body = await usage(fake, group_by=group)
        total = total or body["total"]
        for f in ("cpu_seconds", "memory_gb_seconds", "cost"):
            assert sum(i[f] for i in body["items"]) == pytest.approx(body["total"][f], rel=1e-6)
            assert body["total"][f] == pytest.approx(total[f], rel=1e-6)
    assert {i["tenant_id"] for i in (await usage(fake, group_by="tenant"))["items"]} == {"default", tid}
    key = (await fake.http.post(f"/v1/tenants/{tid}/keys", json={})).json()["key"]
    r = await fake.http.get(
        "/v1/usage", params={"group_by": "tenant"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert r.status_code == 200, r.text
    assert [i["tenant_id"] for i in r.json()["items"]] == [tid]
    assert r.json()["total"]["cpu_seconds"] == pytest.approx(5.0)
    r = await fake.http.get(
        "/v1/usage",
        params={"group_by": "sandbox", "tenant_id": "default"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert [i["sandbox_id"] for i in r.json()["items"]] == [b]


MIB = 1 << 20


async def retained(fake, snapshots=(), stores=()) -> None:
    """A worker's usage report of the bytes it retains (worker.runtimes.retained measures them)."""
    handle = next(iter(fake.manager.workers.handles.values()))
    await fake.manager.worker_event(handle, api.UsageReport((), tuple(snapshots), tuple(stores)))


@pytest.mark.databases
async def test_standby_images_and_stores_accrue_their_measured_bytes(metered):
    fake, clock = metered
    measured, old = await create(fake.http), await create(fake.http)
    r = await fake.http.post("/v1/volumes", json={"name": "data", "size_mb": 2048})
    assert r.status_code == 201, r.text
    r = await fake.http.post("/v1/drives", json={"name": "shared", "size_mb": 1024})
    assert r.status_code == 201, r.text
    for sid in (measured, old):
        assert (await fake.http.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
    fake.meter.tick(clock.t)
    # nothing measured yet: accrual waits (the first report comes within 5 s)
    clock.t += 5
    body = await usage(fake, group_by="sandbox")
    assert body["total"]["snapshot_gb_seconds"] == 0 and body["total"]["volume_gb_seconds"] == 0
    # this worker measures the image of `measured` and the volume (not `old`, not the drive:
    # as a worker of an earlier version would)
    await retained(
        fake,
        [api.SnapshotUsage(measured, Tier.DISK, 300 * MIB)],
        [api.StoreUsage("volume", "data", 10 * MIB)],
    )
    clock.t += 55
    body = await usage(fake, group_by="sandbox")
    gib_s = {i["subject"]: i for i in body["items"]}
    # the waited time too, at the measured rate: continuous from the pause / the creation
    assert gib_s[measured]["snapshot_disk_gb_seconds"] == pytest.approx(300 / 1024 * 60, rel=0.01)
    assert gib_s["volume:default/data"]["volume_gb_seconds"] == pytest.approx(10 / 1024 * 60, rel=0.01)
    # no measurement within MEASURE_WAIT_S: the bounds, disk_mb and size_mb
    bound = fake.manager.get(old).disk_mb / 1024
    assert gib_s[old]["snapshot_disk_gb_seconds"] == pytest.approx(bound * 60, rel=0.01)
    assert gib_s["drive:default/shared"]["drive_gb_seconds"] == pytest.approx(1 * 60, rel=0.01)
    # a new measurement changes the rate from then on; the groups add up to the total
    await retained(
        fake,
        [api.SnapshotUsage(measured, Tier.DISK, 100 * MIB)],
        [api.StoreUsage("volume", "data", 30 * MIB)],
    )
    clock.t += 400  # across interval boundaries
    total = None
    for group in ("sandbox", "day", "tenant"):
        body = await usage(fake, group_by=group)
        total = total or body["total"]
        for f in ("snapshot_gb_seconds", "snapshot_disk_gb_seconds", "volume_gb_seconds", "drive_gb_seconds"):
            assert sum(i[f] for i in body["items"]) == pytest.approx(body["total"][f], rel=1e-6), (group, f)
            assert body["total"][f] == pytest.approx(total[f], rel=1e-6)
        # each item's cost is rounded to 6 places; the total is the sum of the items' costs
        assert sum(i["cost"] for i in body["items"]) == pytest.approx(body["total"]["cost"], abs=1e-9)
        assert body["total"]["cost"] == pytest.approx(total["cost"], abs=1e-5)
    gib_s = {i["subject"]: i for i in (await usage(fake, group_by="sandbox"))["items"]}
    assert gib_s[measured]["snapshot_gb_seconds"] == pytest.approx((300 * 60 + 100 * 400) / 1024, rel=0.01)
    assert gib_s["volume:default/data"]["volume_gb_seconds"] == pytest.approx(
        (10 * 60 + 30 * 400) / 1024, rel=0.01
    )


async def test_an_image_measured_before_a_standby_is_not_its_size(metered):
    """Disk, resume, disk again before the worker's next report: the last report still names the
    first standby's image; the second waits for its own measurement."""
    fake, clock = metered
    sid = await create(fake.http)
    assert (await fake.http.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
    fake.meter.tick(clock.t)
    await retained(fake, [api.SnapshotUsage(sid, Tier.DISK, 500 * MIB)])
    clock.t += 10
    fake.meter.tick(clock.t)
    assert (await fake.http.post(f"/v1/sandboxes/{sid}/resume")).status_code == 200
    fake.meter.tick(clock.t)
    assert (await fake.http.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
    fake.meter.tick(clock.t)
    clock.t += 5
    assert item(await usage(fake), sid)["snapshot_disk_gb_seconds"] == pytest.approx(
        500 / 1024 * 10, rel=0.01
    )
    await retained(fake, [api.SnapshotUsage(sid, Tier.DISK, 50 * MIB)])
    clock.t += 5
    expected = (500 * 10 + 50 * 10) / 1024
    assert item(await usage(fake), sid)["snapshot_disk_gb_seconds"] == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"from": "2026-12-02T00:00:00Z", "to": "2026-12-01T00:00:00Z"}, "must be before"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "at most 366 days"),
        ({"from": "yesterday"}, "not an ISO 8601 time"),
        ({"group_by": "week"}, "not one of sandbox, day, tenant"),
    ],
)
async def test_bad_ranges_are_refused_with_a_reason(metered, params, words):
    fake, _ = metered
    r = await fake.http.get("/v1/usage", params=params)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_request"
    assert words in r.json()["error"]["message"]


def test_price_sheets():
    assert metering.load_prices('{"cpu_seconds": 1}')["cpu_seconds"] == 1.0
    for bad, words in (
        ("{", "not valid JSON"),
        ('{"gpu": 1}', "unknown field"),
        ('{"cpu_seconds": -1}', ">= 0"),
    ):
        with pytest.raises(Exception, match=words):
            metering.load_prices(bad)


async def test_metrics_carry_per_tenant_usage_and_need_an_admin_key(metered):
    fake, clock = metered
    await create(fake.http)
    fake.meter.tick(clock.t)
    clock.t += 30
    fake.meter.tick(clock.t)
    r = await fake.http.get("/metrics")
    assert r.status_code == 200
    assert 'atoll_usage_memory_gb_seconds_total{tenant="default"}' in r.text
    anonymous = await fake.http.get("/metrics", headers={"Authorization": ""})
    assert anonymous.status_code == 401
    tid = (await fake.http.post("/v1/tenants", json={"name": "other"})).json()["id"]
    key = (await fake.http.post(f"/v1/tenants/{tid}/keys", json={})).json()["key"]
    assert (await fake.http.get("/metrics", headers={"Authorization": f"Bearer {key}"})).status_code == 403


async def test_a_deleted_sandbox_stops_accruing_and_keeps_its_usage(metered):
    fake, clock = metered
    sid = await create(fake.http)
    gb = fake.manager.get(sid).memory_mb / 1024
    fake.meter.tick(clock.t)
    clock.t += 20
    fake.meter.tick(clock.t)
    assert (await fake.http.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    clock.t += 40
    fake.meter.tick(clock.t, flush=True)
    assert sid not in fake.meter.cursors
    clock.t += 40
    assert item(await usage(fake), sid)["memory_gb_seconds"] == pytest.approx(gb * 20, rel=0.001)


async def test_gateway_bytes_count_across_a_worker_restart(metered):
    fake, clock = metered
    sid = await create(fake.http)
    handle = next(iter(fake.manager.workers.handles.values()))
    for out, into in ((1000, 50_000), (1500, 80_000), (200, 300)):  # the worker restarted: from 0
        u = api.Usage(sid, 0.0, 1 << 20, 3, egress_bytes=out, ingress_bytes=into)
        await fake.manager.worker_event(handle, api.UsageReport((u,)))
        clock.t += 5
        fake.meter.tick(clock.t)
    u = item(await usage(fake), sid)
    assert (u["egress_bytes"], u["ingress_bytes"]) == (1700, 80_300)


async def test_a_server_restart_accrues_the_time_it_was_down(tmp_path, database_url):
    """A real stop and start of the control plane on the same database and worker: the new meter
    loads the cursors, accrues the time the server was down from the record's state, and the
    worker's cumulative CPU counter carries the CPU used meanwhile."""
    clock = Clock()
    first = FakeAtoll(tmp_path, api_key=KEY, tier_policy=False, database_url=database_url)
    first.meter.clock = clock
    async with first:
        sid = await create(first.http)
        gb = first.manager.get(sid).memory_mb / 1024
        first.meter.tick(clock.t)
        await report(first, sid, 4.0)
        clock.t += 30
        first.meter.tick(clock.t)
    clock.t += 100  # the server is down
    second = FakeAtoll(
        tmp_path, workers=first.workers, api_key=KEY, tier_policy=False, database_url=database_url
    )
    second.meter.clock = clock
    async with second:
        await report(second, sid, 9.0)
        clock.t += 20
        u = item(await usage(second), sid)
        assert u["memory_gb_seconds"] == pytest.approx(gb * 150, rel=0.001)
        assert u["cpu_seconds"] == pytest.approx(9.0)


async def test_days_split_at_utc_midnight(tmp_path, database_url):
    clock = Clock()
    clock.t = dt.datetime(2026, 12, 3, 23, 58, tzinfo=dt.UTC).timestamp()
    fake = FakeAtoll(tmp_path, api_key=KEY, tier_policy=False, database_url=database_url)
    fake.meter.clock = clock
    async with fake:
        sid = await create(fake.http)
        gb = fake.manager.get(sid).memory_mb / 1024
        fake.meter.tick(clock.t)
        clock.t += 240
        body = await usage(fake, group_by="day", **{"from": "2026-12-03T00:00:00Z", "to": "2026-12-05"})
        assert [(i["day"], round(i["memory_gb_seconds"] / gb, 3)) for i in body["items"]] == [
            ("2026-12-03", 120.0),
            ("2026-12-04", 120.0),
        ]
        # a range of the second day only
        body = await usage(fake, group_by="sandbox", **{"from": "2026-12-04", "to": "2026-12-05"})
        assert item(body, sid)["memory_gb_seconds"] == pytest.approx(gb * 120)


async def test_a_named_snapshot_accrues_its_bytes_until_deleted(metered):
    fake, clock = metered
    sid = await create(fake.http)
    r = await fake.http.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "kept"})
    assert r.status_code == 201, r.text
    snap = r.json()
    gib = snap["bytes"] / 2**30
    fake.meter.tick(clock.t)
    clock.t += 60
    body = await usage(fake, group_by="sandbox")
    got = {i["subject"]: i for i in body["items"]}[f"snapshot:{snap['id']}"]
    assert got["snapshot_disk_gb_seconds"] == pytest.approx(gib * 60, rel=0.05)
    assert got["tenant_id"] == "default" and got["sandbox_id"] is None
    assert (await fake.http.delete(f"/v1/snapshots/{snap['id']}")).status_code == 204
    fake.meter.tick(clock.t)
    clock.t += 600
    body = await usage(fake, group_by="sandbox")
    after = {i["subject"]: i for i in body["items"]}[f"snapshot:{snap['id']}"]
    assert after["snapshot_disk_gb_seconds"] == pytest.approx(got["snapshot_disk_gb_seconds"], rel=0.01)
