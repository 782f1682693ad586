"""Named snapshots in the shared object store on the control plane (placement, delete, garbage
collection), over FakeWorkers sharing a `snapshot_store` dict as a real worker shares S3 or
ATOLL_ARCHIVE_DIR: a snapshot is uploaded in the background after it is taken (`stored` turns
true); a create from a stored one goes to its own worker while that one is ready and has room,
else to any ready worker reading the store (which fetches it); without a shared store it stays on
its worker (409 snapshot_unavailable once that one drains). The real upload and download:
tests/integration/test_snapshot_store.py."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
import sqlalchemy as sa

from atoll.controlplane import db as dbm
from atoll.testing import FakeAtoll, FakeWorker
from tests.component.test_worker_protocol import KEY


async def _stored(c: httpx.AsyncClient, snapshot_id: str) -> dict:
    for _ in range(200):
        snap = (await c.get(f"/v1/snapshots/{snapshot_id}")).json()
        if snap["stored"]:
            return snap
        await asyncio.sleep(0.01)
    raise AssertionError(f"snapshot {snapshot_id} never showed stored: {snap}")


async def _two(cp: FakeAtoll, store: dict | None) -> tuple[FakeWorker, FakeWorker, str, str]:
    """A sandbox on w1 (the only worker then) with a file, its snapshot, then w2 joins, far larger:
    placement would rather put creates there. Returns (w1, w2, sandbox id, snapshot id)."""
    c = cp.http
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0, "memory_mb": 256})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    cp.worker.runtimes[sid].files[b"/root/kept.txt"] = b"from w1"
    r = await c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "travel"})
    assert r.status_code == 201, r.text
    w2 = FakeWorker("w2", installation="fake01", memory_mb=1 << 20, snapshot_store=store)
    cp.workers.append(w2)
    await cp.manager.workers.attach_local(w2)
    return cp.worker, w2, sid, r.json()["id"]


def _ids(cp: FakeAtoll) -> dict[str, str]:
    return {h.name: h.id for h in cp.manager.workers.handles.values()}


async def test_a_stored_snapshot_is_created_on_another_worker_once_its_own_drains(tmp_path):
    store: dict = {}
    async with FakeAtoll(
        tmp_path, [FakeWorker("w1", memory_mb=2048, snapshot_store=store)], api_key=KEY
    ) as cp:
        c = cp.http
        cp.worker.delay["store_snapshot"] = 0.05  # answered first, stored in the background
        w1, w2, _sid, snap = await _two(cp, store)
        first = (await c.get(f"/v1/snapshots/{snap}")).json()
        assert first["stored"] is False and first["worker"] == "w1"
        assert (await _stored(c, snap))["worker"] == "w1"
        assert snap in store and ("store_snapshot", snap) in w1.calls
        # its own worker is ready and has room: affinity wins over the larger w2
        r = await c.post("/v1/sandboxes", json={"snapshot": "travel", "idle_timeout_s": 0})
        assert r.status_code == 201 and r.json()["worker"] == "w1", r.text
        # drained: w2 takes it, fetching it from the store (once for creates at once)
        r = await c.post(f"/v1/workers/{_ids(cp)['w1']}/drain", json={"evacuate": False})
        assert r.status_code == 202, r.text
        rs = await asyncio.gather(
            *(c.post("/v1/sandboxes", json={"snapshot": snap, "idle_timeout_s": 0}) for _ in range(2))
        )
        assert [r.status_code for r in rs] == [201, 201], [r.text for r in rs]
        assert {r.json()["worker"] for r in rs} == {"w2"}
        assert [x for x in w2.calls if x[0] == "fetch_snapshot"] == [("fetch_snapshot", snap)]
        for r in rs:
            rt = w2.runtimes[r.json()["id"]]
            assert rt.files[b"/root/kept.txt"] == b"from w1" and rt.spec.memory_mb == 256
        # the delete goes to its worker (draining still answers), which removes the stored copy too
        assert (await c.delete(f"/v1/snapshots/{snap}")).status_code == 204
        assert ("delete_snapshot", snap) in w1.calls and snap not in store


async def test_without_a_shared_store_a_snapshot_stays_on_its_worker(tmp_path):
    async with FakeAtoll(tmp_path, [FakeWorker("w1", memory_mb=2048)], api_key=KEY) as cp:
        c = cp.http
        w1, w2, _sid, snap = await _two(cp, None)
        await asyncio.sleep(0.05)
        assert (await c.get(f"/v1/snapshots/{snap}")).json()["stored"] is False
        assert not any(x[0] == "store_snapshot" for x in w1.calls)
        for _ in range(3):  # w2 is far larger, but cannot fetch it
            r = await c.post("/v1/sandboxes", json={"snapshot": snap, "idle_timeout_s": 0})
            assert r.status_code == 201 and r.json()["worker"] == "w1", r.text
        r = await c.post(f"/v1/workers/{_ids(cp)['w1']}/drain", json={"evacuate": False})
        assert r.status_code == 202, r.text
        r = await c.post("/v1/sandboxes", json={"snapshot": snap})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "snapshot_unavailable" and "draining" in err["message"]
        assert "object store" in err["message"], err
        assert not w2.runtimes


async def test_a_stored_snapshot_whose_worker_is_gone_is_created_and_deleted_through_another(tmp_path):
    store: dict = {}
    async with FakeAtoll(
        tmp_path, [FakeWorker("w1", memory_mb=2048, snapshot_store=store)], api_key=KEY
    ) as cp:
        c = cp.http
        w1, w2, _sid, snap = await _two(cp, store)
        await _stored(c, snap)
        cp.manager.workers.handles.pop(_ids(cp)["w1"])  # removed: gone for good
        r = await c.post("/v1/sandboxes", json={"snapshot": snap, "idle_timeout_s": 0})
        assert r.status_code == 201 and r.json()["worker"] == "w2", r.text
        assert (await c.delete(f"/v1/snapshots/{snap}")).status_code == 204
        assert ("delete_snapshot", snap) in w2.calls and snap not in store and snap not in w2.snapshots


async def test_a_memory_snapshot_made_under_another_runtime_key_is_refused_not_restored(tmp_path):
    store: dict = {}
    async with FakeAtoll(
        tmp_path, [FakeWorker("w1", memory_mb=2048, snapshot_store=store)], api_key=KEY
    ) as cp:
        c = cp.http
        w1, w2, _sid, snap = await _two(cp, store)
        await _stored(c, snap)
        w2.runtime_key = "2"  # another guest agent or runsc
        r = await c.post(f"/v1/workers/{_ids(cp)['w1']}/drain", json={"evacuate": False})
        assert r.status_code == 202, r.text
        r = await c.post("/v1/sandboxes", json={"snapshot": snap, "idle_timeout_s": 0})
        assert r.status_code == 409 and r.json()["error"]["code"] == "snapshot_unavailable", r.text


@pytest.mark.databases
async def test_reconciliation_collects_stored_snapshots_no_record_names_and_uploads_the_rest(fake):
    store: dict = {}
    w = fake.worker
    w.snapshot_store = store
    handle = next(iter(fake.manager.workers.handles.values()))
    handle.info = await w.info()  # now it reads a shared store
    c = fake.http
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    w.fail.add("store_snapshot")  # the upload fails (the store is down): it stays on its worker
    snap = (await c.post(f"/v1/sandboxes/{sid}/snapshots", json={})).json()["id"]
    await asyncio.sleep(0.05)
    assert (await c.get(f"/v1/snapshots/{snap}")).json()["stored"] is False and snap not in store
    # a stored snapshot no record names (a delete while the store failed)
    w.fail.discard("store_snapshot")
    await w.snapshot(sid, "snp-00000000000000cc")
    await w.store_snapshot("snp-00000000000000cc")
    w.snapshots.pop("snp-00000000000000cc")
    # and one another installation uploaded to the same store: never this one's to remove
    store["snp-00000000000000dd"] = dataclasses.replace(store["snp-00000000000000cc"], holder="elsewhere")
    await fake.manager.workers.reconcile(handle)
    assert "snp-00000000000000cc" in store  # seen once: maybe an upload racing its delete
    await _stored(c, snap)  # the pass uploaded the one its worker keeps unstored
    await fake.manager.workers.reconcile(handle)
    assert "snp-00000000000000cc" not in store and snap in store
    assert "snp-00000000000000dd" in store
    # a record whose copy is whole in the store is marked stored (a server restarted mid-upload)
    snap2 = (await c.post(f"/v1/sandboxes/{sid}/snapshots", json={})).json()["id"]
    await _stored(c, snap2)
    with fake.manager.db.session.begin() as s:
        s.execute(sa.update(dbm.SnapshotRecord).where(dbm.SnapshotRecord.id == snap2).values(stored=False))
    assert (await c.get(f"/v1/snapshots/{snap2}")).json()["stored"] is False
    calls = len([x for x in w.calls if x == ("store_snapshot", snap2)])
    await fake.manager.workers.reconcile(handle)
    assert (await c.get(f"/v1/snapshots/{snap2}")).json()["stored"] is True
    assert len([x for x in w.calls if x == ("store_snapshot", snap2)]) == calls  # not uploaded again


async def test_a_delete_waits_for_creates_copying_on_another_worker_and_a_create_after_it_is_404(tmp_path):
    """A create from a stored snapshot downloading it on another worker holds the snapshot on the
    control plane: its delete (which goes to the snapshot's own worker, where nothing is copying)
    is 409 invalid_state until the create is done, as on one worker. And a create arriving while a
    delete runs is 404 snapshot_not_found, with no failed sandbox left for it in the list."""
    store: dict = {}
    async with FakeAtoll(
        tmp_path, [FakeWorker("w1", memory_mb=2048, snapshot_store=store)], api_key=KEY
    ) as cp:
        c = cp.http
        w1, w2, _sid, snap = await _two(cp, store)
        await _stored(c, snap)
        assert (
            await c.post(f"/v1/workers/{_ids(cp)['w1']}/drain", json={"evacuate": False})
        ).status_code == 202
        w2.delay["fetch_snapshot"] = 0.3
        created = asyncio.create_task(c.post("/v1/sandboxes", json={"snapshot": snap, "idle_timeout_s": 0}))
        await asyncio.sleep(0.1)
        r = await c.delete(f"/v1/snapshots/{snap}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state", r.text
        r = await created
        assert r.status_code == 201 and r.json()["worker"] == "w2", r.text
        assert snap in store  # the refused delete removed nothing

        w1.delay["delete_snapshot"] = 0.3
        deleting = asyncio.create_task(c.delete(f"/v1/snapshots/{snap}"))
        await asyncio.sleep(0.1)
        before = {s["id"] for s in (await c.get("/v1/sandboxes")).json()["items"]}
        r = await c.post("/v1/sandboxes", json={"snapshot": snap, "idle_timeout_s": 0})
        assert r.status_code == 404 and r.json()["error"]["code"] == "snapshot_not_found", r.text
        assert (await deleting).status_code == 204
        after = (await c.get("/v1/sandboxes")).json()["items"]
        assert {s["id"] for s in after} == before, [(s["id"], s["state"]) for s in after]
