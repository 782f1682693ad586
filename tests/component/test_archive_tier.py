"""The archive tier through the real control plane over the fake worker: pause tier "archive" from
running, memory and disk; a store failure leaves the sandbox in the disk tier with the reason; any
call resumes an archived sandbox transparently; the order of tiers holds."""

from __future__ import annotations

from tests.component.conftest import create


async def _sb(c, sid):
    return (await c.get(f"/v1/sandboxes/{sid}")).json()


async def test_pause_to_archive_from_running_then_any_call_resumes(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    sb = (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})).json()
    assert (sb["state"], sb["standby_tier"], sb["standby_reason"]) == ("standby", "archive", None), sb
    assert worker.phase(sid) == "archived"
    assert [v for v, s in worker.calls if s == sid][-2:] == ["checkpoint", "archive"]
    # pausing again to archive changes nothing; to a warmer tier needs a resume first
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})).status_code == 200
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
    assert r.status_code == 409 and "resume first" in r.json()["error"]["message"]
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text
    assert (await _sb(c, sid))["state"] == "running"
    assert [v for v, s in worker.calls if s == sid][-3:-1] == ["unarchive", "restore"]


async def test_pause_to_archive_from_memory_and_disk(fake):
    c = fake.http
    for first in ("memory", "disk"):
        sid = await create(c)
        assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": first})).status_code == 200
        sb = (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})).json()
        assert sb["standby_tier"] == "archive", sb
        assert (await c.post(f"/v1/sandboxes/{sid}/resume")).json()["state"] == "running"


async def test_store_failure_keeps_the_sandbox_on_disk_with_the_reason(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c)
    worker.fail.add("archive")
    sb = (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})).json()
    assert (sb["state"], sb["standby_tier"]) == ("standby", "disk"), sb
    assert "kept in the disk tier" in sb["standby_reason"]
    assert worker.phase(sid) == "checkpointed"
    worker.fail.discard("archive")  # the store is back: a later pause archives it
    sb = (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})).json()
    assert sb["standby_tier"] == "archive" and sb["standby_reason"] is None, sb


async def test_bad_tier_is_a_clear_422(fake):
    c = fake.http
    sid = await create(c)
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "glacier"})
    assert r.status_code in (400, 422), r.text
    assert "archive" in r.text and "Traceback" not in r.text
