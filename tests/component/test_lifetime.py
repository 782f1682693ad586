"""Lifetimes, PATCH and metrics over the fake worker: the real control plane (routes, SQLite, the
tier policy) decides when a lifetime ends and what PATCH changes; the fake worker only holds state."""

from __future__ import annotations

import asyncio
import datetime as dt

from atoll.testing import FakeAtoll
from tests.component.conftest import KEY, create


async def _until(pred, timeout: float = 6.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def _when(iso: str) -> dt.datetime:
    return dt.datetime.fromisoformat(iso)


async def test_create_shows_the_lifetime_and_no_lifetime_by_default(fake):
    c = fake.http
    plain = (await c.get(f"/v1/sandboxes/{await create(c)}")).json()
    assert plain["expires_at"] is None and plain["on_timeout"] == "pause"
    before = dt.datetime.now(dt.UTC)
    r = await c.post("/v1/sandboxes", json={"timeout_s": 600, "on_timeout": "delete"})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["on_timeout"] == "delete"
    left = (_when(body["expires_at"]) - before).total_seconds()
    assert 595 <= left <= 605


async def test_pause_expiry_moves_to_disk_then_clears_the_lifetime(fake):
    c, worker = fake.http, fake.worker
    sid = await create(c, timeout_s=0.5)  # idle_timeout_s=0: only the lifetime acts

    async def on_disk():
        return (await c.get(f"/v1/sandboxes/{sid}")).json()["standby_tier"] == "disk"

    await _until(on_disk)
    body = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert body["state"] == "standby" and body["expires_at"] is None
    assert ("checkpoint", sid) in worker.calls
    # a call resumes it; it then lives on without a lifetime
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text
    after = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert after["state"] == "running" and after["expires_at"] is None


async def test_delete_expiry_deletes_from_standby_too(fake):
    c = fake.http
    sid = await create(c, timeout_s=0.6, on_timeout="delete")
    r = await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "memory"})
    assert r.status_code == 200

    async def gone():
        return (await c.get(f"/v1/sandboxes/{sid}")).status_code == 404

    await _until(gone)


async def test_patch_extends_removes_and_changes_settings_live(fake):
    c = fake.http
    sid = await create(c, timeout_s=0.8, on_timeout="delete")
    r = await c.patch(f"/v1/sandboxes/{sid}", json={"timeout_s": 3600, "metadata": {"team": "a"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["metadata"] == {"team": "a"} and body["on_timeout"] == "delete"
    assert (_when(body["expires_at"]) - dt.datetime.now(dt.UTC)).total_seconds() > 3500
    await asyncio.sleep(1.2)  # past the first deadline: the extension holds
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    r = await c.patch(f"/v1/sandboxes/{sid}", json={"timeout_s": None})
    assert r.json()["expires_at"] is None and r.json()["metadata"] == {"team": "a"}
    # idle_timeout_s applied live: the policy freezes it on its next passes
    r = await c.patch(f"/v1/sandboxes/{sid}", json={"idle_timeout_s": 0.2, "disk_after_s": 0})
    assert r.json()["idle_timeout_s"] == 0.2 and r.json()["disk_after_s"] == 0

    async def frozen():
        return (await c.get(f"/v1/sandboxes/{sid}")).json()["standby_tier"] == "memory"

    await _until(frozen)
    # PATCH in standby does not resume it
    r = await c.patch(f"/v1/sandboxes/{sid}", json={"on_timeout": "pause"})
    assert r.status_code == 200 and r.json()["state"] == "standby" and r.json()["on_timeout"] == "pause"


async def test_patch_bad_input_is_400_naming_the_problem_and_changes_nothing(fake):
    c = fake.http
    sid = await create(c, timeout_s=3600)
    before = (await c.get(f"/v1/sandboxes/{sid}")).json()
    cases = [
        ({"colour": "red"}, "colour"),
        ({"timeout_s": 0}, "in the past"),
        ({"timeout_s": -5}, "timeout_s=-5"),
        ({"timeout_s": "soon"}, "number of seconds"),
        ({"timeout_s": True}, "number of seconds"),
        ({"timeout_s": 10**9}, "30 days"),
        ({"on_timeout": "explode"}, "on_timeout"),
        ({"idle_timeout_s": -1}, "idle_timeout_s"),
        ({"idle_timeout_s": None}, "cannot be null"),
        ({"metadata": "x"}, "metadata"),
    ]
    for body, needle in cases:
        r = await c.patch(f"/v1/sandboxes/{sid}", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and needle in err["message"], (body, err)
    assert (await c.get(f"/v1/sandboxes/{sid}")).json() == {**before, "updated_at": before["updated_at"]}
    r = await c.patch("/v1/sandboxes/sb-0000000000000000", json={"timeout_s": 5})
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    await c.delete(f"/v1/sandboxes/{sid}")
    assert (await c.patch(f"/v1/sandboxes/{sid}", json={})).status_code == 404


async def test_create_refuses_bad_lifetimes(fake):
    c = fake.http
    for body, needle in [
        ({"timeout_s": 0}, "in the past"),
        ({"timeout_s": -1}, "in the past"),
        ({"timeout_s": "1h"}, "number of seconds"),
        ({"timeout_s": 1e12}, "30 days"),
        ({"on_timeout": "stop"}, "on_timeout"),
    ]:
        r = await c.post("/v1/sandboxes", json=body)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"]
    assert (await c.get("/v1/sandboxes")).json()["items"] == []  # nothing was made


async def test_a_restart_keeps_the_lifetime_and_enforces_it(tmp_path):
    async with FakeAtoll(tmp_path, api_key=KEY) as first:
        worker = first.worker
        sid = await create(first.http, timeout_s=1.5, on_timeout="delete")
        expires = (await first.http.get(f"/v1/sandboxes/{sid}")).json()["expires_at"]
    async with FakeAtoll(tmp_path, [worker], api_key=KEY) as second:
        body = (await second.http.get(f"/v1/sandboxes/{sid}")).json()
        assert body["expires_at"] == expires and body["on_timeout"] == "delete"

        async def gone():
            return (await second.http.get(f"/v1/sandboxes/{sid}")).status_code == 404

        await _until(gone)


async def test_forks_inherit_the_deadline(fake):
    c = fake.http
    sid = await create(c, timeout_s=3600, on_timeout="delete")
    parent = (await c.get(f"/v1/sandboxes/{sid}")).json()
    r = await c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 201, r.text
    for copy in r.json()["items"]:
        assert copy["expires_at"] == parent["expires_at"] and copy["on_timeout"] == "delete"


async def test_metrics_running_standby_and_unknown(fake):
    c = fake.http
    sid = await create(c)
    r = await c.get(f"/v1/sandboxes/{sid}/metrics")
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["state"] == "running" and m["processes"] == 0 and m["memory_limit_mb"] == 512
    assert set(m) >= {"cpu_percent", "memory_used_mb", "memory_limit_mb", "disk_used_mb", "disk_limit_mb"}
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})).status_code == 200
    m = (await c.get(f"/v1/sandboxes/{sid}/metrics")).json()
    assert m["state"] == "standby" and m["standby_tier"] == "disk"
    assert m["cpu_percent"] == 0 and m["processes"] is None
    assert (await c.get(f"/v1/sandboxes/{sid}")).json()["state"] == "standby"  # not woken
    r = await c.get("/v1/sandboxes/sb-0000000000000000/metrics")
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    r = await c.get("/v1/sandboxes/nope/metrics")
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


async def test_a_gated_pause_expiry_stays_in_memory_with_its_lifetime_and_is_not_retried_at_once(fake):
    c, worker = fake.http, fake.worker
    worker.gate_blockers = ["process 7 (node) watches TCP sockets with epoll"]
    sid = await create(c, timeout_s=0.3)

    async def in_memory():
        return (await c.get(f"/v1/sandboxes/{sid}")).json()["standby_tier"] == "memory"

    await _until(in_memory)
    await asyncio.sleep(1.0)  # several policy passes: the gate is not asked again before its retry time
    body = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert body["expires_at"] is not None and "epoll" in body["standby_reason"]
    pauses = [v for v, s in worker.calls if s == sid and v == "pause"]
    assert len(pauses) == 1, worker.calls
