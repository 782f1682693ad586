"""Several servers on one PostgreSQL database (issue 21's known limits): heartbeat freshness on the
database's clock whatever each server's says, an adoption that keeps a borrower's drain written at
the same instant, an evacuation that re-lists what reached its worker after it started, and a
sandbox an evacuation moves never moved twice at once by two servers. Fakes for the workers;
the records are a real PostgreSQL database (skipped on SQLite: one process, one clock, one server)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import types

import pytest
import sqlalchemy as sa

from atoll.controlplane import db as dbm
from atoll.controlplane import leases, lost_workers, workers
from atoll.testing import FakeAtoll, FakeWorker

LOST_S = 10.0


def _skew(monkeypatch, seconds: float) -> None:
    """This process's clock, as the servers read it, `seconds` off the true time."""
    real = dt.datetime.now
    monkeypatch.setattr(dbm, "utcnow", lambda: real(dt.UTC) + dt.timedelta(seconds=seconds))


def _registry(url: str) -> workers.WorkerRegistry:
    """One server's worker registry on its own connection to the shared database (a fresh
    Database: it reads the database's clock as a new server would)."""
    return workers.WorkerRegistry(dbm.Database(url), None, lost_after_s=LOST_S, reconcile_s=3600)  # type: ignore[arg-type]


def _holder_heartbeat(reg: workers.WorkerRegistry, name: str) -> str:
    """`reg` holds a worker (registered, ready) and hears its heartbeat now: the row's time."""
    h = reg._handle_for(name, "inst-" + name)
    h.state, h.epoch = "ready", "e"
    reg._save(h)
    reg.heartbeat(h.id, "e")
    return h.id


@pytest.fixture
def pg(database_url, database_kind):
    if database_kind != "postgresql":
        pytest.skip("servers share the records (and compare heartbeats) only on PostgreSQL")
    made: list[workers.WorkerRegistry] = []

    def new() -> workers.WorkerRegistry:
        reg = _registry(database_url)
        made.append(reg)
        return reg

    yield new
    for reg in made:
        reg.db.engine.dispose()


@pytest.mark.databases
def test_a_holder_whose_clock_is_behind_writes_a_heartbeat_others_take_as_fresh(pg, monkeypatch):
    """The holder's clock is 30 s behind: the heartbeat it writes is still fresh for a server with
    the right time (it is not taken for lost there)."""
    _skew(monkeypatch, -30)
    holder = pg()
    wid = _holder_heartbeat(holder, "w1")
    monkeypatch.undo()
    other = pg()
    assert other.held_elsewhere(other.db.get_worker(wid))


@pytest.mark.databases
def test_a_server_whose_clock_is_off_judges_heartbeats_on_the_databases_clock(pg, monkeypatch):
    """A server whose clock is 30 s ahead sees a live worker's fresh heartbeat as fresh, and one
    whose clock is 60 s behind sees a heartbeat the database took a minute ago as stale (it neither
    loses live workers nor keeps dead ones); the lost-worker count starts only for the dead one."""
    holder = pg()
    live = _holder_heartbeat(holder, "live")
    dead = _holder_heartbeat(holder, "dead")
    t = dbm.WorkerRecord.__table__
    with holder.db.engine.begin() as conn:  # its last heartbeat, a minute ago on the database's clock
        conn.execute(
            sa.update(t)
            .where(t.c.id == dead)
            .values(last_heartbeat_at=sa.text("now() - interval '60 seconds'"))
        )
    _skew(monkeypatch, 30)
    ahead = pg()
    assert ahead.held_elsewhere(ahead.db.get_worker(live))
    _skew(monkeypatch, -60)
    behind = pg()
    assert not behind.held_elsewhere(behind.db.get_worker(dead))
    assert behind.held_elsewhere(behind.db.get_worker(live))
    # the lost-worker watch of a server with that clock: it counts the dead one only
    for rec in behind.db.workers():
        behind.handles[rec.id] = workers.WorkerHandle(
            rec.id, rec.name, rec, state="lost", reason=workers.HELD_ELSEWHERE, lost_since=None
        )
    gone = lost_workers.GoneWorkers(types.SimpleNamespace(workers=behind), gone_after_s=60)  # type: ignore[arg-type]
    assert gone.notice_silent_elsewhere() == 1
    assert behind.handles[dead].lost_since is not None and behind.handles[live].lost_since is None
    # and the server's offset is the database's clock minus its own (about -60 s off: +60)
    assert abs(behind.db.check_clock() - 60) < 5
    assert time.monotonic() - behind.db._clock_read_at < 5


@pytest.mark.databases
async def test_an_adoption_keeps_a_borrowers_drain_written_at_the_same_instant(
    tmp_path, database_url, database_kind, monkeypatch
):
    """A borrower drains the worker (and asks for its evacuation) through the row while its holder
    adopts it: the holder's write at the end of the adoption keeps both — it is draining there,
    the row says so, and the evacuation asked for runs (nothing undone by the holder's copy)."""
    if database_kind != "postgresql":
        pytest.skip("only servers sharing the records drain each other's workers")
    w = FakeWorker("w1")
    async with FakeAtoll(tmp_path, [w], database_url=database_url, tier_policy=False) as f:
        reg, m = f.manager.workers, f.manager
        h = reg.handles[reg._by_name["w1"]]
        assert h.state == "ready" and not h.record.draining
        asked = {"state": "running", "pending": [], "moved": [], "left": {}, "was_running": []}
        configure = m.configure_worker

        async def and_a_borrower_drains(handle, worker):
            await configure(handle, worker)
            # the borrower's drain (workers.drain of a borrowed worker), just before the holder writes
            m.db.set_worker_columns(
                h.id, draining=True, evacuation={**asked, "started_at": dbm.utcnow().isoformat()}
            )

        monkeypatch.setattr(m, "configure_worker", and_a_borrower_drains)
        reg._stop_tasks(h)
        h.state, h.reason = "joining", "heartbeats resumed"  # taken over again (workers.heartbeat)
        await reg._adopt(h)
        rec = m.db.get_worker(h.id)
        assert rec is not None and rec.draining and rec.state == "draining", (rec.draining, rec.state)
        assert h.state == "draining" and h.record.draining
        run = m.evacuations.runs.get(h.id)
        assert run is not None and run.state in ("running", "done")  # asked for, run here


@pytest.mark.databases
async def test_a_sandbox_another_server_moves_is_not_moved_again(tmp_path, database_url, database_kind):
    """A worker taken over mid-evacuation: the server it left still moves a sandbox (it holds the
    sandbox's `move/…` lease) when this one resumes the evacuation. This one waits for that move
    instead of moving the sandbox a second time, then counts it moved; its own moves leave no
    lease behind."""
    if database_kind != "postgresql":
        pytest.skip("only servers sharing the records move sandboxes under each other")
    store: dict = {}
    w1, w2 = FakeWorker("w1", store=store), FakeWorker("w2", installation="fake01", store=store)
    async with FakeAtoll(tmp_path, [w1, w2], database_url=database_url, tier_policy=False) as f:
        m, c = f.manager, f.http
        ids = {h.name: h.id for h in m.workers.handles.values()}
        r = await c.post(f"/v1/workers/{ids['w2']}/drain", json={"draining": True, "evacuate": False})
        assert r.status_code == 202, r.text
        sids = []
        for _ in range(2):
            r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
            assert r.status_code == 201 and r.json()["worker"] == "w1", r.text
            sids.append(r.json()["id"])
        assert (await c.post(f"/v1/workers/{ids['w2']}/drain", json={"draining": False})).status_code == 200
        theirs, mine = sids
        other = leases.Leases(m.db)
        assert other.acquire(leases.move_lease(theirs), "the-other-server", 60)  # its move under way

        assert (await c.post(f"/v1/workers/{ids['w1']}/drain", json={})).status_code == 202
        for _ in range(100):
            if mine in w2.runtimes:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.6)
        assert mine in w2.runtimes and ("adopt", theirs) not in w2.calls and theirs in w1.runtimes
        assert m.evacuations.runs[ids["w1"]].state == "running"
        # the other server's move ends: the sandbox is on w2, its record says so, the lease is gone
        w2.runtimes[theirs] = w1.runtimes.pop(theirs)
        theirs_db = dbm.Database(database_url)
        try:
            rec = theirs_db.get(theirs)
            assert rec is not None
            rec.worker_id = ids["w2"]
            theirs_db.save(rec, ["worker_id"])
        finally:
            theirs_db.engine.dispose()
        assert other.drop(leases.move_lease(theirs), "the-other-server")
        ev = m.evacuations.runs[ids["w1"]]
        for _ in range(200):
            if ev.state != "running":
                break
            await asyncio.sleep(0.05)
        assert (ev.state, sorted(ev.moved), ev.left) == ("done", sorted(sids), {}), ev.record()
        assert ("adopt", theirs) not in w2.calls and not w1.runtimes
        assert [x["name"] for x in other.all() if x["name"].startswith("move/")] == []


@pytest.mark.databases
async def test_an_evacuation_lists_again_once_every_server_knows_of_the_cordon(
    tmp_path, database_url, database_kind, monkeypatch
):
    """Another server, which learns of a cordon only at its next read of the rows, places a
    sandbox on the worker just after its evacuation moved what it listed: the evacuation lists
    again (records read again) once every server knows, and moves that one too."""
    if database_kind != "postgresql":
        pytest.skip("only servers sharing the records place sandboxes on each other's workers")
    from atoll.controlplane import evacuation

    monkeypatch.setattr(evacuation, "CORDON_KNOWN_S", 2.0)
    store: dict = {}
    w1, w2 = FakeWorker("w1", store=store), FakeWorker("w2", installation="fake01", store=store)
    async with FakeAtoll(tmp_path, [w1, w2], database_url=database_url, tier_policy=False) as f:
        m, c = f.manager, f.http
        ids = {h.name: h.id for h in m.workers.handles.values()}
        r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        late = r.json()["id"]
        src, dst = (w1, w2) if r.json()["worker"] == "w1" else (w2, w1)
        drained = ids[dst.name]
        assert (await c.post(f"/v1/workers/{drained}/drain", json={})).status_code == 202
        ev = m.evacuations.runs[drained]
        await asyncio.sleep(0.5)
        assert (
            ev.state == "running" and ev.moved == []
        )  # nothing to move yet; the cordon not known everywhere
        # the other server's placement lands on the drained worker (its record written there)
        dst.runtimes[late] = src.runtimes.pop(late)
        theirs = dbm.Database(database_url)
        try:
            rec = theirs.get(late)
            assert rec is not None
            rec.worker_id = drained
            theirs.save(rec, ["worker_id"])
        finally:
            theirs.engine.dispose()
        for _ in range(200):
            if ev.state != "running":
                break
            await asyncio.sleep(0.05)
        assert (ev.state, ev.moved, ev.left) == ("done", [late], {}), ev.record()
        assert late in src.runtimes and not dst.runtimes
        w = (await c.get(f"/v1/workers/{drained}")).json()
        assert (w["sandboxes"], w["evacuated"]) == (0, True), w


@pytest.mark.databases
async def test_another_servers_create_not_yet_on_the_worker_outlives_two_reconciliations(
    tmp_path, database_url, database_kind, monkeypatch
):
    """A `creating` record another server wrote before its worker call (no runtime on the worker
    yet) is left alone by the holder's reconciliation for SHARED_CREATE_GRACE_S — the rule that a
    periodic pass acts on another server's step only when the previous pass found it too covers
    runtimes the records disagree with, not a record without a runtime: without the grace, the
    first pass drops the create in flight. (Why SHARED_CREATE_GRACE_S stays.)"""
    if database_kind != "postgresql":
        pytest.skip("only servers sharing the records create on each other's workers")
    from atoll.controlplane import lifecycle

    w = FakeWorker("w1")
    async with FakeAtoll(tmp_path, [w], database_url=database_url, tier_policy=False) as f:
        reg, m = f.manager.workers, f.manager
        h = reg.handles[reg._by_name["w1"]]

        async def in_flight() -> str:
            """Another server's create: its record written `creating`, the worker not called yet."""
            r = await f.http.post("/v1/sandboxes", json={"idle_timeout_s": 0})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            del w.runtimes[sid]
            theirs = dbm.Database(database_url)
            try:
                rec = theirs.get(sid)
                assert rec is not None
                rec.state = "creating"
                theirs.save(rec)
            finally:
                theirs.engine.dispose()
            return sid

        sid = await in_flight()
        await reg.reconcile(h)
        await reg.reconcile(h)
        assert m.db.get(sid).state == "creating"
        monkeypatch.setattr(lifecycle, "SHARED_CREATE_GRACE_S", 0.0)
        other = await in_flight()
        await reg.reconcile(h)
        assert m.db.get(other).state == "deleted"


@pytest.mark.databases
def test_activity_a_server_with_a_clock_behind_shares_is_recent_for_the_others(
    database_url, database_kind, monkeypatch
):
    """A sandbox used through a server whose clock is 60 s behind: the activity time it shares
    (`last_activity_at`, ledger.share_activity) is read by the lease holder (ledger.refresh) as
    just now, not a minute ago — both on the database's clock — so the idle policy does not put a
    sandbox in use in standby early."""
    if database_kind != "postgresql":
        pytest.skip("servers share activity times only on PostgreSQL")
    from atoll.controlplane.ledger import Ledger
    from atoll.controlplane.metrics import Metrics

    sid = "sb-aaaaaaaaaaaaaaab"
    a_db, b_db = dbm.Database(database_url), dbm.Database(database_url)
    try:
        now = dbm.utcnow()
        a_db.add(
            dbm.SandboxRecord(
                id=sid,
                tenant_id="default",
                worker_id="wk-x",
                state="running",
                template="base",
                metadata_={},
                env={},
                memory_mb=512,
                cpus=1.0,
                disk_mb=64,
                idle_timeout_s=60,
                disk_after_s=0,
                created_at=now,
                updated_at=now,
            )
        )
        a, b = Ledger(a_db, Metrics(), workers=None), Ledger(b_db, Metrics(), workers=None)  # type: ignore[arg-type]
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 60)
        _skew(monkeypatch, -60)
        a.touch(sid)
        assert a.share_activity() == 1
        monkeypatch.undo()
        b.refresh()
        assert time.monotonic() - b.activity[sid] < 10, time.monotonic() - b.activity[sid]
    finally:
        a_db.engine.dispose()
        b_db.engine.dispose()
