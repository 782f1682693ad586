"""The records on SQLite and on PostgreSQL: the same Alembic migrations build, from nothing, exactly
the schema the models declare (autogenerate finds no difference), and undo themselves; the
database URL is checked at start; and admission stays atomic when two control planes share one
database (the tenant row lock on PostgreSQL, BEGIN IMMEDIATE on SQLite)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import itertools
import os
import subprocess
import sys
import threading
import time

import httpx
import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from atoll.controlplane import audit, auth, leases, metering, settings  # noqa: F401  (their tables join Base.metadata)
from atoll.controlplane import db as dbm
from atoll.core import config
from atoll.testing import FakeAtoll, FakeWorker, free_port
from atoll.testing import postgres as pgtesting

_fresh = itertools.count()


@pytest.fixture
def empty_url(request, database_kind, tmp_path) -> str:
    """An empty database (no tables at all) of `database_kind`."""
    if database_kind == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    pg = request.getfixturevalue("postgres")
    name = f"empty_{next(_fresh)}"
    url = pg.create_database(name)
    request.addfinalizer(lambda: pg.drop_database(name))
    return url


def _differences(url: str) -> list:
    engine = sa.create_engine(dbm.engine_url(url))
    try:
        with engine.connect() as conn:
            mc = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return compare_metadata(mc, dbm.Base.metadata)
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(dbm.engine_url(url))
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.databases
def test_migrations_from_nothing_build_the_models_schema_and_undo(empty_url):
    database = dbm.open_database(empty_url)
    database.engine.dispose()
    assert _differences(empty_url) == []
    models = set(dbm.Base.metadata.tables)
    assert models <= _tables(empty_url)
    cfg = dbm.alembic_config(empty_url)
    command.downgrade(cfg, "base")
    assert _tables(empty_url) & models == set()
    command.upgrade(cfg, "head")
    assert _differences(empty_url) == []


@pytest.mark.parametrize(
    "url, said",
    [
        ("mysql://u:hunter2@db/atoll", "SQLite or PostgreSQL"),
        ("postgresql://u:hunter2@db/", "names no database"),
        ("postgresql+psycopg2://u:hunter2@db/atoll", "driver 'psycopg2' is not supported"),
        ("sqlite://", "names no file"),
        ("no url at all", "is not a database URL"),
    ],
)
def test_a_bad_database_url_is_refused_at_start_by_name(url, said):
    with pytest.raises(config.SettingsError) as e:
        settings.load({"ATOLL_DATABASE_URL": url, "ATOLL_HOME": "/nonexistent"})
    assert str(e.value).startswith("ATOLL_DATABASE_URL=") and said in str(e.value)
    assert "hunter2" not in str(e.value)


def test_postgresql_urls_take_psycopg_3_and_are_logged_without_the_password():
    s = settings.load(
        {"ATOLL_DATABASE_URL": "postgres://u:p%40ss@db:6432/atoll", "ATOLL_HOME": "/nonexistent"}
    )
    assert s.database_url == "postgresql+psycopg://u:p%40ss@db:6432/atoll"
    assert s.redacted()["database_url"] == "postgresql+psycopg://u:***@db:6432/atoll"
    assert dbm.engine_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"


def test_an_unreachable_database_stops_the_server_with_a_message(tmp_path, postgres):
    """`atoll server` against a PostgreSQL that refuses the login: exit status 2 and one line
    naming the URL (password hidden) and the reason — no traceback."""
    bad = postgres.url("postgres").replace(postgres.password, "wrong-password")
    env = {"ATOLL_HOME": str(tmp_path), "ATOLL_DATABASE_URL": bad, "PATH": "/usr/bin:/bin"}
    env["PYTHONPATH"] = ":".join(sys.path)
    r = subprocess.run(
        [sys.executable, "-m", "atoll", "server", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "cannot be opened" in r.stderr and "password authentication failed" in r.stderr, r.stderr
    assert "wrong-password" not in r.stderr and "Traceback" not in r.stderr, r.stderr


ROUNDS = 3


def _control_plane(
    directory, name: str, url: str, shared: dict, barrier: threading.Barrier
) -> list[list[int]]:
    """A control plane in a thread of its own with its own event loop (as a second server
    process would be): the first makes a tenant with max_running 3 per round; in each round both
    send 5 creates at once for that round's tenant. The status codes, by round."""
    key = b"k" * 32  # one installation: the same secrets key on both servers

    async def main() -> list[list[int]]:
        fake = FakeAtoll(directory, [FakeWorker(name)], database_url=url, tier_policy=False, secrets_key=key)
        async with fake:
            if not shared:
                keys = []
                for i in range(ROUNDS):
                    r = await fake.http.post(
                        "/v1/tenants", json={"name": f"two{i}", "quotas": {"max_running": 3}}
                    )
                    assert r.status_code == 201, r.text
                    r = await fake.http.post(f"/v1/tenants/{r.json()['id']}/keys", json={})
                    keys.append(r.json()["key"])
                shared["keys"] = keys
            out = []
            async with httpx.AsyncClient(transport=fake.transport, base_url="http://atoll") as c:
                for tenant_key in shared["keys"]:
                    barrier.wait(30)  # both ready: the round starts on both at once
                    headers = {"Authorization": f"Bearer {tenant_key}"}
                    rs = await asyncio.gather(
                        *(
                            c.post("/v1/sandboxes", json={"idle_timeout_s": 0}, headers=headers)
                            for _ in range(5)
                        )
                    )
                    for r in rs:
                        assert r.status_code == 201 or r.json()["error"]["code"] == "quota_exceeded", r.text
                    out.append([r.status_code for r in rs])
            barrier.wait(30)  # neither stops while the other still creates
            return out

    return asyncio.run(main())


@pytest.mark.databases
def test_two_control_planes_on_one_database_admit_atomically(tmp_path, database_url):
    """Two control planes (each its own thread, event loop, in-memory reservations and fake
    worker) share one database: 10 creates at once, 5 on each, for a tenant with max_running 3
    give exactly 3 (in each of ROUNDS rounds) — neither knows of the other's admissions in
    flight, so only the database's lock (PostgreSQL: the tenant's row; SQLite: BEGIN IMMEDIATE)
    keeps the count. (Without it, 4 or more got through in most runs.)"""
    shared: dict = {}
    barrier = threading.Barrier(2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_control_plane, tmp_path / "a", "wa", database_url, shared, barrier)
        while not shared and not first.done():  # the tenants exist before the second starts
            time.sleep(0.01)
        second = pool.submit(_control_plane, tmp_path / "b", "wb", database_url, shared, barrier)
        a, b = first.result(60), second.result(60)
    for i in range(ROUNDS):
        assert (a[i] + b[i]).count(201) == 3, (i, a[i], b[i])
    engine = sa.create_engine(dbm.engine_url(database_url))
    try:
        with engine.connect() as conn:
            live = conn.execute(
                sa.select(dbm.SandboxRecord.tenant_id, sa.func.count())
                .where(dbm.SandboxRecord.state.in_(("creating", "running")))
                .group_by(dbm.SandboxRecord.tenant_id)
            ).all()
    finally:
        engine.dispose()
    assert sorted(n for _, n in live) == [3] * ROUNDS, live


def _record(sid: str, **kw) -> dbm.SandboxRecord:
    now = dt.datetime.now(dt.UTC)
    fields = dict(
        id=sid,
        tenant_id="default",
        worker_id="wk-x",
        state="running",
        template="base",
        metadata_={"team": "a", "ü": "ß"},
        env={"A": "1"},
        memory_mb=512,
        cpus=1.5,
        disk_mb=64,
        idle_timeout_s=0,
        disk_after_s=0,
        created_at=now,
        updated_at=now,
    )
    fields.update(kw)
    return dbm.SandboxRecord(**fields)


@pytest.mark.databases
def test_a_write_from_a_stale_copy_is_refused_not_lost(database_url):
    """Two servers read one sandbox; the first writes; the second's write from its older copy
    matches no row and fails with the retryable `sandbox_changed` — the first write stands (no
    lost update) — and once it reads the record again its write goes through."""
    from atoll.core import errors

    a, b = dbm.open_database(database_url), dbm.Database(database_url)
    try:
        a.add(_record("sb-cccccccccccccccc"))
        mine, theirs = a.get("sb-cccccccccccccccc"), b.get("sb-cccccccccccccccc")
        assert mine.version == theirs.version == 0
        mine.state, mine.standby_tier = "standby", "disk"
        a.save(mine, fields=["state", "standby_tier"])
        assert mine.version == 1 == a.version(mine.id) == b.version(mine.id)
        theirs.state = "failed"
        with pytest.raises(errors.SandboxChanged) as e:
            b.save(theirs, fields=["state"])
        assert (
            e.value.code == "sandbox_changed" and e.value.retryable and "sb-cccccccccccccccc" in str(e.value)
        )
        got = a.get(mine.id)
        assert (got.state, got.standby_tier, got.version) == ("standby", "disk", 1)
        again = b.get(mine.id)
        again.metadata_ = {"k": "v"}
        b.save(again, fields=["metadata_"])
        got = a.get(mine.id)
        assert (got.state, got.metadata_, got.version) == ("standby", {"k": "v"}, 2)
        assert a.version("sb-dddddddddddddddd") is None
    finally:
        a.engine.dispose()
        b.engine.dispose()


@pytest.mark.databases
async def test_a_server_reads_again_what_another_server_wrote(tmp_path, database_url, database_kind):
    """Another server (a second Database on the same records) changes a sandbox's labels. On
    PostgreSQL — where several servers share the records — this server sees the change at its
    next call (its cached copy's version is stale) and its own change then goes through; on
    SQLite, which one server owns, its write from the stale copy is refused with `409
    sandbox_changed` (never a lost update) and the call after it reads the record again."""
    fake = FakeAtoll(tmp_path / "a", [FakeWorker("wa")], database_url=database_url, tier_policy=False)
    async with fake:
        r = await fake.http.post("/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"by": "a"}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        other = dbm.Database(database_url)
        try:
            rec = other.get(sid)
            rec.metadata_ = {"by": "other"}
            other.save(rec, fields=["metadata_"])
        finally:
            other.engine.dispose()
        r = await fake.http.patch(f"/v1/sandboxes/{sid}", json={"metadata": {"by": "a", "n": "2"}})
        if database_kind == "postgresql":
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_changed", r.text
            assert r.json()["error"]["retryable"] is True
            r = await fake.http.get(f"/v1/sandboxes/{sid}")
            assert r.json()["metadata"] == {"by": "other"}, r.text  # refused: the other write stands
            r = await fake.http.patch(f"/v1/sandboxes/{sid}", json={"metadata": {"by": "a", "n": "2"}})
            assert r.status_code == 200, r.text
        r = await fake.http.get(f"/v1/sandboxes/{sid}")
        assert r.json()["metadata"] == {"by": "a", "n": "2"}, r.text
        r = await fake.http.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code in (200, 204), r.text


@pytest.mark.databases
async def test_a_worker_another_server_hears_is_not_marked_lost(database_url, database_kind):
    """A server starting on shared records (PostgreSQL) leaves a worker whose heartbeat another
    server wrote lately as that server wrote it — lost here only (no connection), never settled
    (no `lost_since`) — while one silent for longer, or any on SQLite (one server), is lost as
    before. Without this a second server marked a live worker lost for everyone and, after
    ATOLL_WORKER_GONE_S, would have failed or moved its running sandboxes."""
    from atoll.controlplane import workers as workers_mod

    d = dbm.open_database(database_url)
    try:
        now = dbm.utcnow()
        for wid, name, ago in (("wk-aaaaaaaaaaaaaaaa", "alive", 2), ("wk-bbbbbbbbbbbbbbbb", "silent", 60)):
            d.put_worker(
                dbm.WorkerRecord(
                    id=wid,
                    name=name,
                    state="ready",
                    capacity={},
                    registered_at=now,
                    last_heartbeat_at=now - dt.timedelta(seconds=ago),
                )
            )
        reg = workers_mod.WorkerRegistry(d, listener=None, lost_after_s=15, reconcile_s=30)  # type: ignore[arg-type]
        reg.load()
        try:
            alive, silent = reg.handles["wk-aaaaaaaaaaaaaaaa"], reg.handles["wk-bbbbbbbbbbbbbbbb"]
            assert alive.state == silent.state == "lost"  # neither has a connection to this server
            assert silent.lost_since is not None and d.get_worker(silent.id).state == "lost"
            if database_kind == "postgresql":
                assert alive.lost_since is None and alive.reason == workers_mod.HELD_ELSEWHERE
                assert d.get_worker(alive.id).state == "ready"  # the other server's row stands
            else:
                assert alive.lost_since is not None and d.get_worker(alive.id).state == "lost"
        finally:
            await reg.aclose()
    finally:
        d.engine.dispose()


@pytest.mark.databases
async def test_a_worker_held_elsewhere_that_goes_silent_everywhere_is_counted_as_lost(
    database_url, database_kind
):
    """A worker this server took to be alive on another server (no `lost_since`: never settled
    here) is counted once no server has written its heartbeat for ATOLL_WORKER_LOST_S plus the
    interval they write them at: the server it had joined lost it too and may not be the leader,
    which alone settles (found by tests/cluster: a worker SIGKILLed on a non-leader server kept its
    sandboxes `worker_unavailable` for ever). One heard lately stays uncounted."""
    import types

    from atoll.controlplane import lost_workers
    from atoll.controlplane import workers as workers_mod

    d = dbm.open_database(database_url)
    try:
        now = dbm.utcnow()
        for wid, name, ago in (("wk-eeeeeeeeeeeeeeee", "alive", 2), ("wk-ffffffffffffffff", "dead", 10)):
            d.put_worker(
                dbm.WorkerRecord(
                    id=wid,
                    name=name,
                    state="ready",
                    capacity={},
                    registered_at=now,
                    last_heartbeat_at=now - dt.timedelta(seconds=ago),
                )
            )
        reg = workers_mod.WorkerRegistry(d, listener=None, lost_after_s=4, reconcile_s=30)  # type: ignore[arg-type]
        reg.load()
        try:
            gone = lost_workers.GoneWorkers(types.SimpleNamespace(workers=reg), gone_after_s=5)  # type: ignore[arg-type]
            alive, dead = reg.handles["wk-eeeeeeeeeeeeeeee"], reg.handles["wk-ffffffffffffffff"]
            if database_kind == "sqlite":  # one server: both lost (and counted) at load already
                assert alive.lost_since is not None and dead.lost_since is not None
                assert gone.notice_silent_elsewhere() == 0
                return
            # load() counts the one silent for 10 s itself; a server that read it while it was
            # heard (or that lost it on a refused call, controlplane.workers `_lose`) holds it so:
            dead.reason, dead.lost_since = workers_mod.HELD_ELSEWHERE, None
            assert alive.reason == workers_mod.HELD_ELSEWHERE and alive.lost_since is None
            assert gone.notice_silent_elsewhere() == 1
            assert dead.lost_since is not None and "no server has heard from it since" in dead.reason
            assert alive.lost_since is None and alive.reason == workers_mod.HELD_ELSEWHERE
            assert gone.notice_silent_elsewhere() == 0  # counted once
        finally:
            await reg.aclose()
    finally:
        d.engine.dispose()


@pytest.mark.databases
async def test_a_worker_taken_over_keeps_what_another_server_wrote_and_an_outage_loses_no_worker(
    database_url, database_kind
):
    """A server taking a worker over (it registers here again) starts from the record as the
    database has it — on PostgreSQL another server may have drained it meanwhile (found by a
    review: the drain was silently undone). And missed heartbeats right after the records
    database failed (their key is checked there) do not make a worker lost."""
    import time as _time

    from atoll.controlplane import workers as workers_mod

    d = dbm.open_database(database_url)
    other = dbm.Database(database_url)
    try:
        now = dbm.utcnow()
        d.put_worker(
            dbm.WorkerRecord(
                id="wk-cccccccccccccccc",
                name="w",
                installation="i1",
                state="ready",
                capacity={},
                registered_at=now,
                last_heartbeat_at=now,
            )
        )
        reg = workers_mod.WorkerRegistry(d, listener=None, lost_after_s=15, reconcile_s=30)  # type: ignore[arg-type]
        reg.load()
        try:
            rec = other.get_worker("wk-cccccccccccccccc")
            rec.draining, rec.evacuation = True, {"state": "running"}
            other.put_worker(rec)  # another server drains it
            h = reg._handle_for("w", "i1")
            if database_kind == "postgresql":
                assert h.record.draining and h.record.evacuation == {"state": "running"}
            else:  # one server per SQLite file: its own copy stands
                assert not h.record.draining
            h.state, h.local, h.last_seen = "ready", False, _time.monotonic() - 60
            assert reg.silent(_time.monotonic()) == [h]
            d.trouble_at = _time.monotonic() - 1  # the database failed a second ago
            assert reg.silent(_time.monotonic()) == []
            assert reg.silent(_time.monotonic() + 15) == [h]
            # a worker another server made after this one started is learnt (listed, not settled)
            d.put_worker(
                dbm.WorkerRecord(
                    id="wk-dddddddddddddddd",
                    name="late",
                    installation="i2",
                    state="ready",
                    capacity={},
                    registered_at=now,
                    last_heartbeat_at=dbm.utcnow(),
                )
            )
            reg.learn_others()
            late = reg.handles["wk-dddddddddddddddd"]
            assert late.state == "lost" and reg._by_name["late"] == late.id
            if database_kind == "postgresql":
                assert late.lost_since is None and late.reason == workers_mod.HELD_ELSEWHERE
        finally:
            await reg.aclose()
    finally:
        d.engine.dispose()
        other.engine.dispose()


@pytest.mark.databases
def test_records_round_trip_and_pool_claims_count_across_servers(database_url):
    """What the ledger writes comes back the same on both databases (JSON, booleans, floats,
    times in UTC, server defaults), a save writes only its fields, and pool claims counted by two
    Database objects at once (two servers) add up — the first claim's INSERT race included."""
    d = dbm.open_database(database_url)
    try:
        rec = _record(
            "sb-aaaaaaaaaaaaaaaa", network={"allow_out": ["10.0.0.0/8"]}, mounts=[{"kind": "volume"}]
        )
        d.add(rec)
        got = d.get(rec.id)
        assert got is not None and (got.metadata_, got.env, got.network, got.mounts) == (
            {"team": "a", "ü": "ß"},
            {"A": "1"},
            {"allow_out": ["10.0.0.0/8"]},
            [{"kind": "volume"}],
        )
        assert (got.pooled, got.on_timeout, got.resume_failures, got.cpus) == (False, "pause", 0, 1.5)
        created = got.created_at if got.created_at.tzinfo else got.created_at.replace(tzinfo=dt.UTC)
        assert abs(created - rec.created_at) < dt.timedelta(milliseconds=1)
        rec.state, rec.standby_tier, rec.memory_mb = "standby", "disk", 4096
        d.save(rec, fields=["state", "standby_tier"], durable=True)
        got = d.get(rec.id)
        assert (got.state, got.standby_tier, got.memory_mb) == ("standby", "disk", 512)
        d.add(_record("sb-bbbbbbbbbbbbbbbb", state="deleted"))
        assert [r.id for r in d.list()] == [rec.id]
        assert d.count_by_state() == {"standby": 1, "deleted": 1}

        other = dbm.Database(database_url)  # a second server's
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                for f in [
                    pool.submit(lambda db=db: [db.count_pool_claim("default", "web") for _ in range(20)])
                    for db in (d, other)
                ]:
                    f.result(60)
            assert d.pool_claimed("default", "web") == other.pool_claimed("default", "web") == 40
        finally:
            other.engine.dispose()
    finally:
        d.engine.dispose()


def test_the_test_cluster_stops_its_own_postmaster_and_leaves_nothing(postgres):
    """(`postgres`, the session's cluster, only for its skip/fail when PostgreSQL is missing.)"""
    with pgtesting.PostgresCluster() as pg:
        pid, directory = pg.pid, pg.dir
        assert pid is not None and directory is not None
        with psycopg.connect(pg.socket_url()) as conn:  # the socket, trusted
            assert conn.execute("SELECT current_setting('listen_addresses')").fetchone() == ("127.0.0.1",)
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            psycopg.connect(pg.url().replace(pg.password, "nope"))  # TCP needs the password
    assert not os.path.exists(directory)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_missing_postgresql_programs_are_named(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOLL_PG_BINDIR", str(tmp_path))
    with pytest.raises(pgtesting.PostgresMissing, match="holds no executable initdb"):
        pgtesting.PostgresCluster()


@pytest.mark.databases
@pytest.mark.parametrize(
    "method, path, body",
    [
        ("POST", "/v1/sandboxes", {"idle_timeout_s": 0, "template": "x\u0000y"}),
        ("GET", "/v1/sandboxes?metadata.a=x%00y", None),
        ("GET", "/v1/sandboxes?template=x%00y", None),
        ("GET", "/v1/audit?action=x%00y", None),
        ("GET", "/v1/templates/x%00y", None),
        ("DELETE", "/v1/keys/x%00y", None),
    ],
)
async def test_a_nul_character_is_never_a_server_error(fake, method, path, body):
    """PostgreSQL refuses a NUL in text where SQLite takes it: a name or filter with one is the
    caller's mistake (400, or what SQLite answers), never a 500."""
    r = await fake.http.request(method, path, json=body)
    assert r.status_code in (200, 400, 404), r.text
    if fake.manager.db.dialect == "postgresql":
        assert r.status_code == 400 and "NUL" in r.json()["error"]["message"], r.text


@pytest.mark.databases
def test_a_step_whose_outcome_another_server_recorded_first_is_written_not_refused(
    database_url, database_kind
):
    """A server resumes a sandbox through a worker another server holds; that server, following
    the worker's own report, records the resume first. On shared records (PostgreSQL) the
    stepping server's write is tried again on the record as read again — the sandbox runs, the
    step's own fields are written — instead of answering `409 sandbox_changed` for a resume that
    happened. A record that moved elsewhere meanwhile (failed) still refuses the write; on SQLite
    (one server) every stale write is refused as before."""
    from atoll.controlplane.ledger import Ledger
    from atoll.controlplane.metrics import Metrics
    from atoll.core import errors
    from atoll.core.lifecycle import Verb

    d, other = dbm.open_database(database_url), dbm.Database(database_url)
    try:
        ledger = Ledger(d, Metrics(), workers=None)  # type: ignore[arg-type]
        for sid, theirs in (("sb-eeeeeeeeeeeeeeee", "running"), ("sb-ffffffffffffffff", "failed")):
            d.add(_record(sid, state="standby", standby_tier="disk", resume_failures=2))
            mine = d.get(sid)
            rec = other.get(sid)  # the holder follows the worker: its write comes first
            rec.state, rec.standby_tier = theirs, None
            other.save(rec, fields=["state", "standby_tier"])
            if database_kind == "postgresql" and theirs == "running":
                ledger.persist(mine, Verb.RESUME, resume_failures=0)
                got = d.get(sid)
                assert (got.state, got.resume_failures, got.version) == ("running", 0, 2)
                assert mine.version == 2 and ledger.cache.get(sid) is mine
            else:
                with pytest.raises(errors.SandboxChanged):
                    ledger.persist(mine, Verb.RESUME, resume_failures=0)
                got = d.get(sid)
                assert (got.state, got.resume_failures, got.version) == (theirs, 2, 1)
    finally:
        d.engine.dispose()
        other.engine.dispose()
