"""The archive tier through the real control plane over the fake worker: pause tier "archive" from
running, memory and disk; a store failure leaves the sandbox in the disk tier with the reason; any
call resumes an archived sandbox transparently; the order of tiers holds."""

from __future__ import annotations

import asyncio

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


async def test_bad_tier_is_a_clear_400(fake):
    c = fake.http
    sid = await create(c)
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "glacier"})
    assert r.status_code == 400, r.text
    assert "archive" in r.text and "Traceback" not in r.text


async def test_standby_policy_aliases_and_the_archive_step(fake):
    c = fake.http
    r = await c.post(
        "/v1/sandboxes", json={"standby": {"memory_s": 0.3, "disk_s": 0.3, "archive_after_s": 1}}
    )
    assert r.status_code == 201, r.text
    sb = r.json()
    assert (sb["idle_timeout_s"], sb["disk_after_s"]) == (0.3, 0.3)
    assert sb["standby"] == {"memory_s": 0.3, "disk_s": 0.3, "archive_after_s": 1.0}
    sid = sb["id"]
    seen = []
    for _ in range(100):
        sb = await _sb(c, sid)
        seen.append(sb["standby_tier"])
        if sb["standby_tier"] == "archive":
            break
        await asyncio.sleep(0.05)
    assert seen[-1] == "archive" and "disk" in seen, seen
    # archived by the policy: a call brings it back
    assert (await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200
    # PATCH changes archive_after_s alone
    r = await c.patch(f"/v1/sandboxes/{sid}", json={"archive_after_s": 0})
    assert r.status_code == 200 and r.json()["standby"]["archive_after_s"] == 0, r.text


async def test_standby_aliases_that_disagree_are_refused_naming_both(fake):
    # (this API answers every invalid body 400 invalid_request, never 422)
    c = fake.http
    r = await c.post("/v1/sandboxes", json={"idle_timeout_s": 10, "standby": {"memory_s": 20}})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "standby.memory_s" in msg and "idle_timeout_s" in msg, msg
    # the same value in both forms is fine; an unknown key or a negative value is refused
    r = await c.post("/v1/sandboxes", json={"disk_after_s": 60, "standby": {"disk_s": 60}})
    assert r.status_code == 201, r.text
    for bad in ({"memory": 1}, {"archive_after_s": -1}, {"disk_s": "soon"}):
        r = await c.post("/v1/sandboxes", json={"standby": bad})
        assert r.status_code == 400 and "standby" in r.text, r.text


async def test_policy_retries_an_archive_the_store_refused(fake):
    c, worker = fake.http, fake.worker
    worker.fail.add("archive")
    sid = (
        await c.post(
            "/v1/sandboxes", json={"standby": {"memory_s": 0.2, "disk_s": 0.2, "archive_after_s": 0.5}}
        )
    ).json()["id"]
    for _ in range(100):
        sb = await _sb(c, sid)
        if sb["standby_tier"] == "disk" and sb["standby_reason"]:
            break
        await asyncio.sleep(0.05)
    assert "kept in the disk tier" in sb["standby_reason"], sb
    assert worker.phase(sid) == "checkpointed"


async def test_sdk_pause_archive_and_create_standby(fake):
    import httpx

    import atoll
    from tests.component.conftest import KEY

    async with atoll.AsyncClient(
        "http://fake.test", KEY, transport=httpx.ASGITransport(app=fake.app)
    ) as client:
        sb = await client.sandboxes.create(standby={"memory_s": 0, "archive_after_s": 3600})
        assert sb.data["standby"]["archive_after_s"] == 3600
        await sb.pause(tier="archive")
        assert (sb.state, sb.standby_tier) == ("standby", "archive")
        await sb.resume()
        assert sb.state == "running"
        await sb.update(archive_after_s=0)
        assert sb.data["standby"]["archive_after_s"] == 0
