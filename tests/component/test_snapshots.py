"""Named snapshots on the control plane over a FakeWorker: records, the API's answers, tenants and
bad input (docs/api.md "Snapshots"); the real checkpoint is tests/integration/test_snapshots.py."""

from __future__ import annotations

import httpx
import pytest

from atoll.core import ids
from tests.component.conftest import KEY, create


def _as(fake, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=fake.transport, base_url="http://atoll", headers={"Authorization": f"Bearer {key}"}
    )


async def _tenant_key(c, name: str) -> str:
    r = await c.post("/v1/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    r = await c.post(f"/v1/tenants/{r.json()['id']}/keys", json={})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def _code(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["code"]


@pytest.mark.databases
async def test_snapshot_records_list_get_create_from_and_delete(fake):
    c = fake.http
    sid = await create(c, memory_mb=256, env={"E": "1"}, metadata={"team": "a"})
    fake.worker.runtimes[sid].files[b"/work/a.txt"] = b"kept"
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "base-1"})
    assert r.status_code == 201, r.text
    snap = r.json()
    assert ids.is_snapshot_id(snap["id"])
    assert snap["names"] == ["base-1"] and snap["name"] == "base-1"
    assert snap["sandbox_id"] == sid and snap["memory"] is True and snap["memory_mb"] == 256
    assert snap["bytes"] > 0 and snap["template"] == "base" and snap["worker"]
    assert snap["id"] in fake.worker.snapshots
    # an unnamed, files-only one of the same sandbox
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"memory": False})
    assert r.status_code == 201, r.text
    files_only = r.json()
    assert files_only["names"] == [] and files_only["memory"] is False and files_only["memory_mb"] == 0
    # list, filtered, paged
    items = (await c.get("/v1/snapshots")).json()["items"]
    assert [i["id"] for i in items] == [snap["id"], files_only["id"]]
    assert [i["id"] for i in (await c.get("/v1/snapshots", params={"name": "base-1"})).json()["items"]] == [
        snap["id"]
    ]
    assert len((await c.get("/v1/snapshots", params={"sandbox_id": sid})).json()["items"]) == 2
    assert (await c.get("/v1/snapshots", params={"sandbox_id": "sb-0000000000000000"})).json()["items"] == []
    page = (await c.get("/v1/snapshots", params={"limit": 1})).json()
    assert len(page["items"]) == 1 and page["next_cursor"]
    rest = (await c.get("/v1/snapshots", params={"limit": 1, "cursor": page["next_cursor"]})).json()
    assert [i["id"] for i in rest["items"]] == [files_only["id"]] and rest["next_cursor"] is None
    assert (await c.get(f"/v1/snapshots/{snap['id']}")).json()["name"] == "base-1"
    # creates from it, by name and by id: distinct sandboxes with its files and settings
    a = (await c.post("/v1/sandboxes", json={"snapshot": "base-1", "env": {"F": "2"}})).json()
    b = (await c.post("/v1/sandboxes", json={"snapshot": snap["id"]})).json()
    assert a["id"] != b["id"] and sid not in (a["id"], b["id"])
    for made in (a, b):
        assert made["state"] == "running" and made["memory_mb"] == 256
        assert made["metadata"] == {"atoll.snapshot": snap["id"]}
        rt = fake.worker.runtimes[made["id"]]
        assert rt.spec.snapshot_id == snap["id"] and rt.files[b"/work/a.txt"] == b"kept"
    assert fake.worker.runtimes[a["id"]].spec.env == {"E": "1", "F": "2"}
    # a files-only one takes any memory size
    r = await c.post("/v1/sandboxes", json={"snapshot": files_only["id"], "memory_mb": 512})
    assert r.status_code == 201 and r.json()["memory_mb"] == 512, r.text
    # delete: 204, then 404; the worker drops it; sandboxes made from it live on
    assert (await c.delete(f"/v1/snapshots/{snap['id']}")).status_code == 204
    assert snap["id"] not in fake.worker.snapshots
    assert _code(await c.delete(f"/v1/snapshots/{snap['id']}"), 404) == "snapshot_not_found"
    assert _code(await c.get(f"/v1/snapshots/{snap['id']}"), 404) == "snapshot_not_found"
    assert (await c.get(f"/v1/sandboxes/{a['id']}")).json()["state"] == "running"
    # its name is free again
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "base-1"})
    assert r.status_code == 201, r.text


async def test_bad_input_duplicates_unknowns_and_memory_sizes(fake):
    c = fake.http
    sid = await create(c, memory_mb=256, disk_mb=2048)
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "one"})
    assert r.status_code == 201, r.text
    snap = r.json()["id"]
    assert (
        _code(await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "one"}), 409) == "snapshot_exists"
    )
    for body in (
        {"name": ""},
        {"name": "-x"},
        {"name": "a b"},
        {"name": 3},
        {"memory": "yes"},
        {"x": 1},
        [1],
    ):
        r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json=body)
        assert _code(r, 400) == "invalid_request", body
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "snp-0123456789abcdef"})
    assert _code(r, 400) == "invalid_request"  # a name shaped like an id would shadow one
    assert (
        _code(await c.post("/v1/sandboxes/sb-0000000000000000/snapshots", json={}), 404)
        == "sandbox_not_found"
    )
    assert _code(await c.get("/v1/snapshots/snp-0000000000000000"), 404) == "snapshot_not_found"
    assert _code(await c.get("/v1/snapshots/nope"), 404) == "snapshot_not_found"  # a name: none so
    for raw, kind in ((b"null", "null"), (b'"x"', "a string"), (b"[]", "an array")):
        r = await c.post(f"/v1/sandboxes/{sid}/snapshots", content=raw)
        assert _code(r, 400) == "invalid_request" and r.json()["error"]["message"].endswith(f"got {kind}"), (
            r.text
        )
    for bad in ("-x", "a%20b", "x" * 200):
        assert _code(await c.get(f"/v1/snapshots/{bad}"), 400) == "invalid_request", bad
        assert _code(await c.delete(f"/v1/snapshots/{bad}"), 400) == "invalid_request", bad
    assert _code(await c.delete("/v1/snapshots/snp-0000000000000000"), 404) == "snapshot_not_found"
    for ref in ("missing", "snp-0000000000000000"):
        assert _code(await c.post("/v1/sandboxes", json={"snapshot": ref}), 404) == "snapshot_not_found"
    r = await c.post("/v1/sandboxes", json={"snapshot": snap, "memory_mb": 512})
    assert _code(r, 400) == "invalid_request" and "256" in r.json()["error"]["message"]
    # its files are on a 2048 MB disk: a smaller one is refused (the worker would give 2048 anyway)
    r = await c.post("/v1/sandboxes", json={"snapshot": snap, "disk_mb": 1024})
    assert _code(r, 400) == "invalid_request" and "2048" in r.json()["error"]["message"]
    r = await c.post("/v1/sandboxes", json={"snapshot": ""})
    assert _code(r, 400) == "invalid_request" and "snapshot" in r.json()["error"]["message"]
    r = await c.post("/v1/sandboxes", json={"snapshot": snap, "template": "python"})
    assert _code(r, 400) == "invalid_request"
    r = await c.post("/v1/sandboxes", json={"snapshot": snap, "volumes": [{"name": "v", "path": "/data"}]})
    assert _code(r, 400) == "invalid_request"
    # the same memory size, said explicitly, is fine
    assert (await c.post("/v1/sandboxes", json={"snapshot": snap, "memory_mb": 256})).status_code == 201
    # the gate refuses: 409, nothing recorded
    fake.worker.gate_blockers = ["process 7 (node) watches TCP sockets with epoll"]
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "two"})
    assert _code(r, 409) == "checkpoint_refused" and "epoll" in r.json()["error"]["message"]
    assert [i["name"] for i in (await c.get("/v1/snapshots")).json()["items"]] == ["one"]
    fake.worker.gate_blockers = []
    # a snapshot whose worker is gone: a clear 409, and its record can still be deleted
    fake.manager.workers.handles.pop(
        fake.worker_id if hasattr(fake, "worker_id") else next(iter(fake.manager.workers.handles))
    )
    r = await c.post("/v1/sandboxes", json={"snapshot": "one"})
    assert _code(r, 409) == "snapshot_unavailable" and "worker" in r.json()["error"]["message"]
    assert (await c.delete(f"/v1/snapshots/{snap}")).status_code == 204


async def test_another_tenants_snapshot_is_absent(fake):
    c = fake.http
    key_a = await _tenant_key(c, "acme")
    key_b = await _tenant_key(c, "umbrella")
    async with _as(fake, key_a) as ta, _as(fake, key_b) as tb:
        r = await ta.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = await ta.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "mine"})
        assert r.status_code == 201, r.text
        snap = r.json()["id"]
        # the other tenant: not found by id, by name, in lists, for creates, deletes
        assert _code(await tb.get(f"/v1/snapshots/{snap}"), 404) == "snapshot_not_found"
        assert (await tb.get("/v1/snapshots")).json()["items"] == []
        assert _code(await tb.delete(f"/v1/snapshots/{snap}"), 404) == "snapshot_not_found"
        for ref in (snap, "mine"):
            assert _code(await tb.post("/v1/sandboxes", json={"snapshot": ref}), 404) == "snapshot_not_found"
        assert _code(await tb.post(f"/v1/sandboxes/{sid}/snapshots", json={}), 404) == "sandbox_not_found"
        # the same name in another tenant is another snapshot
        r = await tb.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        r = await tb.post(f"/v1/sandboxes/{r.json()['id']}/snapshots", json={"name": "mine"})
        assert r.status_code == 201 and r.json()["id"] != snap, r.text
        assert [i["id"] for i in (await ta.get("/v1/snapshots")).json()["items"]] == [snap]
        # the owner's create by name works
        r = await ta.post("/v1/sandboxes", json={"snapshot": "mine"})
        assert r.status_code == 201, r.text
        # a name is resolved in the caller's tenant: each sees its own "mine"
        assert (await ta.get("/v1/snapshots/mine")).json()["id"] == snap
        assert (await tb.get("/v1/snapshots/mine")).json()["id"] != snap
    # a tenant that owns a snapshot is not deleted until it is gone
    tid = next(t["id"] for t in (await c.get("/v1/tenants")).json()["items"] if t["name"] == "acme")
    r = await c.delete(f"/v1/tenants/{tid}")
    assert _code(r, 409) == "tenant_in_use" and snap in r.json()["error"]["message"]


async def test_get_and_delete_take_a_name_resolved_in_the_acting_tenant(fake):
    c = fake.http
    key_a = await _tenant_key(c, "names-a")
    tid = next(t["id"] for t in (await c.get("/v1/tenants")).json()["items"] if t["name"] == "names-a")
    async with _as(fake, key_a) as ta:
        sid = (await ta.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
        snap = (await ta.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "team/web:v1"})).json()
        # by name, its '/' as it is or quoted
        for path in ("/v1/snapshots/team/web:v1", "/v1/snapshots/team%2Fweb%3Av1"):
            r = await ta.get(path)
            assert r.status_code == 200 and r.json()["id"] == snap["id"], (path, r.text)
        r = await ta.get("/v1/snapshots/team/other")
        assert _code(r, 404) == "snapshot_not_found" and "no snapshot is named 'team/other'" in r.text
    # an admin key resolves a name in `default` unless it names the tenant (?tenant_id=)
    r = await c.get("/v1/snapshots/team/web:v1")
    assert _code(r, 404) == "snapshot_not_found" and "in tenant 'default'" in r.text
    r = await c.get("/v1/snapshots/team/web:v1", params={"tenant_id": tid})
    assert r.status_code == 200 and r.json()["id"] == snap["id"], r.text
    assert (await c.get(f"/v1/snapshots/{snap['id']}")).status_code == 200  # by id: any tenant's
    # nothing after the slash is the list, as every collection's trailing slash (not a 400)
    r = await c.get("/v1/snapshots/", params={"tenant_id": tid})
    assert r.status_code == 307 and r.headers["location"] == f"/v1/snapshots?tenant_id={tid}", r.text
    r = await c.get("/v1/snapshots/", params={"tenant_id": tid}, follow_redirects=True)
    assert [s["id"] for s in r.json()["items"]] == [snap["id"]], r.text
    # delete by name: 204, gone from the worker, then 404; audited as snapshot.delete
    async with _as(fake, key_a) as ta:
        assert (await ta.delete("/v1/snapshots/team/web:v1")).status_code == 204
        assert snap["id"] not in fake.worker.snapshots
        assert _code(await ta.delete("/v1/snapshots/team/web:v1"), 404) == "snapshot_not_found"
    rows = (await c.get("/v1/audit", params={"action": "snapshot.delete"})).json()["items"]
    assert any(r["result"]["status"] == 204 and "team/web:v1" in (r["target"] or "") for r in rows), rows


async def test_the_sdk_takes_lists_creates_from_and_deletes_snapshots(fake):
    import atoll

    async with atoll.AsyncClient("http://atoll", KEY, transport=fake.transport) as client:
        sb = await client.sandboxes.create(idle_timeout_s=0, memory_mb=256)
        snap = await sb.snapshot("sdk-one")
        assert snap.name == "sdk-one" and snap.sandbox_id == sb.id and snap.memory and snap.bytes > 0
        files_only = await sb.snapshot(memory=False)
        assert files_only.name is None and not files_only.memory
        assert [s.id for s in await client.snapshots.list(sandbox_id=sb.id)] == [snap.id, files_only.id]
        assert [s.id for s in await client.snapshots.list(name="sdk-one")] == [snap.id]
        assert (await client.snapshots.get(snap.id)).id == snap.id
        assert (await client.snapshots.get("sdk-one")).id == snap.id  # by name too
        slashed = await sb.snapshot("team/a..b", memory=False)  # '/' and '..' stay in the one name
        assert (await client.snapshots.get("team/a..b")).id == slashed.id
        await client.snapshots.delete("team/a..b")
        assert slashed.id not in fake.worker.snapshots
        copy = await client.sandboxes.create(snapshot="sdk-one")
        assert copy.id != sb.id and copy["memory_mb"] == 256 and copy.metadata["atoll.snapshot"] == snap.id
        await client.snapshots.delete(snap.id)
        with pytest.raises(atoll.NotFound):
            await client.snapshots.delete(snap.id)
        with pytest.raises(atoll.InvalidRequest):
            await sb.snapshot("x" * 200)


async def test_replace_gives_the_name_to_the_new_snapshot(fake):
    c = fake.http
    sid = await create(c)
    first = (await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "latest"})).json()["id"]
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "latest", "replace": True})
    assert r.status_code == 201, r.text
    second = r.json()["id"]
    assert second != first and first not in fake.worker.snapshots and second in fake.worker.snapshots
    assert [i["id"] for i in (await c.get("/v1/snapshots")).json()["items"]] == [second]
    assert _code(await c.get(f"/v1/snapshots/{first}"), 404) == "snapshot_not_found"
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "fresh", "replace": True})
    assert r.status_code == 201, r.text  # nothing to replace: just kept


async def test_reconciliation_deletes_snapshots_no_record_names_once_old(fake):
    import time

    c = fake.http
    sid = await create(c)
    kept = (await c.post(f"/v1/sandboxes/{sid}/snapshots", json={})).json()["id"]
    w = fake.worker
    # kept on the worker without a record: a snapshot call whose answer was lost
    await w.snapshot(sid, "snp-00000000000000aa")
    await w.snapshot(sid, "snp-00000000000000bb")
    w.snapshot_times["snp-00000000000000aa"] = time.time() - 3600  # old: an orphan
    handle = next(iter(fake.manager.workers.handles.values()))
    await fake.manager.workers.reconcile(handle)
    assert "snp-00000000000000aa" not in w.snapshots
    assert "snp-00000000000000bb" in w.snapshots  # young: maybe a take about to be recorded
    w.snapshot_times[kept] = time.time() - 3600
    await fake.manager.workers.reconcile(handle)
    assert kept in w.snapshots  # it has a record
