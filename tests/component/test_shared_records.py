"""Several servers on one PostgreSQL database (issue 21's known limits): heartbeat freshness on the
database's clock whatever each server's says, an adoption that keeps a borrower's drain written at
the same instant, an evacuation that re-lists what reached its worker after it started, and a
sandbox an evacuation moves never moved twice at once by two servers. Fakes for the workers;
the records are a real PostgreSQL database (skipped on SQLite: one process, one clock, one server)."""

from __future__ import annotations

import datetime as dt
import time
import types

import pytest
import sqlalchemy as sa

from atoll.controlplane import db as dbm
from atoll.controlplane import lost_workers, workers
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
