"""Removing a lost worker: its archived sandboxes move to another worker through the shared store
(the worker verb `adopt`, over real HTTP between a control plane and two FakeWorkers sharing one
store), an `on_worker_lost: "restore"` one comes back from its last archive, the others fail with
the reason. The real adoption (layers, restore) is
tests/integration/test_adopt.py's."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from atoll.core.lifecycle import Phase
from atoll.testing import FakeAtoll, FakeWorker, free_port
from tests.component.test_worker_protocol import KEY, _serve, _worker


async def _wait(c: httpx.AsyncClient, name: str, state: str) -> None:
    for _ in range(300):
        ws = {w["name"]: w for w in (await c.get("/v1/workers")).json()["items"]}
        if name in ws and ws[name]["state"] == state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"worker {name} never became {state}: {ws}")


@pytest.fixture
async def two(tmp_path):
    store: dict = {}
    async with FakeAtoll(tmp_path, [], api_key=KEY) as cp:
        cp.manager.workers.lost_after_s = 1.0
        port = free_port()
        async with _serve(cp.app, port):
            url = f"http://127.0.0.1:{port}"
            w1, w2 = FakeWorker("w1", store=store), FakeWorker("w2", installation="fake01", store=store)
            http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            async with contextlib.AsyncExitStack() as stack:
                reg1, _, _ = await stack.enter_async_context(_worker(url, w1))
                await _wait(http, "w1", "ready")
                yield cp, http, (w1, reg1), stack, url, w2
            await http.aclose()


async def test_a_removed_workers_archived_sandbox_resumes_on_another(two):
    cp, c, (w1, reg1), stack, url, w2 = two
    archived = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    running = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    on_disk = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    body = {"idle_timeout_s": 0, "on_worker_lost": "restore"}
    restored = (await c.post("/v1/sandboxes", json=body)).json()["id"]
    assert (await c.post(f"/v1/sandboxes/{restored}/pause", json={"tier": "archive"})).status_code == 200
    assert (await c.post(f"/v1/sandboxes/{restored}/resume")).json()["state"] == "running"  # archive kept
    r = await c.post(f"/v1/sandboxes/{archived}/pause", json={"tier": "archive"})
    assert r.status_code == 200 and r.json()["standby_tier"] == "archive", r.text
    assert (await c.post(f"/v1/sandboxes/{on_disk}/pause", json={"tier": "disk"})).status_code == 200
    await stack.enter_async_context(_worker(url, w2))
    await _wait(c, "w2", "ready")
    w1_id = {w["name"]: w["id"] for w in (await c.get("/v1/workers")).json()["items"]}["w1"]
    r = await c.delete(f"/v1/workers/{w1_id}")  # refused while it is ready
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
    reg1.heartbeat_s = 60  # w1 stops heartbeating: lost
    await _wait(c, "w1", "lost")
    assert (await c.delete(f"/v1/workers/{w1_id}")).status_code == 204

    sb = (await c.get(f"/v1/sandboxes/{archived}")).json()
    assert (sb["state"], sb["standby_tier"], sb["worker"]) == ("standby", "archive", "w2"), sb
    assert w2.runtimes[archived].phase == Phase.ARCHIVED and ("adopt", archived) in w2.calls
    r = await c.post(f"/v1/sandboxes/{archived}/exec", json={"cmd": "true"})
    assert r.status_code == 200, r.text
    sb = (await c.get(f"/v1/sandboxes/{archived}")).json()
    assert (sb["state"], sb["worker"]) == ("running", "w2") and w2.runtimes[archived].phase == Phase.RUNNING
    sb = (await c.get(f"/v1/sandboxes/{restored}")).json()  # its policy: back from its archive
    assert (sb["state"], sb["worker"]) == ("running", "w2") and w2.runtimes[restored].phase == Phase.RUNNING
    for sid, why in ((running, "not in the archive tier"), (on_disk, "not in the archive tier")):
        sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
        assert sb["state"] == "failed" and "w1" in sb["failure_reason"] and why in sb["failure_reason"], sb


async def test_an_archive_no_worker_can_adopt_fails_with_the_reason(two):
    """Nothing to adopt it (the store lost it): failed, saying why; nothing half-made on w2."""
    cp, c, (w1, reg1), stack, url, w2 = two
    sid = (await c.post("/v1/sandboxes", json={"idle_timeout_s": 0})).json()["id"]
    assert (await c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})).status_code == 200
    w1.store.clear()
    await stack.enter_async_context(_worker(url, w2))
    await _wait(c, "w2", "ready")
    reg1.heartbeat_s = 60
    await _wait(c, "w1", "lost")
    w1_id = {w["name"]: w["id"] for w in (await c.get("/v1/workers")).json()["items"]}["w1"]
    assert (await c.delete(f"/v1/workers/{w1_id}")).status_code == 204
    sb = (await c.get(f"/v1/sandboxes/{sid}")).json()
    assert sb["state"] == "failed" and "no archive in the store" in sb["failure_reason"], sb
    assert sid not in w2.runtimes
