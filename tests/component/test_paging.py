"""Lists that page (controlplane.paging) at the real control plane in process: many sandbox
records walked a page at a time see each one exactly once, also while records are added and
deleted between pages; filters apply in the database; the cursor is tamper-evident (400, never a
500) and `limit` is bounded; the other lists page with the same cursors; the SDK follows them."""

from __future__ import annotations

import base64
import datetime as dt
import json

import httpx
import pytest

import atoll
from atoll.controlplane import db as dbm
from atoll.core import ids

from .conftest import KEY, create


def _records(fake, n: int, *, start: dt.datetime | None = None, **fields) -> list[str]:
    """`n` sandbox records written straight to the database (what a busy installation holds),
    one microsecond apart, half of them with the same time as their neighbour (ties are broken
    by id)."""
    t0 = start or dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    recs = []
    for i in range(n):
        base = dict(
            id=ids.new_sandbox_id(),
            tenant_id=ids.DEFAULT_TENANT,
            worker_id=fake.worker.worker_id if hasattr(fake.worker, "worker_id") else "w-none",
            state="running",
            template="base",
            metadata_={"i": str(i), "team": "a" if i % 3 == 0 else "b"},
            env={},
            memory_mb=64,
            cpus=1.0,
            disk_mb=512,
            idle_timeout_s=0,
            disk_after_s=0,
            created_at=t0 + dt.timedelta(microseconds=i // 2),
        )
        base.update(fields)
        recs.append(dbm.SandboxRecord(**base))
    with fake.manager.db.session.begin() as s:
        s.add_all(recs)
    return [r.id for r in sorted(recs, key=lambda r: (r.created_at, r.id))]


async def _walk(c: httpx.AsyncClient, path: str, params: dict | None = None, between=None) -> list[str]:
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        q = dict(params or {})
        if cursor:
            q["cursor"] = cursor
        r = await c.get(path, params=q)
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"items", "next_cursor"}
        seen += [i.get("id") or i.get("name") or i.get("pid") for i in body["items"]]
        cursor = body["next_cursor"]
        pages += 1
        if cursor is None:
            return seen
        assert body["items"], "a page with a next cursor is never empty"
        if between is not None:
            await between(pages)


@pytest.mark.databases
async def test_every_sandbox_exactly_once_in_order(fake):
    c = fake.http
    made = _records(fake, 2345)
    live = await create(c)
    _records(fake, 5, pooled=True)  # a warm pool's: never listed
    _records(fake, 5, state="deleted")
    other = _records(fake, 5, tenant_id="tn-0000000000000000", start=dt.datetime(2026, 2, 1, tzinfo=dt.UTC))
    r = await c.get("/v1/sandboxes")
    first = r.json()
    assert len(first["items"]) == 1000 and first["next_cursor"]
    seen = await _walk(c, "/v1/sandboxes")
    assert len(seen) == len(set(seen)) == 2345 + 1 + 5
    assert seen == [*made, *other, live]  # oldest first (ties by id); the admin sees every tenant
    small = await _walk(c, "/v1/sandboxes", {"limit": "7"})
    assert small == seen
    team = await _walk(c, "/v1/sandboxes", {"limit": "100", "state": "running", "metadata.team": "a"})
    with fake.manager.db.session() as s:
        team_a = {r.id for r in s.query(dbm.SandboxRecord) if r.metadata_.get("team") == "a"}
    assert team == [s for s in [*made, *other] if s in team_a] and len(team) == 782 + 2


@pytest.mark.databases
async def test_filters_run_in_the_database(fake):
    c = fake.http
    _records(fake, 50)
    disk = _records(fake, 4, state="standby", standby_tier="disk")
    mem = _records(fake, 3, state="standby", standby_tier="memory", template="py")
    odd = _records(fake, 2, metadata_={'we"ird key': "x y"})
    assert await _walk(c, "/v1/sandboxes", {"state": "standby", "tier": "disk"}) == disk
    assert await _walk(c, "/v1/sandboxes", {"template": "py", "limit": "2"}) == mem
    assert await _walk(c, "/v1/sandboxes", {"tier": "memory"}) == mem
    assert await _walk(c, "/v1/sandboxes", {'metadata.we"ird key': "x y", "limit": "1"}) == odd
    assert await _walk(c, "/v1/sandboxes", {"metadata.i": "7", "metadata.team": "b"}) != []
    assert await _walk(c, "/v1/sandboxes", {"metadata.i": "7", "metadata.team": "a"}) == []
    for q, word in (({"state": "sleeping"}, "state"), ({"tier": "tape"}, "tier")):
        r = await c.get("/v1/sandboxes", params=q)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


async def test_stable_while_records_come_and_go(fake):
    c = fake.http
    before = _records(fake, 600)
    gone: set[str] = set()
    added: list[str] = []

    async def churn(page: int) -> None:
        # new ones (newer than all: at the end), and deletions of some not yet seen
        added.extend(
            _records(fake, 10, start=dt.datetime(2026, 6, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=page))
        )
        if page <= 8:  # ones not reached yet
            victim = before[-page]
            assert (await c.delete(f"/v1/sandboxes/{victim}")).status_code == 204
            gone.add(victim)

    seen = await _walk(c, "/v1/sandboxes", {"limit": "50"}, between=churn)
    assert len(seen) == len(set(seen)), "a record was listed twice"
    kept = [s for s in before if s not in gone]
    assert [s for s in seen if s in set(before)] == kept  # every record there throughout, once, in order
    assert set(added) <= set(seen)  # added at the end: reached before the walk ends


async def test_tampered_cursors_and_bad_limits_are_400(fake):
    c = fake.http
    _records(fake, 30)
    cur = (await c.get("/v1/sandboxes", params={"limit": "10"})).json()["next_cursor"]
    body, sig = cur.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    payload[1][1] = "sb-zzzzzzzzzzzzzzzz"  # skip ahead by editing the key: the signature no longer fits
    forged = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode() + "." + sig
    flipped = cur[:-2] + ("AA" if cur[-2:] != "AA" else "BB")
    workers = (await c.get("/v1/workers", params={"limit": "1"})).json()
    for bad in (forged, flipped, "garbage", "a.b", cur[:20], cur + "x", "..", "%00", "é" * 3000):
        r = await c.get("/v1/sandboxes", params={"cursor": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["code"] == "invalid_request" and "cursor" in r.json()["error"]["message"]
    tcur = (await c.get("/v1/sandboxes", params={"limit": "1"})).json()["next_cursor"]
    r = await c.get("/v1/tenants", params={"cursor": tcur})  # another list's cursor
    assert r.status_code == 400 and "/v1/sandboxes" in r.json()["error"]["message"], r.text
    assert workers["next_cursor"] is None  # one worker: one page
    for limit in ("0", "1001", "-1", "abc", "1.5", " 5", "1e3", "99999999999999999999"):
        r = await c.get("/v1/sandboxes", params={"limit": limit})
        assert r.status_code == 400, (limit, r.text)
        assert "limit" in r.json()["error"]["message"] and "1 to 1000" in r.json()["error"]["message"]
    assert len((await c.get("/v1/sandboxes", params={"limit": "1"})).json()["items"]) == 1
    assert len((await c.get("/v1/sandboxes", params={"limit": "1000"})).json()["items"]) == 30


async def test_the_other_lists_page_too(fake):
    c = fake.http
    for i in range(5):
        r = await c.post("/v1/secrets", json={"name": f"s{i}", "value": "v", "hosts": ["x.test"]})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/tenants", json={"name": f"t{i}"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/keys", json={"scope": "worker"})).status_code == 201
    assert await _walk(c, "/v1/secrets", {"limit": "2"}) == [f"s{i}" for i in range(5)]
    tenants = await _walk(c, "/v1/tenants", {"limit": "2"})
    assert len(tenants) == 6 and tenants[0] == "default"
    assert len(set(await _walk(c, "/v1/keys", {"limit": "3"}))) == 5
    assert len(await _walk(c, "/v1/workers", {"limit": "1"})) == 1
    names = await _walk(c, "/v1/templates", {"limit": "1"})
    assert names == sorted(names) and names
    sid = await create(c)
    for _ in range(3):
        r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sleep", "0"], "background": True})
        assert r.status_code in (200, 201), r.text
    procs = await _walk(c, f"/v1/sandboxes/{sid}/processes", {"limit": "2"})
    assert len(procs) == 3
    r = await c.get(f"/v1/sandboxes/{sid}/processes", params={"cursor": "nope.nope"})
    assert r.status_code == 400


async def test_the_sdk_follows_cursors(fake):
    made = _records(fake, 2100)
    async with atoll.AsyncClient("http://atoll", KEY, transport=fake.transport) as client:
        got = await client.sandboxes.list()
        assert [s.id for s in got] == made
        team = await client.sandboxes.list(metadata={"team": "a"})
        assert len(team) == 700


@pytest.mark.databases
async def test_the_sdk_tenants_and_keys_against_the_server(fake):
    async with atoll.AsyncClient("http://atoll", KEY, transport=fake.transport) as admin:
        t = await admin.tenants.create("acme", quotas={"max_running": 2})
        assert t["quotas"] == {"max_running": 2}
        assert (await admin.tenants.update(t["id"], quotas={"max_running": None}))["quotas"] == {}
        names = [x["name"] for x in await admin.tenants.list()]
        assert names == ["default", "acme"]
        k = await admin.tenants.create_key(t["id"], expires_at="2099-01-01T00:00:00Z")
        assert k["scope"] == "tenant" and k["key"].startswith("atk_")
        w = await admin.keys.create(scope="worker")
        assert [x["id"] for x in await admin.keys.list()] == [k["id"], w["id"]]
        assert [x["id"] for x in await admin.keys.list(tenant_id=t["id"])] == [k["id"]]
        async with atoll.AsyncClient("http://atoll", k["key"], transport=fake.transport) as tenant:
            assert await tenant.sandboxes.list() == []
            await admin.keys.revoke(k["id"])
            with pytest.raises(atoll.errors.Unauthorized):
                await tenant.sandboxes.list()
        with pytest.raises(atoll.errors.AtollError) as e:
            await admin.tenants.delete("default")
        assert e.value.status_code == 400
        await admin.tenants.delete(t["id"])
        assert [x["name"] for x in await admin.tenants.list()] == ["default"]


@pytest.mark.databases
async def test_several_states_newest_first_and_a_creation_window(fake):
    """`state=running,standby` lists either state; `order=desc` walks newest first, a page at a
    time, and refuses a cursor of the other order; `created_after`/`created_before` bound the
    creation time (RFC 3339, `Z` or an offset); bad values are 400 naming the value."""
    c = fake.http
    t0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    running = _records(fake, 30, start=t0)
    standby = _records(fake, 20, start=t0 + dt.timedelta(hours=1), state="standby", standby_tier="disk")
    failed = _records(fake, 5, start=t0 + dt.timedelta(hours=2), state="failed")
    assert await _walk(c, "/v1/sandboxes", {"state": "running,standby", "limit": 7}) == running + standby
    newest = await _walk(
        c, "/v1/sandboxes", {"state": "running, standby,failed", "order": "desc", "limit": 6}
    )
    assert newest == list(reversed(running + standby + failed))
    window = {
        "created_after": "2026-03-01T00:30:00Z",
        "created_before": "2026-03-01T03:00:00+01:00",  # 02:00 UTC: the failed ones are at 02:00
        "state": "running,standby,failed",
    }
    assert await _walk(c, "/v1/sandboxes", {**window, "limit": 4}) == standby
    # an offset's `+` sent unencoded arrives as a space: read as the offset (as GET /v1/audit does)
    r = await c.get("/v1/sandboxes?state=standby&created_after=2026-03-01T01:30:00 01:00")
    assert [i["id"] for i in r.json()["items"]] == standby, r.text
    # `state` given twice means either, as the comma does; another filter given twice is refused
    r = await c.get("/v1/sandboxes?state=running&state=standby&limit=500")
    assert [i["id"] for i in r.json()["items"]] == running + standby, r.text
    for twice in ("tier=disk&tier=memory", "limit=2&limit=3", "order=asc&order=desc"):
        r = await c.get(f"/v1/sandboxes?{twice}")
        assert r.status_code == 400 and "given 2 times" in r.json()["error"]["message"], r.text
    first = (await c.get("/v1/sandboxes", params={"limit": 3})).json()["next_cursor"]
    r = await c.get("/v1/sandboxes", params={"limit": 3, "order": "desc", "cursor": first})
    assert r.status_code == 400 and "cursor" in r.json()["error"]["message"], r.text
    for params, says in (
        ({"state": "running,paused"}, "'paused'"),
        ({"order": "newest"}, "'newest'"),
        ({"created_after": "yesterday"}, "'yesterday'"),
        ({"created_before": "2026-13-01"}, "RFC 3339"),
        (
            {"created_before": "9999-12-31T23:59:59-12:00"},
            "'9999-12-31T23:59:59-12:00'",
        ),  # past year 9999 in UTC
        ({"created_after": "0001-01-01T00:00:00+14:00"}, "RFC 3339"),
    ):
        r = await c.get("/v1/sandboxes", params=params)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        assert says in r.json()["error"]["message"], r.text
