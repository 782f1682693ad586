"""Builds in the object store on the control plane (issue 21): a template build its worker
published (`in_store: true`) may serve a create on a worker that never built it, which fetches it
by id — once for concurrent creates; without the store, creates go to the worker holding the
build; a build on no worker and not in the store is a 409 build_unavailable naming the template,
the build and the fix, never a 500. Over FakeWorkers (in process, and over real HTTP for a worker
that is lost and removed); the real fetch is tests/unit/test_buildpack.py's and
tests/integration/test_build_fetch.py's."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from atoll.testing import FakeAtoll, FakeWorker, free_port
from tests.component.test_move_archived import _wait
from tests.component.test_templates import build, wait_status
from tests.component.test_worker_protocol import KEY, _serve, _worker

SPEC = {"name": "web", "from": "base", "files": {"/app/marker": "hi\n"}}


async def _in_store(c: httpx.AsyncClient, name: str) -> dict:
    # a deadline, not 200 polls: on a loaded machine (`make test` on four processes, load ~5) the
    # fake build and its publication took longer than the ~2 s those polls gave
    deadline = time.monotonic() + 30
    while True:
        t = (await c.get(f"/v1/templates/{name}")).json()
        if t["in_store"]:
            return t
        if time.monotonic() > deadline:
            raise AssertionError(f"template {name} never showed in_store in 30 s: {t}")
        await asyncio.sleep(0.01)


async def _builder_then_another(cp: FakeAtoll, published: dict | None) -> tuple[FakeWorker, FakeWorker, str]:
    """The template built on w1 (the only worker then), then w2 joins, far larger: placement
    would rather put creates there."""
    w1 = cp.worker
    started = await build(cp.http, SPEC)
    await wait_status(cp.http, "web", "ready")
    w2 = FakeWorker("w2", installation="fake01", memory_mb=1 << 20, published=published)
    cp.workers.append(w2)
    await cp.manager.workers.attach_local(w2)
    assert ("build", started["build_id"]) in w1.calls
    return w1, w2, started["build_id"]


async def test_a_published_build_serves_creates_on_a_worker_that_never_built_it(tmp_path):
    published: dict = {}
    async with FakeAtoll(
        tmp_path, [FakeWorker("w1", memory_mb=2048, published=published)], api_key=KEY
    ) as cp:
        c = cp.http
        cp.worker.delay["publish"] = 0.05  # shown ready first, then in the store
        w1, w2, bid = await _builder_then_another(cp, published)
        t = await _in_store(c, "web")
        assert t["current_build_id"] == bid
        w2.delay["fetch_build"] = 0.05
        # 3 creates at once: w2 (far less committed) takes them, fetching the build once
        rs = await asyncio.gather(
            *(c.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0}) for _ in range(3))
        )
        assert all(r.status_code == 201 for r in rs), [r.text for r in rs]
        assert {r.json()["worker"] for r in rs} == {"w2"}
        assert {r.json()["build_id"] for r in rs} == {bid}
        assert [x for x in w2.calls if x[0] == "fetch_build"] == [("fetch_build", bid)]
        assert ("build", bid) not in w2.calls  # never built there
        # deleting the template deletes every copy, and its entry in the store
        for r in rs:
            assert (await c.delete(f"/v1/sandboxes/{r.json()['id']}")).status_code == 204
        assert (await c.delete("/v1/templates/web")).status_code == 204
        assert ("delete_build", bid) in w1.calls and ("delete_build", bid) in w2.calls
        assert bid not in published


async def test_without_the_store_creates_go_to_the_worker_holding_the_build(tmp_path):
    async with FakeAtoll(tmp_path, [FakeWorker("w1", memory_mb=2048)], api_key=KEY) as cp:
        c = cp.http
        w1, w2, bid = await _builder_then_another(cp, None)
        assert (await c.get("/v1/templates/web")).json()["in_store"] is False
        for _ in range(3):  # w2 is far less committed, but lacks the build and cannot fetch it
            r = await c.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0})
            assert r.status_code == 201 and r.json()["worker"] == "w1", r.text
        assert not [x for x in w2.calls if x[0] in ("fetch_build", "create")]


@pytest.fixture
async def remote(tmp_path):
    """A control plane over real HTTP; w1 registered (w2 not yet); `published` the fakes' store."""
    async with FakeAtoll(tmp_path, [], api_key=KEY) as cp:
        cp.manager.workers.lost_after_s = 1.0
        port = free_port()
        async with _serve(cp.app, port):
            url = f"http://127.0.0.1:{port}"
            http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            async with contextlib.AsyncExitStack() as stack:
                yield cp, http, stack, url
            await http.aclose()


async def _lose_and_remove(c: httpx.AsyncClient, reg, name: str) -> None:
    reg.heartbeat_s = 60  # it stops heartbeating: lost
    await _wait(c, name, "lost")
    wid = {w["name"]: w["id"] for w in (await c.get("/v1/workers")).json()["items"]}[name]
    assert (await c.delete(f"/v1/workers/{wid}")).status_code == 204


async def test_a_build_on_no_worker_and_not_in_the_store_is_409_build_unavailable(remote):
    cp, c, stack, url = remote
    w1, w2 = FakeWorker("w1"), FakeWorker("w2", installation="fake01")
    reg1, _, _ = await stack.enter_async_context(_worker(url, w1))
    await _wait(c, "w1", "ready")
    started = await build(c, SPEC)
    await wait_status(c, "web", "ready")
    await stack.enter_async_context(_worker(url, w2))
    await _wait(c, "w2", "ready")
    reg1.heartbeat_s = 60
    await _wait(c, "w1", "lost")
    # lost, not removed: it may come back -> 503 worker_unavailable (retryable), naming it
    r = await c.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
    assert "w1 (lost)" in r.json()["error"]["message"] and r.json()["error"]["retryable"] is True
    wid = {w["name"]: w["id"] for w in (await c.get("/v1/workers")).json()["items"]}["w1"]
    assert (await c.delete(f"/v1/workers/{wid}")).status_code == 204
    r = await c.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0})
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "build_unavailable" and err["retryable"] is False
    assert "'web'" in err["message"] and started["build_id"] in err["message"]
    assert "build the template again" in err["message"]
    # a template FROM it cannot be built either, with the same answer
    r = await c.post("/v1/templates", json={"name": "child", "from": "web", "run": ["true"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "build_unavailable", r.text
    assert not [x for x in w2.calls if x[0] == "create"]
    # the fix works: build it again, on w2
    again = await build(c, SPEC)
    await wait_status(c, "web", "ready", again["build_id"])
    r = await c.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0})
    assert r.status_code == 201 and r.json()["worker"] == "w2", r.text


async def test_a_published_build_outlives_the_worker_that_built_it(remote):
    cp, c, stack, url = remote
    published: dict = {}
    w1 = FakeWorker("w1", published=published)
    w2 = FakeWorker("w2", installation="fake01", published=published)
    reg1, _, _ = await stack.enter_async_context(_worker(url, w1))
    await _wait(c, "w1", "ready")
    started = await build(c, SPEC)
    await _in_store(c, "web")
    await stack.enter_async_context(_worker(url, w2))
    await _wait(c, "w2", "ready")
    await _lose_and_remove(c, reg1, "w1")
    r = await c.post("/v1/sandboxes", json={"template": "web", "idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    assert (r.json()["worker"], r.json()["build_id"]) == ("w2", started["build_id"])
    assert ("fetch_build", started["build_id"]) in w2.calls
    # a template FROM it builds on w2 too (the parent fetched there already)
    child = await build(c, {"name": "child", "from": "web", "run": ["true"]})
    await wait_status(c, "child", "ready", child["build_id"])
    assert ("build", child["build_id"]) in w2.calls
