"""Records follow reality: reconciliation with a worker's inventory, worker events, lost workers,
placement over several workers — the control plane in process over fake workers."""

from __future__ import annotations

import asyncio

import pytest

from atoll.core import errors, wire
from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase
from atoll.testing import FakeAtoll, FakeWorker
from atoll.testing.fake_worker import FakeRuntime
from tests.component.conftest import create


async def _reconcile(fake: FakeAtoll, i: int = 0) -> None:
    reg = fake.manager.workers
    handle = next(h for h in reg.handles.values() if h.name == fake.workers[i].name)
    await reg.reconcile(handle)


async def test_a_runtime_that_vanished_fails_its_record_with_the_cause(fake):
    c = fake.http
    sid = await create(c)
    fake.worker.vanish(sid)
    await _reconcile(fake)
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert sb["state"] == "failed" and "gone from worker" in sb["failure_reason"]


async def test_a_runtime_no_live_record_owns_is_deleted(fake):
    c = fake.http
    kept = await create(c)
    orphan = "sb-0000000000000000"
    fake.worker.runtimes[orphan] = FakeRuntime(
        api.SandboxSpec(orphan, "base", 512, 1, 64), phase=Phase.RUNNING
    )
    deleted = await create(c)
    assert (await c.delete(f"/v1/sandboxes/{deleted}")).status_code == 204
    await asyncio.sleep(0.05)
    fake.worker.runtimes[deleted] = FakeRuntime(
        api.SandboxSpec(deleted, "base", 512, 1, 64), phase=Phase.RUNNING
    )
    await _reconcile(fake)
    assert orphan not in fake.worker.runtimes and deleted not in fake.worker.runtimes
    assert kept in fake.worker.runtimes
    assert (await c.get(f"/v1/sandboxes/{kept}")).json()["state"] == "running"


async def test_records_follow_the_phase_the_worker_reports(fake):
    c = fake.http
    frozen, on_disk, running = await create(c), await create(c), await create(c)
    assert (await c.post(f"/v1/sandboxes/{running}/pause", json={"tier": "memory"})).status_code == 200
    rts = fake.worker.runtimes
    rts[frozen].phase, rts[on_disk].phase, rts[running].phase = (
        Phase.FROZEN,
        Phase.CHECKPOINTED,
        Phase.RUNNING,
    )
    await _reconcile(fake)
    got = {sid: (await c.get(f"/v1/sandboxes/{sid}")).json() for sid in (frozen, on_disk, running)}
    assert (got[frozen]["state"], got[frozen]["standby_tier"]) == ("standby", "memory")
    assert got[frozen]["standby_since"] is not None
    assert (got[on_disk]["state"], got[on_disk]["standby_tier"]) == ("standby", "disk")
    assert (got[running]["state"], got[running]["standby_tier"]) == ("running", None)


async def test_a_failed_record_stays_failed_and_a_failed_runtime_fails_its_record(fake):
    c = fake.http
    a, b = await create(c), await create(c)
    fake.worker.runtimes[a].phase, fake.worker.runtimes[a].failure = Phase.FAILED, "runsc said no"
    await _reconcile(fake)
    assert (await c.get(f"/v1/sandboxes/{a}")).json()["failure_reason"] == "runsc said no"
    fake.worker.runtimes[a].phase = Phase.RUNNING  # reality cannot un-fail a record
    await _reconcile(fake)
    assert (await c.get(f"/v1/sandboxes/{a}")).json()["state"] == "failed"
    assert (await c.get(f"/v1/sandboxes/{b}")).json()["state"] == "running"


async def test_an_unacknowledged_create_is_adopted_or_dropped(tmp_path):
    """The server died between recording a create and its answer: after reconciliation, no record
    without a sandbox and no sandbox without a record."""
    worker = FakeWorker()
    async with FakeAtoll(tmp_path, [worker]) as fake:
        worker.delay["create"] = 10
        made = asyncio.ensure_future(fake.http.post("/v1/sandboxes", json={}))
        never = asyncio.ensure_future(fake.http.post("/v1/sandboxes", json={}))
        await asyncio.sleep(0.1)
        sids = [r.id for r in fake.manager.live()]
        assert len(sids) == 2
        made.cancel(), never.cancel()
    # the "server" is gone; one runtime was made, the other never was
    worker.delay.clear()
    worker.runtimes[sids[0]].phase = Phase.RUNNING
    worker.runtimes.pop(sids[1])
    async with FakeAtoll(tmp_path, [worker]) as fake:
        listed = {s["id"]: s["state"] for s in (await fake.http.get("/v1/sandboxes")).json()["items"]}
        assert listed == {sids[0]: "running"}
        assert set(worker.runtimes) == {sids[0]}


async def test_a_reconciliation_leaves_sandboxes_with_a_step_in_flight_alone(fake):
    c = fake.http
    sid = await create(c)
    fake.worker.delay["checkpoint"] = 0.3
    pause = asyncio.ensure_future(c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"}))
    await asyncio.sleep(0.05)
    await _reconcile(fake)  # the runtime reads checkpointing; the record's lock is held
    assert (await pause).json()["standby_tier"] == "disk"
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "standby"


async def test_a_lost_worker_answers_503_and_keeps_the_records(fake):
    c = fake.http
    sid = await create(c)
    handle = next(iter(fake.manager.workers.handles.values()))
    fake.manager.workers._lose(handle, "no heartbeat for 16s")
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
    assert r.json()["error"]["retryable"] is True and "heartbeat" in r.json()["error"]["message"]
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    r = await c.post("/v1/sandboxes", json={})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
    assert (await c.get("/v1/workers")).json()["items"][0]["state"] == "lost"
    assert (await c.get("/healthz")).status_code == 503


async def test_placement_spreads_and_skips_draining_and_full_workers(tmp_path):
    a = FakeWorker("a", installation="aaa", memory_mb=2048)
    b = FakeWorker("b", installation="bbb", memory_mb=1024)
    async with FakeAtoll(tmp_path, [a, b]) as fake:
        c = fake.http
        sids = [await create(c, memory_mb=512) for _ in range(5)]
        where = [(await c.get(f"/v1/sandboxes/{s}")).json()["worker"] for s in sids]
        # the least committed share of memory wins (a: 2048 MB, b: 1024); at equal shares (the 2nd
        # and 5th) the one holding fewer of the tenant's sandboxes does (core.placement)
        assert where == ["a", "b", "a", "a", "b"]
        big = await create(c, memory_mb=1536)  # only "a" can hold it
        assert (await c.get(f"/v1/sandboxes/{big}")).json()["worker"] == "a"
        a_id = next(h.id for h in fake.manager.workers.handles.values() if h.name == "a")
        assert (await c.post(f"/v1/workers/{a_id}/drain", json={"draining": True, "evacuate": False})).json()[
            "state"
        ] == "draining"
        for _ in range(3):
            assert (await c.get(f"/v1/sandboxes/{await create(c, memory_mb=64)}")).json()["worker"] == "b"
        r = await c.post("/v1/sandboxes", json={"memory_mb": 2048})
        assert r.status_code == 400 and "1024" in r.json()["error"]["message"]
        # a draining worker still serves its sandboxes
        assert (await c.post(f"/v1/sandboxes/{big}/exec", json={"cmd": "true"})).status_code == 200
        assert (await c.post(f"/v1/workers/{a_id}/drain", json={"draining": False})).json()[
            "state"
        ] == "ready"


async def test_worker_events_move_records(fake):
    c = fake.http
    sid = await create(c)
    fake.worker.runtimes[sid].phase = Phase.FROZEN
    fake.worker.emit(api.RuntimeChanged(sid, Phase.FROZEN, "frozen by hand"))
    for _ in range(50):
        if (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "standby":
            break
        await asyncio.sleep(0.02)
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["standby_tier"] == "memory"
    fake.worker.emit(api.UsageReport((api.Usage(sid, 1.5, 100 << 20, 42),)))
    await asyncio.sleep(0.05)
    assert fake.manager.usage[sid].host_tasks == 42


async def test_a_worker_name_from_another_home_is_refused(tmp_path):
    async with FakeAtoll(tmp_path, []) as fake:
        reg = fake.manager.workers
        first = wire.dump(await FakeWorker("x", installation="aaa").info())
        answer = reg.register({"info": first}, "http://127.0.0.1:9")
        assert answer["worker_id"].startswith("wk-") and answer["token"]
        other = wire.dump(await FakeWorker("x", installation="bbb").info())
        with pytest.raises(errors.Conflict) as e:
            reg.register({"info": other}, "http://127.0.0.1:9")
        assert e.value.code == "worker_conflict" and "another --name" in e.value.message
        # the same name and installation again is a restart: same id, a new token
        again = reg.register({"info": first}, "http://127.0.0.1:10")
        assert again["worker_id"] == answer["worker_id"] and again["token"] != answer["token"]
        old = wire.dump(await FakeWorker("y").info()) | {"protocol": 99}
        with pytest.raises(errors.Conflict) as e:
            reg.register({"info": old}, "http://127.0.0.1:9")
        assert e.value.code == "incompatible_protocol" and "99" in e.value.message


async def test_reconcile_now_runs_both_passes(fake):
    c = fake.http
    sid = await create(c)
    fake.worker.vanish(sid)
    wid = (await c.get("/v1/workers")).json()["items"][0]["id"]
    r = await c.post(f"/v1/workers/{wid}/reconcile")
    assert r.status_code == 200 and r.json()["worker"]["runtimes"] == 0
    assert ("reconcile", "") in fake.worker.calls
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "failed"
    assert (await c.post("/v1/workers/wk-0000000000000000/reconcile")).status_code == 404


async def test_a_reconciliation_during_a_fork_keeps_the_copies(fake):
    """The copies are recorded (creating) before the worker makes them; a reconciliation in that
    window, whose inventory does not hold them yet, once dropped them as unfinished creates: the
    fork answered 201 with copies that were deleted (found by tests/integration/test_split.py)."""
    c = fake.http
    sid = await create(c)
    fake.worker.delay["fork"] = 0.5
    forking = asyncio.ensure_future(c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2}))
    while not [r for r in fake.manager.live() if (r.metadata_ or {}).get("atoll.forked_from") == sid]:
        await asyncio.sleep(0.01)
    await _reconcile(fake)  # the worker's inventory: no copies yet
    r = await forking
    assert r.status_code == 201, r.text
    for item in r.json()["items"]:
        assert (await c.get(f"/v1/sandboxes/{item['id']}")).json()["state"] == "running"
        ex = await c.post(f"/v1/sandboxes/{item['id']}/exec", json={"cmd": "true"})
        assert ex.status_code == 200, ex.text
