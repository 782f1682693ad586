"""The built-in `base` template's pool (ATOLL_DEFAULT_POOL) on the control plane, over a FakeWorker:
it fills, counts against the worker's memory, serves a create that names no template, and a create
it cannot serve restores instead; its size is the server's setting, not PUT's."""

from __future__ import annotations

import asyncio
import os

import pytest

from atoll.controlplane import pools, settings
from atoll.core import config
from atoll.testing import FakeAtoll, FakeWorker
from tests.component.conftest import KEY


async def _pool(c, want) -> dict:
    for _ in range(300):
        pool = (await c.get("/v1/templates/base/pool")).json()
        if want(pool):
            return pool
        await asyncio.sleep(0.02)
    raise AssertionError(f"the base pool never got there: {pool}")


async def test_the_default_pool_fills_and_a_default_create_claims_from_it(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY, default_pool=2) as fake:
        c = fake.http
        pool = await _pool(c, lambda p: p["ready"] == 2)
        assert (pool["min"], pool["max"], pool["desired"], pool["memory_mb"]) == (2, 2, 2, 512), pool
        assert pool["claimed"] == 0 and pool["build_id"] is None, pool
        assert (await c.get("/v1/sandboxes")).json()["items"] == []  # pooled sandboxes are not listed
        pooled = {r.id for r in fake.manager.live() if r.pooled}
        assert len(pooled) == 2
        # frozen in the memory tier: they hold their worker's memory
        worker = (await c.get("/v1/workers")).json()["items"][0]
        assert worker["allocated"]["memory_mb"] == 2 * 512, worker

        r = await c.post("/v1/sandboxes", json={"env": {"WHO": "me"}, "idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["id"] in pooled and sb["template"] == "base" and sb["state"] == "running", sb
        assert ("claim", sb["id"]) in fake.worker.calls
        assert fake.worker.runtimes[sb["id"]].spec.env["WHO"] == "me"
        assert (await c.get("/v1/templates/base/pool")).json()["claimed"] == 1

        # what a pool member cannot give: another memory size, a disk size of its own
        for body in ({"memory_mb": 256}, {"disk_mb": 2048}):
            r = await c.post("/v1/sandboxes", json={**body, "idle_timeout_s": 0})
            assert r.status_code == 201, r.text
            assert r.json()["id"] not in pooled, body
        assert (await c.get("/v1/templates/base/pool")).json()["claimed"] == 1
        await _pool(c, lambda p: p["ready"] == 2)  # refilled after the claim
        # the ledger's index of members (what a claim reads) is the same as a scan of every record
        indexed = {r.id for r in fake.manager.ledger.cache.pooled("base") if r.pooled}
        assert indexed == {r.id for r in fake.manager.live() if r.pooled} and sb["id"] not in indexed
        assert len(indexed) == 2

        r = await c.put("/v1/templates/base/pool", json={"min": 5, "max": 5})
        assert r.status_code == 400 and "ATOLL_DEFAULT_POOL" in r.json()["error"]["message"], r.text


async def test_without_a_default_pool_base_has_none(fake):
    c = fake.http
    await asyncio.sleep(0.3)  # a few keeper passes
    pool = (await c.get("/v1/templates/base/pool")).json()
    assert (pool["min"], pool["max"], pool["desired"], pool["ready"], pool["starting"]) == (0, 0, 0, 0, 0)
    assert not any(r.pooled for r in fake.manager.live())
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
    assert r.status_code == 201 and ("claim", r.json()["id"]) not in fake.worker.calls


@pytest.mark.parametrize("raw", ["x", "abc", "1e9", "2.5", "0x2", "-1", "201"])
def test_a_bad_default_pool_is_refused_at_start_naming_the_variable(raw, tmp_path):
    """Not a number or out of range: the message names the variable, the value, the range allowed
    and how to fix it (`'abc' is not an integer` used to give no range)."""
    with pytest.raises(config.SettingsError) as e:
        settings.load({"ATOLL_DEFAULT_POOL": raw, "ATOLL_HOME": str(tmp_path)})
    message = str(e.value)
    assert "ATOLL_DEFAULT_POOL" in message and raw.lstrip("-") in message, message
    assert f"a whole number in 0-{pools.MAX_POOL}, or unset it for the default 2" in message, message


def test_the_default_pool_is_two_and_zero_turns_it_off(tmp_path):
    assert settings.load({"ATOLL_HOME": str(tmp_path)}).default_pool == 2
    assert settings.load({"ATOLL_HOME": str(tmp_path), "ATOLL_DEFAULT_POOL": "0"}).default_pool == 0


async def test_pool_members_made_before_the_worker_s_agent_changed_are_replaced(tmp_path):
    """A worker restarted with another guest agent or runsc keeps its frozen pool members, whose
    memory holds the old agent: the pool replaces them and never hands one out."""
    async with FakeAtoll(tmp_path, api_key=KEY, default_pool=2) as first:
        await _pool(first.http, lambda p: p["ready"] == 2)
        worker = first.worker
        old = {r.id for r in first.manager.live() if r.pooled}
    worker.runtime_key = "2"  # the worker restarts with a new agent; its sandboxes stay
    assert {sid for sid, rt in worker.runtimes.items() if rt.phase.value == "frozen"} == old
    async with FakeAtoll(tmp_path, [worker], api_key=KEY, default_pool=2) as second:
        c = second.http

        def fresh(p) -> bool:
            pooled = {r.id for r in second.manager.live() if r.pooled}
            return p["ready"] == 2 and not pooled & old

        await _pool(c, fresh)
        assert all(sid not in worker.runtimes for sid in old)  # deleted on the worker
        r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert ("claim", sid) in worker.calls and sid not in old
        assert worker.runtimes[sid].runtime_key == "2"
        assert not [call for call in worker.calls if call[0] == "claim refused"]


async def test_a_member_the_control_plane_has_not_yet_heard_is_stale_is_refused_by_its_worker(tmp_path):
    """Between a change and the next reconciliation the worker itself refuses to hand out an old
    member: the create is served from the snapshot instead, and the member is replaced."""
    async with FakeAtoll(tmp_path, api_key=KEY, default_pool=2) as fake:
        c = fake.http
        await _pool(c, lambda p: p["ready"] == 2)
        old = {r.id for r in fake.manager.live() if r.pooled}
        fake.worker.runtime_key = "2"  # no reconciliation runs before the create (30 s apart)
        r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert sid not in old and fake.worker.runtimes[sid].runtime_key == "2"
        refused = [s for verb, s in fake.worker.calls if verb == "claim refused"]
        assert len(refused) == 1 and refused[0] in old
        # the refused member is deleted, and the pool is made whole with members of the new key
        pool = await _pool(c, lambda p: p["ready"] == 2 and refused[0] not in fake.worker.runtimes)
        assert pool["claimed"] == 0
        members = [r.id for r in fake.manager.live() if r.pooled]
        assert all(fake.worker.runtimes[m].runtime_key == "2" for m in members if m not in old)


async def _replaced(fake, old: set[str]) -> set[str]:
    """Waits until the pool is whole again without any of `old`; its members now."""

    def fresh(p) -> bool:
        pooled = {r.id for r in fake.manager.live() if r.pooled}
        return p["ready"] == 2 and not pooled & old

    await _pool(fake.http, fresh)
    return {r.id for r in fake.manager.live() if r.pooled}


@pytest.mark.parametrize("change", ["ATOLL_SANDBOX_CA_FILE", "installation CA"])
async def test_pool_members_that_trust_other_certificates_than_a_new_sandbox_are_replaced(change, tmp_path):
    """A worker restarted with another ATOLL_SANDBOX_CA_FILE, or a server whose CA was made again
    (its `ca/` moved away), keeps its frozen pool members, which trust the old certificates: the
    pool replaces them at the adoption (the worker learns the root before its inventory is read,
    so no create is offered one) and never hands one out."""
    from atoll.controlplane.authority import Authority

    worker = FakeWorker()
    worker.sandbox_ca = "proxy CA 1\n"
    authority = Authority.open(str(tmp_path / "server"))
    async with FakeAtoll(tmp_path, [worker], api_key=KEY, default_pool=2, authority=authority) as first:
        await _pool(first.http, lambda p: p["ready"] == 2)
        old = {r.id for r in first.manager.live() if r.pooled}
    assert {worker.runtimes[sid].trust for sid in old} == {(authority.root_pem.decode(), "proxy CA 1\n")}
    if change == "ATOLL_SANDBOX_CA_FILE":
        worker.sandbox_ca = "proxy CA 2\n"
    else:
        os.rename(tmp_path / "server" / "ca", tmp_path / "old-ca")
        authority = Authority.open(str(tmp_path / "server"))  # a new root
    now = (authority.root_pem.decode(), worker.sandbox_ca)
    async with FakeAtoll(tmp_path, [worker], api_key=KEY, default_pool=2, authority=authority) as second:
        members = await _replaced(second, old)
        assert all(sid not in worker.runtimes for sid in old)  # deleted on the worker
        assert {worker.runtimes[sid].trust for sid in members} == {now}
        r = await second.http.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert ("claim", sid) in worker.calls and sid in members
        assert worker.runtimes[sid].trust == now
        assert not [call for call in worker.calls if call[0] == "claim refused"]


async def test_a_member_another_server_claimed_first_is_left_to_it(tmp_path, database_url, database_kind):
    """Two servers sharing the records (PostgreSQL) may both read a pool member: the claim is taken
    in the records before the worker is touched, so the one that comes second (its copy stale)
    claims another member or restores — it never touches, nor deletes, the sandbox the first one
    handed out."""
    if database_kind != "postgresql":
        pytest.skip("only servers sharing the records (PostgreSQL) claim concurrently")
    from atoll.controlplane import db as dbm

    async with FakeAtoll(tmp_path, api_key=KEY, default_pool=1, database_url=database_url) as fake:
        c = fake.http
        await _pool(c, lambda p: p["ready"] == 1)
        (member,) = [r for r in fake.manager.live() if r.pooled]
        other = dbm.Database(database_url)  # another server claims it first
        try:
            theirs = other.get(member.id)
            theirs.pooled, theirs.tenant_id = False, "other-tenant"
            other.save(theirs, fields=["pooled", "tenant_id"])
        finally:
            other.engine.dispose()
        r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
        assert r.status_code == 201, r.text
        assert r.json()["id"] != member.id
        assert ("claim", member.id) not in fake.worker.calls
        assert ("delete", member.id) not in fake.worker.calls
        rec = fake.manager.db.get(member.id)
        assert rec is not None and rec.state != "deleted" and rec.tenant_id == "other-tenant"
