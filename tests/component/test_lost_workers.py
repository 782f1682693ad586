"""A worker lost for ATOLL_WORKER_GONE_S (controlplane.lost_workers), over real HTTP between a
control plane and two FakeWorkers sharing one store: shown `worker_state: "lost"` at once, then its
archive-tier sandbox moves, a running one fails with the reason, an `on_worker_lost: "restore"`
one comes back on the other worker as of its last archive (or fails without one); when the worker
returns, its copies of what moved or failed are deleted and nothing runs again there. The real
thing (runsc, an S3 store, a SIGKILLed worker) is tests/integration/test_lost_worker.py's."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from atoll.controlplane import db
from atoll.core import errors
from atoll.core.lifecycle import Phase
from atoll.testing import FakeAtoll, FakeWorker, free_port
from tests.component.test_drain import _ids, _on
from tests.component.test_move_archived import _wait
from tests.component.test_worker_protocol import KEY, _serve, _worker


@pytest.fixture
async def two(tmp_path):
    store: dict = {}
    async with FakeAtoll(tmp_path, [], api_key=KEY) as cp:
        cp.manager.workers.lost_after_s = 1.0
        cp.manager.gone.every_s = 0.1
        port = free_port()
        async with _serve(cp.app, port):
            url = f"http://127.0.0.1:{port}"
            w1, w2 = FakeWorker("w1", store=store), FakeWorker("w2", installation="fake01", store=store)
            http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            async with contextlib.AsyncExitStack() as stack:
                yield cp, http, url, w1, w2, stack
            await http.aclose()


async def _new(c: httpx.AsyncClient, **body) -> str:
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0, **body})
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def _put(c: httpx.AsyncClient, sid: str, text: str) -> None:
    r = await c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"}, content=text.encode())
    assert r.status_code in (200, 201, 204), r.text


async def _archived_then_resumed(c: httpx.AsyncClient, sid: str) -> None:
    """Archived with notes "archived", resumed (its archive kept), then notes "after"."""
    await _put(c, sid, "archived")
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})
    assert r.status_code == 200 and r.json()["standby_tier"] == "archive", r.text
    assert (await c.post(f"/v1/sandboxes/{sid}/resume")).json()["state"] == "running"
    await _put(c, sid, "after")


async def _until(c: httpx.AsyncClient, sid: str, test, timeout: float = 15.0) -> dict:
    for _ in range(int(timeout / 0.1)):
        sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
        if test(sb):
            return sb
        await asyncio.sleep(0.1)
    raise AssertionError(f"sandbox {sid} never got there: {sb}")


async def test_a_worker_lost_for_the_gone_timeout_settles_each_sandbox(two):
    cp, c, url, w1, w2, stack = two
    reg1, _, _ = await stack.enter_async_context(_worker(url, w1))
    await _wait(c, "w1", "ready")
    archived, running, on_disk = await _new(c), await _new(c), await _new(c)
    restored, never_archived = await _new(c), await _new(c, on_worker_lost="restore")
    r = await c.patch(f"/v1/sandboxes/{restored}", json={"on_worker_lost": "restore"})
    assert r.status_code == 200 and r.json()["on_worker_lost"] == "restore", r.text
    assert (await c.get(f"/v1/sandboxes/{running}")).json()["on_worker_lost"] == "fail"
    assert (await c.post(f"/v1/sandboxes/{archived}/pause", json={"tier": "archive"})).status_code == 200
    assert (await c.post(f"/v1/sandboxes/{on_disk}/pause", json={"tier": "disk"})).status_code == 200
    await _archived_then_resumed(c, restored)
    assert ("keep_archive", restored) in w1.calls  # its resume left the archive in the store
    await stack.enter_async_context(_worker(url, w2))
    await _wait(c, "w2", "ready")
    cp.manager.gone.gone_after_s = 30  # until the lost state is looked at

    reg1.heartbeat_s = 60  # w1 falls silent
    await _wait(c, "w1", "lost")
    # lost, not gone yet: shown as such, nothing changed, calls answer 503 (retryable)
    sb = (await c.get(f"/v1/sandboxes/{running}")).json()
    assert (sb["state"], sb["worker"], sb["worker_state"]) == ("running", "w1", "lost"), sb
    r = await c.post(f"/v1/sandboxes/{running}/exec", json={"cmd": "true"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text

    # the records database failed a moment ago: nothing is settled on missed heartbeats then
    cp.manager.db.trouble_at = time.monotonic()
    cp.manager.gone.gone_after_s = 0.5  # w1 has been lost for longer than that now
    assert await cp.manager.gone.sweep() == 0
    assert (await c.get(f"/v1/sandboxes/{running}")).json()["state"] == "running"
    cp.manager.db.trouble_at = -1e18
    sb = await _until(c, running, lambda s: s["state"] == "failed")
    why = sb["failure_reason"]
    assert why.startswith("worker gone: ") and "'w1'" in why and "lost since" in why, why
    assert "ATOLL_WORKER_GONE_S" in why, why
    assert (await c.get(f"/v1/sandboxes/{on_disk}")).json()["state"] == "failed"
    sb = await _until(c, archived, lambda s: s["worker"] == "w2")
    assert (sb["state"], sb["standby_tier"], sb["worker_state"]) == ("standby", "archive", "ready"), sb
    assert w2.runtimes[archived].phase == Phase.ARCHIVED
    # "restore": running again on w2, as of its archive (what it wrote after is lost)
    sb = await _until(c, restored, lambda s: s["worker"] == "w2" and s["state"] == "running")
    assert w2.runtimes[restored].phase == Phase.RUNNING and ("adopt", restored) in w2.calls
    r = await c.get(f"/v1/sandboxes/{restored}/files", params={"path": "/root/notes"})
    assert r.status_code == 200 and r.text == "archived", r.text
    sb = (await c.get(f"/v1/sandboxes/{never_archived}")).json()
    assert sb["state"] == "failed" and "holds no archive of it" in sb["failure_reason"], sb
    assert never_archived not in w2.runtimes and running not in w2.runtimes
    # the archive-tier one resumes on w2 by the call itself
    r = await c.post(f"/v1/sandboxes/{archived}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text


async def test_a_returning_worker_drops_what_moved_or_failed_and_resurrects_nothing(two):
    cp, c, url, w1, w2, stack = two
    first = _worker(url, w1)
    reg1, _, _ = await first.__aenter__()
    try:
        await _wait(c, "w1", "ready")
        archived, running, restored = await _new(c), await _new(c), await _new(c, on_worker_lost="restore")
        assert (await c.post(f"/v1/sandboxes/{archived}/pause", json={"tier": "archive"})).status_code == 200
        await _archived_then_resumed(c, restored)
        await stack.enter_async_context(_worker(url, w2))
        await _wait(c, "w2", "ready")
        cp.manager.gone.gone_after_s = 0.5
        reg1.heartbeat_s = 60
        await _wait(c, "w1", "lost")
        await _until(c, running, lambda s: s["state"] == "failed")
        await _until(c, restored, lambda s: s["worker"] == "w2" and s["state"] == "running")
        await _until(c, archived, lambda s: s["worker"] == "w2")
        # w1 still holds its old copies, running or archived
        assert {w1.phase(s) for s in (archived, running, restored)} == {Phase.ARCHIVED, Phase.RUNNING}
    finally:
        await first.__aexit__(None, None, None)
    # w1 returns (same name and home: the same worker), is reconciled, and keeps none of them
    await stack.enter_async_context(_worker(url, w1))
    await _wait(c, "w1", "ready")
    for sid in (archived, running, restored):
        assert sid not in w1.runtimes and ("delete", sid) in w1.calls, w1.calls
    views = {sid: (await c.get(f"/v1/sandboxes/{sid}")).json() for sid in (archived, running, restored)}
    assert (views[archived]["state"], views[archived]["worker"]) == ("standby", "w2"), views[archived]
    assert (views[running]["state"], views[running]["worker"]) == ("failed", "w1"), views[running]
    assert (views[restored]["state"], views[restored]["worker"]) == ("running", "w2"), views[restored]
    r = await c.post(f"/v1/sandboxes/{running}/exec", json={"cmd": "true"})
    assert r.status_code == 409, r.text  # failed stays failed: never run again on w1
    assert (await c.post(f"/v1/sandboxes/{restored}/exec", json={"cmd": "true"})).status_code == 200


async def test_back_before_the_gone_timeout_nothing_changes(two):
    cp, c, url, w1, w2, stack = two
    cp.manager.gone.gone_after_s = 30
    first = _worker(url, w1)
    reg1, _, _ = await first.__aenter__()
    try:
        await _wait(c, "w1", "ready")
        sid = await _new(c)
        reg1.heartbeat_s = 60
        await _wait(c, "w1", "lost")
        assert (await c.get(f"/v1/sandboxes/{sid}")).json()["worker_state"] == "lost"
    finally:
        await first.__aexit__(None, None, None)
    await stack.enter_async_context(_worker(url, w1))
    await _wait(c, "w1", "ready")
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert (sb["state"], sb["worker"], sb["worker_state"]) == ("running", "w1", "ready"), sb
    assert w1.phase(sid) == Phase.RUNNING
    assert (await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200


async def test_a_worker_killed_during_a_restore_hands_it_on_to_the_next(two):
    """w1 is gone: its "restore" sandbox is adopted by w2, which is killed while restoring it. The
    record stays in the archive tier, on w2 (nothing of it ran there); once w2 is gone too, w3
    adopts the same archive and the next call runs it there, as of that archive."""
    cp, c, url, w1, w2, stack = two
    w3 = FakeWorker("w3", installation="fake03", store=w1.store)
    reg1, _, _ = await stack.enter_async_context(_worker(url, w1))
    await _wait(c, "w1", "ready")
    sid = await _new(c, on_worker_lost="restore")
    await _archived_then_resumed(c, sid)
    second = _worker(url, w2)
    await second.__aenter__()
    try:
        await _wait(c, "w2", "ready")
        w2.delay["restore"] = 30.0  # the restore hangs until w2 is killed
        cp.manager.gone.gone_after_s = 0.5
        reg1.heartbeat_s = 60
        for _ in range(150):
            if ("restore", sid) in w2.calls:
                break
            await asyncio.sleep(0.1)
        assert ("restore", sid) in w2.calls, w2.calls
    finally:
        await second.__aexit__(None, None, None)  # w2 dies mid-restore
    sb = await _until(c, sid, lambda s: s["worker_state"] == "lost" and s["worker"] == "w2")
    assert (sb["state"], sb["standby_tier"]) == ("standby", "archive"), sb
    await stack.enter_async_context(_worker(url, w3))
    sb = await _until(c, sid, lambda s: s["worker"] == "w3")
    assert (sb["state"], sb["standby_tier"]) == ("standby", "archive"), sb
    r = await c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"})  # resumes it on w3
    assert r.status_code == 200 and r.text == "archived", r.text
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert (sb["state"], sb["worker"], sb["worker_state"]) == ("running", "w3", "ready"), sb


@pytest.mark.parametrize("kind", ["restore", "archived"])
async def test_a_server_stopped_between_the_adoption_and_the_record_loses_nothing(tmp_path, kind):
    """w1 is gone; the server settling its sandbox (`on_worker_lost: "restore"`, running; or in the
    archive tier) stops once w2 adopted it — the archive is w2's now — but before the record names
    w2. A new server on the same database: w2's reconciliation finishes the move (the record names
    w2; the restored one runs again there, as of its archive), never deletes w2's copy with the
    archive. (It did: the copy looked unowned, and w2's delete removed the objects in the store.)"""
    store: dict = {}
    w1, w2 = FakeWorker("w1", store=store), FakeWorker("w2", installation="fake01", store=store)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    real_adopt, adopted = w2.adopt, asyncio.Event()

    async def adopt_then_hang(sandbox_id, mounts):  # adopted on w2, the server never hears back
        out = await real_adopt(sandbox_id, mounts)
        adopted.set()
        await asyncio.Event().wait()
        return out

    async with contextlib.AsyncExitStack() as workers:
        first = FakeAtoll(tmp_path, [], api_key=KEY)
        await first.start()
        first.manager.workers.lost_after_s = 1.0
        first.manager.gone.every_s = 0.1
        serving = _serve(first.app, port)
        await serving.__aenter__()
        c = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        try:
            one = _worker(url, w1)
            reg1, _, _ = await one.__aenter__()
            try:
                await _wait(c, "w1", "ready")
                if kind == "restore":
                    sid = await _new(c, on_worker_lost="restore")
                    await _archived_then_resumed(c, sid)  # running, its last archive in the store
                else:
                    sid = await _new(c)
                    await _put(c, sid, "archived")
                    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})
                    assert r.status_code == 200, r.text
                await workers.enter_async_context(_worker(url, w2))
                await _wait(c, "w2", "ready")
                w2.adopt = adopt_then_hang  # type: ignore[method-assign]
                first.manager.gone.gone_after_s = 0.5
                reg1.heartbeat_s = 60  # w1 falls silent, and is gone soon
                await asyncio.wait_for(adopted.wait(), 30)
            finally:
                await one.__aexit__(None, None, None)  # w1 stays away
        finally:
            await c.aclose()
            await serving.__aexit__(None, None, None)
            await first.stop()  # the server stops between w2's adoption and the record
        assert store[sid].holder == "w2" and w2.phase(sid) == Phase.ARCHIVED
        database = db.open_database(f"sqlite:///{tmp_path / 'atoll.db'}")
        try:
            rec = database.get(sid)
        finally:
            database.engine.dispose()
        assert rec.worker_id != await _id_of(tmp_path, "w2"), "the record named w2 already"
        w2.adopt = real_adopt  # type: ignore[method-assign]

        async with FakeAtoll(tmp_path, [], api_key=KEY) as second, _serve(second.app, port):
            c = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            try:
                want = "running" if kind == "restore" else "standby"
                sb = await _until(c, sid, lambda s: s["worker"] == "w2" and s["state"] == want)
                assert sid in store and sid in w2.runtimes, "w2's copy or the archive was deleted"
                r = await c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"})
                assert r.status_code == 200 and r.text == "archived", r.text
                sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
                assert (sb["state"], sb["worker"]) == ("running", "w2"), sb
            finally:
                await c.aclose()


async def _id_of(tmp_path, name: str) -> str:
    database = db.open_database(f"sqlite:///{tmp_path / 'atoll.db'}")
    try:
        return next(w.id for w in database.workers() if w.name == name)
    finally:
        database.engine.dispose()


@pytest.mark.parametrize("cut_short", [True, False])
async def test_settling_onto_the_worker_that_adopted_it_before_takes_that_copy(tmp_path, cut_short):
    """A move cut short after w2's adopt (the record `moving_to` w2) and settled again before w2's
    reconciliation ran: placement picks w2 again, whose adopt answers "already exists" — that copy
    is the earlier adoption's (it holds the archive), so the move is recorded. A copy w2 holds for
    another reason (no `moving_to` it: stale) is refused as before."""
    store: dict = {}
    w1, w2 = FakeWorker("w1", store=store), FakeWorker("w2", installation="fake01", store=store)
    async with FakeAtoll(tmp_path, [w1, w2], api_key=KEY, tier_policy=False) as f:
        c, m = f.http, f.manager
        (sid,) = await _on(c, "w1", 1)
        assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})).status_code == 200
        ids = await _ids(c)
        await w2.adopt(sid, ())  # the adoption whose record never came
        rec = m.get(sid)
        if cut_short:
            rec.moving_to = ids["w2"]
            m.ledger.save(rec, ["moving_to"], durable=True)
        async with m.ledger.lock(sid):
            if cut_short:
                await m.adopt_elsewhere(rec, "w1", avoid=ids["w1"])
            else:
                with pytest.raises(errors.Conflict, match="already exists"):
                    await m.adopt_elsewhere(rec, "w1", avoid=ids["w1"])
        rec = m.get(sid)
        assert rec.moving_to is None
        assert rec.worker_id == (ids["w2"] if cut_short else ids["w1"]), rec.worker_id
