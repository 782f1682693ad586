"""Leases (controlplane.leases): the conditional upsert on SQLite and PostgreSQL, two servers
racing for it from threads, and two control planes on one database where only the holder runs
the installation's background loops, and the other takes over when the holder dies."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import os
import threading
import time

import pytest
import sqlalchemy as sa

from atoll.controlplane import db as dbm
from atoll.controlplane import leases, metering
from atoll.testing import FakeAtoll, FakeWorker
from tests.component.conftest import create

pytestmark = pytest.mark.databases


class Clock:
    def __init__(self):
        self.t = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.t

    def advance(self, s: float) -> None:
        self.t += dt.timedelta(seconds=s)


def test_acquire_renew_expire_release(database_url):
    """One holder at a time: a second is refused while the first's lease runs, takes it once it
    expired (and the first is then refused); a release lets the other take it at once."""
    clock = Clock()
    db_a, db_b = dbm.open_database(database_url), dbm.Database(database_url)
    a, b = leases.Leases(db_a, clock), leases.Leases(db_b, clock)
    try:
        assert a.acquire("leader", "srv-a", 15)
        assert not b.acquire("leader", "srv-b", 15)
        clock.advance(10)
        assert a.acquire("leader", "srv-a", 15)  # renewed: runs 15 s from now
        clock.advance(10)
        assert not b.acquire("leader", "srv-b", 15)
        (row,) = b.all()
        assert (row["holder"], row["expired"]) == ("srv-a", False)
        assert row["acquired_at"] == clock.t - dt.timedelta(seconds=20)  # kept across renewals
        assert row["renewed_at"] == clock.t - dt.timedelta(seconds=10)
        clock.advance(6)  # 16 s after the last renewal: expired
        assert b.all()[0]["expired"]
        assert b.acquire("leader", "srv-b", 15)
        assert not a.acquire("leader", "srv-a", 15)
        (row,) = a.all()
        assert (row["holder"], row["acquired_at"], row["expired"]) == ("srv-b", clock.t, False)
        assert not a.release("leader", "srv-a")  # not its lease: nothing changes
        assert b.release("leader", "srv-b")
        assert a.acquire("leader", "srv-a", 15)  # at once, no TTL to wait for
        assert a.acquire("other", "srv-b", 15)  # leases are independent
        assert [(r["name"], r["holder"]) for r in a.all()] == [("leader", "srv-a"), ("other", "srv-b")]
    finally:
        db_a.engine.dispose()
        db_b.engine.dispose()


def test_a_server_restarted_after_a_crash_takes_its_dead_predecessors_lease_at_once(database_url):
    """The lease of a server process on this machine and boot whose PID is gone is taken at the
    next try, without waiting out the TTL; one whose PID runs, or of another host, is not."""
    import subprocess
    import sys

    clock = Clock()
    db = dbm.open_database(database_url)
    try:
        lz = leases.Leases(db, clock)
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        me = leases.server_id()
        host, boot, _pid, _rand = me.rsplit("-", 3)
        dead = f"{host}-{boot}-{gone.pid}-deadbeef"
        alive = f"{host}-{boot}-{os.getppid()}-cafecafe"  # pytest's parent: runs
        elsewhere = f"otherhost-{boot}-{gone.pid}-deadbeef"
        assert leases.gone_here(dead) and not leases.gone_here(alive) and not leases.gone_here(elsewhere)
        assert not leases.gone_here("not-an-id") and not leases.gone_here(me)
        for holder, taken in ((alive, False), (elsewhere, False), (dead, True)):
            assert lz.acquire("leader", holder, 15)
            mine = leases.Leadership(lz, 15, server=me)
            assert mine.step() is taken, holder
            assert lz.holder("leader") == (me if taken else holder)
            if not taken:
                assert lz.release("leader", holder)
                clock.advance(0)
    finally:
        db.engine.dispose()


def test_fence_holds_only_for_the_unexpired_holder(database_url):
    clock = Clock()
    database = dbm.open_database(database_url)
    try:
        lease = leases.Leases(database, clock)
        assert lease.acquire("leader", "srv-a", 15)
        with database.engine.begin() as conn:
            assert lease.fence(conn, "leader", "srv-a")
            assert not lease.fence(conn, "leader", "srv-b")
        clock.advance(16)
        with database.engine.begin() as conn:
            assert not lease.fence(conn, "leader", "srv-a")
    finally:
        database.engine.dispose()


def test_servers_racing_from_threads_get_one_holder(database_url):
    """8 servers (each its own Database, engine and connections) try at once, in 30 rounds where
    the lease has expired or been released before each: exactly one gets it every round."""
    dbm.open_database(database_url).engine.dispose()
    n, rounds = 8, 30
    databases = [dbm.Database(database_url) for _ in range(n)]
    barrier = threading.Barrier(n)
    try:
        lease = [leases.Leases(d) for d in databases]

        def contend(i: int) -> list[bool]:
            won = []
            for _ in range(rounds):
                barrier.wait(30)
                won.append(lease[i].acquire("leader", f"srv-{i}", 60))
                barrier.wait(30)
                if won[-1]:
                    assert lease[i].release("leader", f"srv-{i}")
            return won

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(contend, range(n)))
        for r in range(rounds):
            assert sum(results[i][r] for i in range(n)) == 1, r
    finally:
        for d in databases:
            d.engine.dispose()


# ---- two control planes on one database ----------------------------------------------------------

TTL = 1.0
# the takeover test's: two servers, their worker and the test share one event loop, and on a loaded
# machine (the suite on five processes) a stall past a 1 s TTL cost the first server the lease
# before its policy ran. The others keep 1 s: activity is shared at each renewal (TTL/3), and
# their idle timeouts are set against that.
HOLDER_TTL = 3.0
KEY = "leases-key"


async def _until(what, check, timeout: float = 15.0):
    """Poll `check()` until it is truthy (its value), failing with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _servers(tmp_path, url: str, worker: FakeWorker, ttl: float = TTL, **kw):
    """Two control planes on one database over one worker (each its records' cache, policy,
    pool keeper, meter and lease keeper; one event loop), the first started first: it holds the
    lease. Both are stopped at the end, whatever a test did to them."""
    secrets_key = b"s" * 32  # one installation: API keys are keyed with it
    a = FakeAtoll(
        tmp_path / "a",
        [worker],
        api_key=KEY,
        database_url=url,
        secrets_key=secrets_key,
        lease_ttl_s=ttl,
        **kw,
    )
    b = FakeAtoll(
        tmp_path / "b",
        [worker],
        api_key=KEY,
        database_url=url,
        secrets_key=secrets_key,
        lease_ttl_s=ttl,
        **kw,
    )
    started = []
    try:
        for f in (a, b):
            await f.start()
            started.append(f)
        yield a, b
    finally:
        for f in reversed(started):
            await f.stop()


def _pauses(worker: FakeWorker, sid: str) -> int:
    return sum(1 for c in worker.calls if c == ("pause", sid))


def _spy_pauses(f: FakeAtoll, name: str, log: list[tuple[str, str]]) -> None:
    """Record which server's manager paused what (the tier policy pauses through it)."""
    pause = f.manager.pause

    async def spied(sid, tier, **kw):
        log.append((name, sid))
        return await pause(sid, tier, **kw)

    f.manager.pause = spied  # type: ignore[method-assign]


async def test_only_the_holder_runs_the_policy_and_another_takes_over_when_it_dies(tmp_path, database_url):
    """Both servers serve requests; only the lease's holder pauses idle sandboxes — also those
    made through the other server, each exactly once (the other's policy, which knows the
    sandboxes made through it, pauses none). When the holder dies (stops renewing, without
    releasing), the other takes the lease within TTL plus a renewal period and from then on it
    alone pauses what goes idle (sandboxes made through the dead one included)."""
    worker = FakeWorker("shared")
    paused: list[tuple[str, str]] = []
    async with _servers(tmp_path, database_url, worker, ttl=HOLDER_TTL) as (a, b):
        _spy_pauses(a, "a", paused)
        _spy_pauses(b, "b", paused)
        assert a.manager.leader.held and not b.manager.leader.held
        leases_a = (await a.http.get("/v1/leases")).json()
        leases_b = (await b.http.get("/v1/leases")).json()
        assert leases_a["server_id"] == a.manager.leader.server_id != leases_b["server_id"]
        (row,) = leases_b["items"]
        assert (row["name"], row["holder"], row["expired"], row["this_server"]) == (
            "leader",
            a.manager.leader.server_id,
            False,
            False,
        )
        assert leases_a["items"][0]["this_server"]

        idle = {"idle_timeout_s": 0.3, "disk_after_s": 0}
        sids = [await create(f.http, **idle) for f in (a, b, a, b)]

        def standby(sid):
            return a.manager.db.get(sid).state == "standby"

        await _until("every sandbox in standby", lambda: all(standby(s) for s in sids))
        for _ in range(10):  # both policies pass several times more (0.5 s apart): nobody pauses again
            await asyncio.sleep(0.1)
        assert sorted(paused) == sorted(("a", s) for s in sids), paused
        assert [_pauses(worker, s) for s in sids] == [1, 1, 1, 1], worker.calls

        # the holder dies: it stops renewing and releases nothing
        await a.manager.leader.aclose(release=False)
        died = time.monotonic()
        assert not b.manager.leader.held  # its lease runs until TTL after the last renewal
        await _until(
            "the other server takes the lease", lambda: b.manager.leader.held, timeout=HOLDER_TTL * 3 + 5
        )
        took = time.monotonic() - died
        assert took <= HOLDER_TTL + HOLDER_TTL / 3 + 1.0, took  # TTL after the last renewal, at b's next try
        (row,) = (await b.http.get("/v1/leases")).json()["items"]
        assert (row["holder"], row["this_server"]) == (b.manager.leader.server_id, True)

        # requests still go through the dead holder's API (its process is "gone" for the loops only)
        paused.clear()
        late = [await create(f.http, **idle) for f in (a, b)]
        for i, s in enumerate(sids):  # a call on either server resumes it; idle again: paused again
            r = await (a, b)[i % 2].http.post(f"/v1/sandboxes/{s}/exec", json={"cmd": ["true"]})
            assert r.status_code == 200, r.text
        await _until("every sandbox in standby again", lambda: all(standby(s) for s in sids + late))
        for _ in range(10):
            await asyncio.sleep(0.1)
        assert sorted(paused) == sorted(("b", s) for s in sids + late), paused
        assert [_pauses(worker, s) for s in late] == [1, 1], worker.calls
        assert [_pauses(worker, s) for s in sids] == [2, 2, 2, 2], worker.calls


async def test_one_pool_is_kept_once_across_servers_and_after_a_takeover(tmp_path, database_url):
    """The built-in pool (ATOLL_DEFAULT_POOL 2 on both servers) holds 2 members, not 4: only the
    holder refills; after the holder died, the new holder counts the members the old one made
    (it reads the records at takeover) and makes none more."""
    worker = FakeWorker("shared")
    async with _servers(tmp_path, database_url, worker, default_pool=2) as (a, b):

        def pooled() -> list[str]:
            return [r.id for r in a.manager.db.list() if r.pooled]

        await _until(
            "the pool filled",
            lambda: len(pooled()) == 2 and all(a.manager.db.get(s).state == "standby" for s in pooled()),
        )
        members = sorted(pooled())
        await a.manager.leader.aclose(release=False)
        await _until("the other server takes the lease", lambda: b.manager.leader.held, timeout=TTL * 3 + 5)
        for _ in range(20):  # b's keeper passes (every 1 s, and at once at takeover)
            await asyncio.sleep(0.1)
        assert sorted(pooled()) == members
        assert sum(1 for c in worker.calls if c[0] == "create") == 2, worker.calls
        # a claim through b (its records were read at takeover) is refilled by b, once
        r = await b.http.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201 and r.json()["id"] in members, r.text
        await _until(
            "the pool refilled",
            lambda: len(pooled()) == 2 and all(a.manager.db.get(s).state == "standby" for s in pooled()),
        )
        for _ in range(20):
            await asyncio.sleep(0.1)
        assert len(pooled()) == 2 and sum(1 for c in worker.calls if c[0] == "create") == 3, worker.calls


async def test_only_the_holder_meters_and_a_stale_holder_writes_nothing(tmp_path, database_url):
    """Both meters see the same sandbox; only the holder's accrual is written (one server's
    worth, not two), and a flush from a server that does not hold the lease is refused in its
    transaction (the fence), leaving the records as they were."""
    worker = FakeWorker("shared")
    async with _servers(tmp_path, database_url, worker, tier_policy=False) as (a, b):
        clock = [time.time()]
        for f in (a, b):
            f.meter.clock = lambda: clock[0]
        sid = await create(b.http)  # in both caches: b made it, a reads it at its next renewal
        await _until("the holder sees it", lambda: sid in a.manager.ledger.cache)
        a.meter.tick(clock[0], flush=True)
        b.meter.tick(clock[0], flush=True)  # b's meter starts counting too (not the holder)
        clock[0] += 100
        a.meter.tick(clock[0], flush=True)
        b.meter.tick(clock[0], flush=True)  # refused by the fence
        gb = a.manager.get(sid).memory_mb / 1024
        with a.manager.db.engine.connect() as conn:
            t = metering.UsageInterval.__table__
            got = conn.execute(
                sa.select(sa.func.sum(t.c.memory_gb_seconds)).where(t.c.subject == sid)
            ).scalar_one()
        assert got == pytest.approx(gb * 100, rel=0.01)
        r = await b.http.get("/v1/usage", params={"group_by": "sandbox"})  # b answers what a wrote
        assert r.status_code == 200, r.text
        (it,) = [i for i in r.json()["items"] if i["sandbox_id"] == sid]
        assert it["memory_gb_seconds"] == pytest.approx(gb * 100, rel=0.01)


async def test_a_sandbox_used_through_another_server_is_not_idle_for_the_holder(tmp_path, database_url):
    """The holder's policy counts calls served by the other server (shared as the record's
    `last_activity_at` at each renewal): a sandbox kept busy through the other server — short
    calls, then one long call in flight — is not paused; once the calls stop, it is, once."""
    worker = FakeWorker("shared")
    async with _servers(tmp_path, database_url, worker) as (a, b):
        sid = await create(b.http, idle_timeout_s=2.5, disk_after_s=0)
        await _until("the holder sees it", lambda: sid in a.manager.ledger.cache)
        until = time.monotonic() + 6  # > 2 idle timeouts
        while time.monotonic() < until:
            r = await b.http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.3)
        worker.delay["exec"] = 6.0  # one call in flight for > 2 idle timeouts
        r = await b.http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sleep", "6"]})
        assert r.status_code == 200, r.text
        worker.delay.pop("exec")
        assert _pauses(worker, sid) == 0, worker.calls
        await _until("paused once idle", lambda: a.manager.db.get(sid).state == "standby")
        assert _pauses(worker, sid) == 1, worker.calls
