"""Leases (controlplane.leases): the conditional upsert on SQLite and PostgreSQL, two servers
racing for it from threads, and two control planes on one database where only the holder runs
the installation's background loops, and the other takes over when the holder dies."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import threading

import pytest

from atoll.controlplane import db as dbm
from atoll.controlplane import leases

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
