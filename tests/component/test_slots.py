"""Per-worker slot limits (`atoll worker --slots N`) over in-process FakeWorkers: placement skips a
worker whose slots are taken, `GET /v1/workers` shows `capacity.slots` and `allocated.slots`
counting up and down (create, memory pause keeps it, disk pause frees it, resume takes it, delete
frees it), a create no worker can take answers 503 `no_worker` naming each worker's limit, a
disk-tier resume onto a full worker is refused the same way, an archived one moves to a worker
with room, two resumes never share the last slot, forks need a slot per copy."""

from __future__ import annotations

import asyncio

import pytest

from atoll.core.lifecycle import Phase
from atoll.testing import FakeAtoll, FakeWorker
from tests.component.conftest import create

KEY = "component-key"


@pytest.fixture
async def two(tmp_path):
    """w1 with 2 slots, w2 with 1; one archive store between them."""
    store: dict = {}
    w1 = FakeWorker("w1", store=store, slots=2)
    w2 = FakeWorker("w2", installation="fake01", store=store, slots=1)
    async with FakeAtoll(tmp_path, [w1, w2], api_key=KEY) as f:
        yield f, w1, w2


async def _workers(c) -> dict[str, dict]:
    r = await c.get("/v1/workers")
    assert r.status_code == 200, r.text
    return {w["name"]: w for w in r.json()["items"]}


async def _slots(c) -> dict[str, int]:
    return {n: w["allocated"]["slots"] for n, w in (await _workers(c)).items()}


async def _worker_of(c, sid: str) -> str:
    return (await c.get(f"/v1/sandboxes/{sid}")).json()["worker"]


async def _cordon(c, name: str, on: bool) -> None:
    wid = (await _workers(c))[name]["id"]
    body = {"draining": True, "evacuate": False} if on else {"draining": False}
    r = await c.post(f"/v1/workers/{wid}/drain", json=body)
    assert r.status_code in (200, 202), r.text


async def test_slots_fill_then_create_is_refused_naming_each_workers_limit(two):
    f, w1, w2 = two
    c = f.http
    ws = await _workers(c)
    assert (ws["w1"]["capacity"]["slots"], ws["w2"]["capacity"]["slots"]) == (2, 1)
    assert await _slots(c) == {"w1": 0, "w2": 0}

    sids = [await create(c) for _ in range(3)]
    # wherever the sampling sent each, a full worker took no more: 2 on w1, 1 on w2
    where = [await _worker_of(c, s) for s in sids]
    assert sorted(where) == ["w1", "w1", "w2"], where
    assert await _slots(c) == {"w1": 2, "w2": 1}

    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_worker" and err["retryable"] is True
    assert "w1: slots full (2 of 2 taken)" in err["message"]
    assert "w2: slots full (1 of 1 taken)" in err["message"]
    assert "--slots N" in err["message"] and "ATOLL_WORKER_SLOTS" in err["message"]
    assert len(w1.runtimes) + len(w2.runtimes) == 3  # nothing was made for it


async def test_allocated_slots_count_up_and_down_through_the_lifecycle(two):
    f, w1, w2 = two
    c = f.http
    await _cordon(c, "w2", True)  # everything on w1
    a, b = await create(c), await create(c)
    assert await _slots(c) == {"w1": 2, "w2": 0}

    # the memory tier keeps its memory, and its slot
    assert (await c.post(f"/v1/sandboxes/{a}/pause", json={"tier": "memory"})).status_code == 200
    assert (await _slots(c))["w1"] == 2
    # the disk tier frees it: another create fits
    assert (await c.post(f"/v1/sandboxes/{a}/pause", json={"tier": "disk"})).status_code == 200
    assert (await _slots(c))["w1"] == 1
    ws = await _workers(c)
    assert ws["w1"]["sandboxes"] == 2  # still held (on disk), only not in a slot
    c3 = await create(c)
    assert await _worker_of(c, c3) == "w1" and (await _slots(c))["w1"] == 2

    # a's resume would take a third slot on w1, the only worker that has its disk state
    r = await c.post(f"/v1/sandboxes/{a}/resume")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_worker"
    assert "disk tier, which only its worker can resume" in err["message"]
    assert "worker w1 has 0 free slot(s) of 2" in err["message"] and '"tier": "archive"' in err["message"]
    v = (await c.get(f"/v1/sandboxes/{a}")).json()
    assert (v["state"], v["standby_tier"]) == ("standby", "disk")  # untouched
    # an exec reaching it (which resumes it) is refused the same way
    r = await c.post(f"/v1/sandboxes/{a}/exec", json={"cmd": ["true"]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text

    # delete frees a slot; the resume takes it
    assert (await c.delete(f"/v1/sandboxes/{b}")).status_code in (200, 204)
    assert (await _slots(c))["w1"] == 1
    r = await c.post(f"/v1/sandboxes/{a}/resume")
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert (await _slots(c))["w1"] == 2 and w1.runtimes[a].phase == Phase.RUNNING


async def test_two_resumes_never_share_the_last_slot(two):
    f, w1, w2 = two
    c = f.http
    await _cordon(c, "w2", True)
    a, b = await create(c), await create(c)
    for sid in (a, b):
        assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
    keep = await create(c)  # one slot of w1's two left
    assert (await _slots(c))["w1"] == 1
    w1.delay["resume"] = 0.2  # the first resume is still on the worker when the second asks
    ra, rb = await asyncio.gather(c.post(f"/v1/sandboxes/{a}/resume"), c.post(f"/v1/sandboxes/{b}/resume"))
    assert sorted((ra.status_code, rb.status_code)) == [200, 503], (ra.text, rb.text)
    assert (await _slots(c))["w1"] == 2
    assert sum(1 for r in w1.runtimes.values() if r.phase == Phase.RUNNING) == 2, keep


async def test_an_archived_sandbox_resumes_on_a_worker_with_room(two):
    f, w1, w2 = two
    c = f.http
    await _cordon(c, "w2", True)
    a = await create(c)
    assert (await c.post(f"/v1/sandboxes/{a}/pause", json={"tier": "archive"})).status_code == 200
    await create(c), await create(c)  # w1's 2 slots taken
    await _cordon(c, "w2", False)

    r = await c.post(f"/v1/sandboxes/{a}/resume")
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert r.json()["worker"] == "w2" and w2.runtimes[a].phase == Phase.RUNNING
    assert a not in w1.runtimes  # the full worker dropped its copy
    assert await _slots(c) == {"w1": 2, "w2": 1}

    # archived again, and now w2 is full too: nowhere to go
    assert (await c.post(f"/v1/sandboxes/{a}/pause", json={"tier": "archive"})).status_code == 200
    assert await _worker_of(c, await create(c)) == "w2"  # w2's slot (w1 is full)
    r = await c.post(f"/v1/sandboxes/{a}/resume")
    assert r.status_code == 503, r.text
    msg = r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "no_worker"
    assert "archived on a full worker (worker w2 has 0 free slot(s) of 1" in msg
    assert "w1: slots full (2 of 2 taken)" in msg
    v = (await c.get(f"/v1/sandboxes/{a}")).json()
    assert (v["state"], v["standby_tier"], v["worker"]) == ("standby", "archive", "w2")


async def test_forks_take_a_slot_each(two):
    f, w1, w2 = two
    c = f.http
    await _cordon(c, "w2", True)
    parent = await create(c)
    assert await _worker_of(c, parent) == "w1"
    r = await c.post(f"/v1/sandboxes/{parent}/fork", json={"count": 2})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_worker"
    assert "worker w1 has 1 free slot(s) of 2 and this needs 2" in r.json()["error"]["message"]
    assert len(w1.runtimes) == 1
    r = await c.post(f"/v1/sandboxes/{parent}/fork", json={"count": 1})
    assert r.status_code == 201, r.text
    assert (await _slots(c))["w1"] == 2


async def test_no_limit_by_default(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY) as f:
        for _ in range(5):
            await create(f.http)
        (w,) = (await _workers(f.http)).values()
        assert (w["capacity"]["slots"], w["allocated"]["slots"], w["sandboxes"]) == (0, 5, 5)


async def test_pool_members_take_slots_and_stop_at_the_limit(tmp_path):
    """A warm pool of 3 on a worker with 2 slots: 2 members are made, the keeper's refill is
    refused and says why; a create of the template claims a member (its slot goes with it)."""
    w = FakeWorker("w1", slots=2)
    async with FakeAtoll(tmp_path, [w], api_key=KEY, default_pool=3) as f:
        c, m = f.http, f.manager
        pool: dict = {}
        for _ in range(500):
            pool = (await c.get("/v1/templates/base/pool")).json()
            if pool["last_error"]:
                break
            await asyncio.sleep(0.02)
        assert "w1: slots full (2 of 2 taken)" in (pool["last_error"] or ""), pool
        assert len([r for r in m.live() if r.pooled]) == 2
        assert (await _slots(c))["w1"] == 2
        sid = await create(c)  # claimed: no slot more
        assert not m.get(sid).pooled and (await _slots(c))["w1"] == 2
        assert len(w.runtimes) == 2
