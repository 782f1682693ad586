"""`Idempotency-Key` on POST /v1/sandboxes (controlplane.idempotency), on the real control plane
and SQLite over a FakeWorker: a retry answers the first sandbox, five racing creates with one key
make one sandbox, another body is refused, keys are per tenant, a failed create frees its key,
an expired key names a new create, bad keys are refused; the key names its sandbox from its
placement on, so a retry on another server waits for a create whose server died."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
import sqlalchemy as sa

from atoll.controlplane import idempotency
from atoll.testing import FakeAtoll

KEY = "component-key"


@pytest.fixture
async def fake(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY) as f:
        yield f


def _live(f) -> list[str]:
    return [r.id for r in f.manager.live() if not r.pooled]


async def test_a_retry_answers_the_first_sandbox(fake):
    c = fake.http
    h = {"Idempotency-Key": "create-1"}
    body = {"idle_timeout_s": 0, "metadata": {"job": "a"}}
    r1 = await c.post("/v1/sandboxes", json=body, headers=h)
    assert r1.status_code == 201 and idempotency.REPLAYED_HEADER not in r1.headers, r1.text
    r2 = await c.post("/v1/sandboxes", json=body, headers=h)
    assert r2.status_code == 201 and r2.headers[idempotency.REPLAYED_HEADER] == "true", r2.text
    assert r2.json()["id"] == r1.json()["id"] and _live(fake) == [r1.json()["id"]]
    # another body with the key: refused, nothing made
    r3 = await c.post("/v1/sandboxes", json={**body, "metadata": {"job": "b"}}, headers=h)
    assert r3.status_code == 409 and r3.json()["error"]["code"] == "idempotency_key_reused", r3.text
    assert "different body" in r3.json()["error"]["message"]
    # without a key, or with another one: new sandboxes
    assert (await c.post("/v1/sandboxes", json=body)).json()["id"] != r1.json()["id"]
    assert (
        await c.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "create-2"})
    ).status_code == 201
    assert len(_live(fake)) == 3
    # the answer is the sandbox as it is now
    sid = r1.json()["id"]
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})).status_code == 200
    again = (await c.post("/v1/sandboxes", json=body, headers=h)).json()
    assert (again["id"], again["state"]) == (sid, "standby")


async def test_five_racing_creates_with_one_key_make_one_sandbox(fake):
    fake.worker.delay["create"] = 0.3  # the first is still creating when the others arrive
    c = fake.http
    h = {"Idempotency-Key": "race-1"}
    rs = await asyncio.gather(
        *(c.post("/v1/sandboxes", json={"idle_timeout_s": 0}, headers=h) for _ in range(5))
    )
    assert [r.status_code for r in rs] == [201] * 5, [r.text for r in rs]
    assert len({r.json()["id"] for r in rs}) == 1
    assert sum(r.headers.get(idempotency.REPLAYED_HEADER) == "true" for r in rs) == 4
    assert len(_live(fake)) == 1
    assert sum(1 for v, _ in fake.worker.calls if v == "create") == 1


async def test_a_failed_create_frees_its_key_and_keys_are_per_tenant(fake):
    c = fake.http
    h = {"Idempotency-Key": "flaky"}
    fake.worker.fail.add("create")
    r = await c.post("/v1/sandboxes", json={}, headers=h)
    assert r.status_code == 500, r.text
    fake.worker.fail.discard("create")
    r = await c.post("/v1/sandboxes", json={}, headers=h)
    assert r.status_code == 201 and idempotency.REPLAYED_HEADER not in r.headers, r.text
    first = r.json()["id"]
    t = await c.post("/v1/tenants", json={"name": "acme"})
    assert t.status_code == 201, t.text
    other = await c.post("/v1/sandboxes", json={"tenant_id": t.json()["id"]}, headers=h)
    assert other.status_code == 201 and other.json()["id"] != first, other.text


async def test_an_expired_key_names_a_new_create(fake):
    c = fake.http
    h = {"Idempotency-Key": "old"}
    first = (await c.post("/v1/sandboxes", json={}, headers=h)).json()["id"]
    with fake.manager.db.session.begin() as s:
        s.execute(
            sa.update(idempotency.IdempotencyRecord).values(
                created_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=25)
            )
        )
    r = await c.post("/v1/sandboxes", json={}, headers=h)
    assert r.status_code == 201 and r.json()["id"] != first and idempotency.REPLAYED_HEADER not in r.headers


@pytest.mark.parametrize("bad", ["", "x" * 256, "clé", "a\tb"])
async def test_a_bad_key_is_refused(fake, bad):
    r = await fake.http.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": bad.encode("utf-8")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    assert "Idempotency-Key" in r.json()["error"]["message"]
    assert _live(fake) == []


async def test_two_servers_on_one_database_make_one_sandbox_for_one_key(tmp_path):
    """Two control planes sharing the database (each with its own worker): racing creates with
    one key, half through each, make one sandbox; the key is a row of the database, not a lock of
    one process."""
    from atoll.testing import FakeWorker

    wa, wb = FakeWorker("a"), FakeWorker("b", installation="fake01")
    wa.delay["create"] = wb.delay["create"] = 0.3
    async with FakeAtoll(tmp_path, [wa], api_key=KEY) as one, FakeAtoll(tmp_path, [wb], api_key=KEY) as two:
        h = {"Idempotency-Key": "two-servers"}
        rs = await asyncio.gather(
            *(srv.http.post("/v1/sandboxes", json={}, headers=h) for srv in (one, two, one, two))
        )
        assert [r.status_code for r in rs] == [201] * 4, [r.text for r in rs]
        assert len({r.json()["id"] for r in rs}) == 1
        made = [v for w in (wa, wb) for v, _ in w.calls if v == "create"]
        assert len(made) == 1, (wa.calls, wb.calls)


async def test_a_retry_waits_for_a_create_its_dead_server_left(tmp_path):
    """Server one placed the key's sandbox and died before answering (its record still says
    `creating`, the key names it): the retry on server two neither makes a second sandbox nor
    takes the key over; it answers that sandbox once its record settles (as the reconciliation
    with its worker leaves it), or, when the unfinished create was dropped (its key freed), makes
    it anew. Before, the key named nothing until the create ended: the retry waited 300 s, then
    (after 600 s) made a second sandbox."""
    from atoll.testing import FakeWorker

    wa, wb = FakeWorker("a"), FakeWorker("b", installation="fake01")
    async with FakeAtoll(tmp_path, [wa], api_key=KEY) as one, FakeAtoll(tmp_path, [wb], api_key=KEY) as two:
        h = {"Idempotency-Key": "left-behind"}
        wa.delay["create"] = 0.3
        first = asyncio.ensure_future(one.http.post("/v1/sandboxes", json={}, headers=h))
        while "create" not in [v for v, _ in wa.calls]:  # the worker is asked: the key names it already
            await asyncio.sleep(0.01)
        with one.manager.db.session() as s:
            (named,) = s.scalars(sa.select(idempotency.IdempotencyRecord.sandbox_id)).all()
        assert named is not None and one.manager.db.get(named).state == "creating"
        sid = (await first).json()["id"]
        assert sid == named

        def state(value: str) -> None:
            with one.manager.db.session.begin() as s:
                s.execute(sa.text("UPDATE sandboxes SET state = :v WHERE id = :i"), {"v": value, "i": sid})

        state("creating")  # as server one's crash left it
        retry = asyncio.ensure_future(two.http.post("/v1/sandboxes", json={}, headers=h))
        await asyncio.sleep(0.5)
        assert not retry.done()  # waiting: no second sandbox, the key not taken over
        state("running")  # the worker made it: the reconciliation says so
        r = await asyncio.wait_for(retry, 10)
        assert r.status_code == 201 and r.json()["id"] == sid, r.text
        assert r.headers[idempotency.REPLAYED_HEADER] == "true"
        assert wb.calls == [] or all(v != "create" for v, _ in wb.calls)

        state("creating")
        retry = asyncio.ensure_future(two.http.post("/v1/sandboxes", json={}, headers=h))
        await asyncio.sleep(0.3)
        assert not retry.done()
        two.manager.idempotency.forget(sid)  # the worker never made it: dropped, its key freed
        state("deleted")
        r = await asyncio.wait_for(retry, 10)
        assert r.status_code == 201 and r.json()["id"] != sid, r.text
        assert idempotency.REPLAYED_HEADER not in r.headers
